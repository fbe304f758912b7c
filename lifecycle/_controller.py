"""``LifecycleController``: one lock, check -> act -> commit.

Every transition travels the same road: take the lock; look the (trigger, phase) pair up in
the refusal table (no-op, failure result or typed rejection); prepare every component's move
(allocate and copy; nothing is re-pointed, so a failure or a cancellation is undone by
dropping what was prepared); commit all moves (re-pointing only, cannot fail); fire the
trigger on the ``transitions`` machine; log one summary event.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Self, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import torch
from torch import nn
from transitions import Machine

from strategies import (
    ComponentResidencyError,
    DeviceLayer,
    ResidencyConfig,
    ResidencyMode,
    ResidencyStrategy,
    StoreError,
    disable_layerwise_offload,
    enable_layerwise_offload,
    is_fsdp_managed,
    is_layerwise_offloaded,
    layerwise_blocks,
    make_device_layer,
)
from strategies.protocol import (
    ComputeGuard,
    DiscardMove,
    Move,
    PreparedMove,
    Shape,
    TensorStore,
    UndiscardMove,
    Unit,
    build_strategy,
    needs_restore,
    prepare_regroup,
    prepare_restore,
)

from . import _events as events
from ._admission import Admission
from ._checkpoint import gbps
from ._checksum import ChecksumAlgorithm, check_expected, check_hashes, component_checksum
from ._discard import Discard, prepare_sleep, prepare_wake, refuse_stale, resolve_discard, stale_counts
from ._errors import (
    NOT_INITIALIZED,
    ComponentAsleep,
    ComponentBusy,
    ComponentNotPlaced,
    DrainTimeout,
    FSDPInferenceUnsupported,
    GroupBroken,
    InvalidRequest,
    RanksDisagree,
    TransitionFailed,
    TransitionRejected,
    UnknownComponent,
    failures_roll_back,
    forget_locals,
)
from ._events import get_logger
from ._group import GroupFailure, RankGroup, Section
from ._lora import LoraBases, parse_mode, parse_scale, plan_lora_from_tensors
from ._phase import REFUSALS, TRANSITIONS, Phase, Refusal
from ._pipeline import components_of
from ._planner import (
    ComponentSizes,
    Measurements,
    ResidencyPlan,
    Use,
    declared_uses,
    make_plan,
    parse_budget,
)
from ._results import (
    ComponentPlacement,
    OccupationResult,
    PlacementReport,
    RankChecksums,
    ResidencyChange,
    TensorHashCheck,
    UpdateResult,
    WeightUpdateGroupResult,
    WeightUpdateGroupState,
)
from ._updates import (
    UpdatePlan,
    UpdateRefused,
    plan_from_disk,
    plan_from_tensors,
)
from ._uses import Component, UseRecord, Uses
from ._weight_sync import DEFAULT_BUCKET_BYTES, DEFAULT_TIMEOUT, WeightSync

__all__ = ["LifecycleController"]

_log = get_logger("lifecycle")
_ids = itertools.count(1)
_controller_ids = itertools.count(1)
_R = TypeVar("_R", OccupationResult, UpdateResult)
_VALID = frozenset((t.trigger, t.source) for t in TRANSITIONS)
_ALONE: AbstractAsyncContextManager[None] = contextlib.nullcontext()  # stateless: shared


@dataclass(frozen=True)
class _Direction:
    """What sleep and wake each do, described once: which units move, how they are
    prepared, which bytes a progress bar counts, and what happens around the move."""

    select: Callable[[ResidencyStrategy], list[Unit]]
    # (component, its selected units, progress, the components a sleep discards)
    prepare: Callable[[Component, list[Unit], Callable[[int], None], frozenset[str]],
                      Awaitable[Move | DiscardMove | UndiscardMove]]
    counts: Callable[[Unit], bool]  # bytes that will really be copied
    resync: bool  # take inventory again first (tensors replaced behind our back)
    empty_cache: bool  # give the freed blocks back to the driver after


_DIRECTIONS: dict[str, _Direction] = {
    "sleep": _Direction(
        select=lambda s: s.store.select("device"),
        prepare=prepare_sleep,
        counts=lambda u: u.dirty(), resync=True, empty_cache=True),
    "wake": _Direction(
        select=lambda s: [u for u in s.awake_units() if u.where == "host"],
        prepare=lambda c, units, progress, _: prepare_wake(c, units, progress),
        counts=lambda u: True, resync=False, empty_cache=False),
}


class _PhaseModel:
    """The ``transitions`` model: holds ``state`` and nothing else."""

    state: Phase


def _build_machine(model: _PhaseModel) -> Machine:
    return Machine(
        model=model,
        states=Phase,
        initial=Phase.UNINITIALIZED,
        transitions=[{"trigger": t.trigger, "source": t.source, "dest": t.dest}
                     for t in TRANSITIONS],
        auto_transitions=False,
    )


class LifecycleController:
    """Attaches a pipeline and moves its weights between device and host, transactionally.

    ``device``: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``; ``None`` picks CUDA
    when available. ``residency``: a :class:`~strategies.ResidencyConfig` or anything
    :meth:`ResidencyConfig.parse` takes. ``device_layer`` replaces the device layer (tests
    inject faults through it).
    """

    def __init__(self, device: str | torch.device | None = None, *,
                 use_fsdp_inference: bool = False, rank: int = 0,
                 residency: ResidencyConfig | str | Mapping[str, str] | list[str] | None = None,
                 drain_timeout: float | None = 30.0, admission_timeout: float | None = None,
                 auto_wake: bool = False, prefetch_components: bool = True,
                 progress: Callable[[str, int, int], None] | None = None,
                 device_layer: DeviceLayer | None = None, process_group: Any = None,
                 collective_timeout: float = 30.0,
                 device_budget: int | float | str | None = None,
                 activation_reserve: int | None = None,
                 prefetch_headroom: int = 2**30, discard_on_release: Discard = None) -> None:
        self._layer = device_layer if device_layer is not None else make_device_layer(device)
        # With a process group every transition is collective (see lifecycle._group).
        self._group = None if process_group is None else RankGroup(process_group,
                                                                   collective_timeout)
        self._section: Section | None = None
        if self._group is not None:
            rank = self._group.rank
        # In every event of this controller (with ``rank``): tells controllers of one process
        # apart, e.g. for lifecycle.metrics.
        self.id = next(_controller_ids)
        self.use_fsdp_inference = use_fsdp_inference
        self.rank = rank
        # residency="auto": plan at attach, from sizes alone, under ``device_budget``.
        self._auto = isinstance(residency, str) and residency.strip().lower() == "auto"
        if self._auto and device_budget is None:
            raise ValueError("residency='auto' needs a device_budget (bytes, '20GiB' or '90%')")
        if device_budget is not None and not self._auto:
            raise ValueError("device_budget is used with residency='auto' (or pass it to "
                             "plan()); got residency=" + repr(residency))
        self.device_budget = device_budget
        self.activation_reserve = activation_reserve
        # What every release_memory_occupation() discards unless told otherwise (the
        # reference's clients send an empty body): see lifecycle._discard.
        self.discard_on_release: Discard = discard_on_release
        self.config = ResidencyConfig() if self._auto else ResidencyConfig.parse(residency)
        self.last_plan: ResidencyPlan | None = None  # the plan attach applied (auto)
        self._measurements: Measurements | None = None
        self._warmup: Callable[[], Awaitable[object]] | None = None
        # Told (trigger, bytes copied so far, bytes to copy) during sleep and wake.
        self.progress = progress
        self._admission = Admission(drain_timeout, admission_timeout)
        self._fsm_model = _PhaseModel()
        self._fsm = _build_machine(self._fsm_model)
        # fast_acquire: an uncontended acquire does not yield to the loop (a clean sleep is
        # bookkeeping only; the moves themselves checkpoint between chunks).
        self._lock = anyio.Lock(fast_acquire=True)
        self._uses = Uses(self._admission, self._layer, lambda: self.phase, self.wake, rank,
                          self.id)
        self._uses.auto_wake = auto_wake
        self._uses.prefetch_components = prefetch_components
        # A request prefetch starts only when the device has the next component's bytes plus
        # this much free (the running component's activations need room too).
        self._uses.prefetch_headroom = prefetch_headroom
        self._transition: str | None = None
        self._version = 0
        self._enabled: list[nn.Module] = []  # modules attach() made layerwise-capable
        # Worker threads for planning, reading and hashing: the library's own, so that it
        # never takes the application's share of anyio's default limiter.
        self._threads = anyio.CapacityLimiter(2)
        self._lora = LoraBases()  # the pristine bases of LoRA-merged weights (lifecycle._lora)
        self._weight_sync = WeightSync()  # groups joined with trainers (lifecycle._weight_sync)
        self._label: str | None = None  # the trainer's weight_version of the served weights

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Detach the pipeline (if any) and stop the device layer's worker threads. The
        controller may be used again after (it restarts them)."""
        with anyio.CancelScope(shield=True):
            if self.phase is not Phase.UNINITIALIZED:
                await self.detach()
            await self._weight_sync.aclose()
            await anyio.to_thread.run_sync(self._layer.close, limiter=self._threads)

    # -- introspection -----------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._fsm_model.state

    @property
    def world_size(self) -> int:
        """Ranks this controller's transitions span (1 without a process group)."""
        return 1 if self._group is None else self._group.world_size

    def rebind(self, process_group: Any, collective_timeout: float | None = None) -> None:
        """Make the controller collective over ``process_group`` (a new group of the
        survivors after :class:`GroupBroken`, or a first group). The local state is kept
        as it is; the next collective call checks that every rank is in the same phase."""
        timeout = collective_timeout if collective_timeout is not None else (
            self._group.timeout if self._group is not None else 30.0)
        self._group = RankGroup(process_group, timeout)
        self.rank = self._uses.rank = self._group.rank

    def _collective(self, trigger: str) -> AbstractAsyncContextManager[None]:
        """Around a transition on every rank: agree on the phase first; an error before the
        deciding vote still votes (no on its way out), so the ranks stay in lock step. One
        rank: nothing to agree on (no generator made: a clean sleep enters this)."""
        return _ALONE if self._group is None else self._section_of(trigger, self._group)

    @asynccontextmanager
    async def _section_of(self, trigger: str, group: RankGroup) -> AsyncIterator[None]:
        if group.broken is not None:
            raise GroupBroken(trigger, self.phase, GroupFailure(group.broken), group.describe())
        try:
            phases = await group.phases(self.phase)
        except GroupFailure as exc:
            raise GroupBroken(trigger, self.phase, exc, group.describe()) from exc
        if phases is not None:
            raise RanksDisagree(trigger, self.phase, phases)
        section = self._section = Section(group)
        try:
            yield
        except BaseException as exc:
            if not section.closed:
                section.closed = True
                try:
                    failures = await section.vote(exc)
                except GroupFailure as broken:
                    raise GroupBroken(trigger, self.phase, broken, group.describe()) from exc
                if isinstance(exc, DrainTimeout):
                    exc.failed_ranks = failures
            raise
        finally:
            self._section = None

    async def _vote(self, trigger: str, error: BaseException | None, *, final: bool
                    ) -> dict[int, str]:
        """This rank's vote in the current collective transition (no-op on one rank);
        returns every rank's failure. ``final``: the deciding vote."""
        section = self._section
        if section is None:
            return {} if error is None else {self.rank: f"{type(error).__name__}: {error}"}
        if final:
            section.closed = True
        try:
            failures = await section.vote(error)
        except GroupFailure as broken:
            section.closed = True
            raise GroupBroken(trigger, self.phase, broken, section.group.describe()) from error
        if failures and not final:
            section.closed = True
        return failures

    @property
    def device(self) -> torch.device:
        return self._layer.device

    @property
    def device_layer(self) -> DeviceLayer:
        return self._layer

    @property
    def transition(self) -> str | None:
        """The trigger in progress (gate closed or moving), if any."""
        return self._transition or self._admission.closed_by

    @property
    def in_flight(self) -> int:
        """Live leases: uses in progress and request-level prefetches."""
        return self._admission.in_flight

    @property
    def stale(self) -> Mapping[str, int]:
        """Stale components: their weights were discarded by a sleep and updates have not
        written all of them since (how many tensors are left). They serve nothing."""
        return MappingProxyType(stale_counts(self._uses.components.values()))

    @property
    def components(self) -> Mapping[str, nn.Module]:
        return MappingProxyType({n: c.module for n, c in self._uses.components.items()})

    def strategy(self, name: str) -> ResidencyStrategy:
        return self._component(name).strategy

    def report(self) -> PlacementReport:
        """Where every component's bytes are right now."""
        comps = {}
        for name, c in self._uses.components.items():
            r = c.strategy.store.report()
            comps[name] = ComponentPlacement(c.strategy.mode.value, r.device_bytes, r.host_bytes,
                                             r.pinned_bytes, c.strategy.store.nbytes,
                                             self._lora.nbytes(name), c.strategy.store.stale_count)
        reserved = self._layer.reserved()
        return PlacementReport(self.phase, MappingProxyType(comps), self._layer.memory_allocated(),
                               self.rank, self.world_size, self._layer.peak_bytes,
                               self._layer.allocator_peak(),
                               reserved_bytes=None if reserved is None else reserved[0],
                               reserved_peak_bytes=None if reserved is None else reserved[1],
                               weight_version=self._label)

    def reset_peak(self) -> None:
        """Start ``report().peak_device_bytes`` (and, on CUDA, the allocator's peaks of
        allocated and reserved bytes) again from the bytes held now."""
        self._layer.reset_peak()

    def _device_bytes(self) -> int:
        return sum(c.strategy.store.device_bytes for c in self._uses.components.values())

    def mark_dirty(self, components: list[str] | None = None) -> None:
        """Declare host mirrors stale after writes through ``param.data`` (which bypass
        torch's version counter): the next sleep copies those components again."""
        for name in components or list(self._uses.components):
            self._component(name).strategy.store.mark_dirty()

    def _component(self, name: str) -> Component:
        return self._uses.component(name)

    # -- the road every transition travels ---------------------------------------------
    def _refusal(self, trigger: str, called: str | None = None) -> tuple[Refusal, str] | None:
        """Noop first, then FSDP (sleep/wake), then failure/rejection: the reference's order.
        A rejection is raised (and logged as one); a noop or a failure result is returned.
        ``called``: the name the caller knows the call by (``update_from_disk`` for the
        ``begin_update`` trigger), used in the event."""
        try:
            return self._look_up_refusal(trigger)
        except TransitionRejected as exc:
            _log.info(events.TRANSITION_REJECTED, trigger=called or trigger,
                      phase=self.phase.value, outcome="refused", reason=exc.reason,
                      rank=self.rank, controller=self.id)
            raise

    def _look_up_refusal(self, trigger: str) -> tuple[Refusal, str] | None:
        found = REFUSALS.get((trigger, self.phase))
        if found and found[0] is Refusal.NOOP:
            return found[:2]
        if trigger in ("sleep", "wake") and (
                self.use_fsdp_inference or any(c.fsdp for c in self._uses.components.values())):
            raise FSDPInferenceUnsupported(trigger, self.phase)
        if found and found[2] is not None:
            raise found[2](trigger, self.phase, found[1])
        if found is None and (trigger, self.phase) not in _VALID:
            raise TransitionRejected(trigger, self.phase,
                                     f"{trigger} is not valid in phase {self.phase.value}")
        return None if found is None else found[:2]

    async def _transact(self, trigger: str,
                        prepare: Callable[[list[PreparedMove]], Awaitable[None]], *,
                        land: bool = True) -> int:
        """Run ``prepare`` (which appends prepared moves), then commit all of them, or roll
        every one back and raise :class:`TransitionFailed` (cancellation propagates as is).
        Returns the bytes copied. ``land``: first wait for the mirror refreshes weight
        updates left running (a weight update does not: its write supersedes the refresh of
        the store it writes, and the others run on)."""
        if land:
            await self._land_refreshes()
        moves: list[PreparedMove] = []
        with failures_roll_back(trigger, lambda: self.phase):
            local: BaseException | None = None
            try:
                await prepare(moves)
            except BaseException as exc:
                local = exc
            try:
                # Several ranks: all commit or none (a no-op vote on one rank).
                # (one rank: no vote, and failed_ranks stays empty)
                failures = {} if self._section is None else \
                    await self._vote(trigger, local, final=True)
            except BaseException as exc:  # the group broke: this rank rolls back alone
                local = exc
                failures = {}
            if local is not None or failures:
                with anyio.CancelScope(shield=True):
                    for move in reversed(moves):
                        await move.undo()
                error = local if local is not None else RuntimeError(
                    "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items())))
                forget_locals(error)  # the frames held the moves' buffers and backups
                _log.warning(events.TRANSITION_ROLLED_BACK, trigger=trigger,
                             phase=self.phase.value,
                             outcome="rolled_back" if isinstance(error, Exception) else "cancelled",
                             error=f"{type(error).__name__}: {error}", failed_ranks=failures,
                             rank=self.rank, controller=self.id)
                if local is None and all(w.startswith("DrainTimeout") for w in failures.values()):
                    # Other ranks could not drain: the same refusal as theirs, on every rank.
                    drained = DrainTimeout(trigger, self.phase,
                                           [f"rank {r}" for r in sorted(failures)],
                                           self._admission.drain_timeout or 0.0)
                    drained.failed_ranks = failures
                    raise drained
                if failures and isinstance(error, Exception) \
                        and not isinstance(error, TransitionFailed):
                    raise TransitionFailed(trigger, self.phase, error, failures) from error
                raise error
        for move in moves:
            move.commit()
        for move in moves:
            # After commit: work that cannot undo it (a write starts its mirror refresh,
            # which runs in the background; its errors are reported when it is landed).
            stale = await move.settle()
            if stale is not None:
                self._mirror_stale(move.store.name, stale)
        return sum(m.bytes_copied for m in moves)

    async def _land_refreshes(self, discard: frozenset[str] = frozenset()) -> None:
        """Wait for every mirror refresh still running after a weight update (only what
        is in flight: a landed one costs a look-up); report those that failed (their
        tensors stay stale, so the next sleep copies them). The refreshes of components a
        sleep discards are cancelled instead (what they copy is dropped)."""
        for c in self._uses.components.values():
            store = c.strategy.store
            if c.name in discard or store.stale_count:
                await store.cancel_refresh()
                continue
            stale = await store.land_refresh()
            if stale is not None:
                self._mirror_stale(c.name, stale)

    def _mirror_stale(self, component: str, error: BaseException) -> None:
        _log.warning(events.UPDATE_MIRROR_STALE, component=component,
                     error=f"{type(error).__name__}: {error}", rank=self.rank,
                     controller=self.id)

    def _commit_phase(self, trigger: str) -> None:
        self._fsm_model.trigger(trigger)  # type: ignore[attr-defined]

    def _check_forward(self, name: str) -> None:
        phase = self.phase
        if phase is Phase.SLEEPING:
            raise ComponentAsleep(name)
        strategy = self._uses.components[name].strategy
        if phase is not Phase.UNINITIALIZED and not strategy.ready():
            raise ComponentNotPlaced(name, strategy.mode.value)
        if strategy.store.stale_count:
            refuse_stale([self._uses.components[name]])
        # Uses are drained before either is set: a forward now runs outside use(), and a
        # streaming one would fetch from (or evict into) host stores the move or the update
        # is copying or writing.
        if strategy.streams and (phase is Phase.UPDATING_WEIGHTS or self._transition is not None):
            raise ComponentBusy(name, self._transition or "a weight update")

    # -- attach / detach ---------------------------------------------------------------
    async def attach(self, pipeline: Any) -> Phase:
        """Take the pipeline's components, build their strategies and place them for serving.

        Everything is validated before anything moves: the pipeline's shape, the residency
        configuration against the component names, every tensor (meta, sparse, foreign
        device) and every component's mode (FSDP, layerwise)."""
        async with self._lock, self._collective("attach"):
            self._refusal("attach")
            found = components_of(pipeline)
            if self._auto:
                self.last_plan = await self._plan_at_attach(found)
                self.config = self.last_plan.config
            self.config.validate_components(found)
            components, enabled = self._build(found)
            with events.bound(transition="attach", transition_id=next(_ids)):
                t0 = time.perf_counter()
                self._transition = "attach"
                try:
                    copied = await self._place(components)
                except BaseException:
                    self._abandon(components.values(), enabled)
                    raise
                finally:
                    self._transition = None
                self._uses.components, self._enabled = components, enabled
                for c in components.values():
                    check = functools.partial(self._check_forward, c.name)
                    c.strategy.forward_check = check
                    c.guard = ComputeGuard(c.module, check, c.strategy.store.note_training_forward,
                                           root_check=self._layer.check_compute)
                self._commit_phase("attach")
                self._summary("attach", Phase.UNINITIALIZED, copied, time.perf_counter() - t0)
            return self.phase

    def _build(self, found: dict[str, nn.Module]
               ) -> tuple[dict[str, Component], list[nn.Module]]:
        """Strategies for every component, enabling layerwise offload where it is configured
        and possible; on any refusal nothing is left changed. Returns the components and
        the modules layerwise offload was enabled on."""
        enabled: list[nn.Module] = []
        components: dict[str, Component] = {}
        try:
            for name, module in found.items():
                if self.config.mode_for(name) is not ResidencyMode.LAYERWISE_OFFLOAD:
                    continue
                lists = self.config.layers_for(name)
                if is_layerwise_offloaded(module):
                    if lists is not None and tuple(lists) != layerwise_blocks(module):
                        raise ComponentResidencyError(
                            f"Component {name!r} was loaded streaming block lists "
                            f"{list(layerwise_blocks(module))}, but layers names {list(lists)}")
                elif lists is not None:
                    try:
                        enable_layerwise_offload(module, lists)
                    except ValueError as exc:
                        raise ComponentResidencyError(f"Component {name!r}: {exc}") from None
                    enabled.append(module)
                else:
                    with contextlib.suppress(ValueError):  # build_strategy says why not
                        enable_layerwise_offload(module)
                        enabled.append(module)
            for name, module in found.items():
                components[name] = Component(
                    name, module, build_strategy(name, module, self.config, self._layer),
                    fsdp=is_fsdp_managed(module))
        except BaseException:
            self._abandon(components.values(), enabled)
            raise
        return components, enabled

    @staticmethod
    def _abandon(components: Iterable[Component], enabled: list[nn.Module]) -> None:
        """Undo a refused or failed attach: hooks removed, layerwise marks taken back."""
        for c in components:
            c.strategy.close()
        for module in enabled:
            disable_layerwise_offload(module)

    async def _place(self, components: dict[str, Component]) -> int:
        """Move every component to its awake placement (adopting host-loaded tensors)."""
        adopted = 0
        for c in components.values():
            adopted += await c.strategy.store.adopt()

        async def prepare(moves: list[PreparedMove]) -> None:
            for c in components.values():
                store = c.strategy.store
                wanted = c.strategy.awake_units()
                moves.append(await store.prepare_to_device(
                    [u for u in wanted if u.where == "host"]))
                moves.append(await store.prepare_to_host(
                    [u for u in store.select("device") if u not in wanted]))

        return adopted + await self._transact("attach", prepare)

    async def detach(self) -> Phase:
        """Leave every weight on the host (current), remove hooks, forget the pipeline."""
        async with self._lock, self._collective("detach"):
            if self._refusal("detach"):
                return self.phase
            source = self.phase
            t0 = time.perf_counter()

            async def prepare(moves: list[PreparedMove]) -> None:
                for c in self._uses.components.values():
                    store = c.strategy.store
                    if needs_restore(store):
                        # The module gets its own storages back (not views of our flat
                        # mirrors, not pinned memory): as it came, so another tool (or
                        # another controller) can place it per storage again.
                        moves.append(await prepare_restore(store))
                    else:
                        moves.append(await store.prepare_to_host(store.select("device")))

            with events.bound(transition="detach", transition_id=next(_ids)):
                stale = stale_counts(self._uses.components.values())
                if stale:
                    _log.warning(events.DETACH_STALE, components=stale, rank=self.rank,
                                 controller=self.id)
                async with self._gate("detach"):
                    copied = await self._transact("detach", prepare)
                for c in self._uses.components.values():
                    if c.guard:
                        c.guard.remove()
                self._abandon(self._uses.components.values(), self._enabled)
                self._uses.components, self._enabled = {}, []
                self._lora.clear()
                self._commit_phase("detach")
                await self._release_cache()
                self._summary("detach", source, copied, time.perf_counter() - t0)
            return self.phase

    # -- residency while attached ------------------------------------------------------
    async def set_residency(self, residency: ResidencyConfig | str | Mapping[str, str]
                            | list[str] | ResidencyPlan | None, *,
                            validate: Callable[[], Awaitable[object]] | bool | None = None,
                            latency_tolerance: float = 0.10) -> ResidencyChange:
        """Switch components between residency modes and tunings while attached.

        Takes anything :meth:`ResidencyConfig.parse` takes, or a :class:`ResidencyPlan`.
        Drains uses like any transition, moves only what must move (a component whose mode
        and tuning stay is not touched; a unit keeping its storages and tier keeps its
        buffers) and is all-or-nothing: a fault at any allocation or copy, or a cancellation,
        leaves the old layout exactly as it was. While sleeping it only changes what wake
        restores (host mirrors are regrouped; nothing goes to the device).

        With a plan made with a warm-up (or ``validate=`` an async request callable), one
        validation request runs after applying it; if its peak passes the plan's budget, or
        it takes more than ``latency_tolerance`` longer than predicted, the previous
        residency is restored and the result says why. ``validate=False`` skips it."""
        config = residency.config if isinstance(residency, ResidencyPlan) else \
            ResidencyConfig.parse(residency)
        previous = self.config
        async with self._lock, self._collective("set_residency"):
            change = await self._set_residency(config)
        if not isinstance(residency, ResidencyPlan) or validate is False:
            return change
        request = validate if callable(validate) else residency.warmup or self._warmup
        if request is None:
            return change
        return await self._validate(residency, change, request, previous, latency_tolerance)

    async def _validate(self, plan: ResidencyPlan, change: ResidencyChange,
                        request: Callable[[], Awaitable[object]], previous: ResidencyConfig,
                        tolerance: float) -> ResidencyChange:
        """Run one request under the applied plan; restore ``previous`` if its peak passed
        the budget or it ran more than ``tolerance`` slower than predicted."""
        self.reset_peak()
        t0 = time.perf_counter()
        await request()
        seconds = time.perf_counter() - t0
        peak = self._layer.peak_bytes
        why = []
        if peak + plan.activation_reserve > plan.budget_bytes:
            why.append(f"measured peak {peak} B (+{plan.activation_reserve} B reserve) exceeds "
                       f"the budget of {plan.budget_bytes} B")
        if seconds > plan.predicted_seconds * (1 + tolerance) + 1e-4:
            why.append(f"the request took {seconds * 1e3:.2f} ms, more than {tolerance:.0%} over "
                       f"the predicted {plan.predicted_seconds * 1e3:.2f} ms")
        result = dataclasses.replace(
            change, validated=True, measured_peak_bytes=peak, measured_seconds=seconds,
            predicted_peak_bytes=plan.predicted_peak_bytes,
            predicted_seconds=plan.predicted_seconds)
        if not why:
            return dataclasses.replace(result, message=result.message + "; validated")
        await self.set_residency(previous)
        _log.warning(events.PLAN_ROLLED_BACK, reason="; ".join(why), rank=self.rank,
                     controller=self.id)
        return dataclasses.replace(
            result, success=False, rolled_back=True,
            message="plan undone, previous residency restored: " + "; ".join(why))

    # -- planning ------------------------------------------------------------------------
    async def plan(self, device_budget: int | float | str,
                   warmup: Callable[[], Awaitable[object]] | None = None, *,
                   uses: Sequence[str | tuple[str, float] | tuple[str, float, int]] | None = None,
                   activation_reserve: int | None = None,
                   remeasure: bool = False) -> ResidencyPlan:
        """Propose the fastest residency whose predicted peak fits ``device_budget`` (bytes,
        ``"20GiB"``, or ``"90%"`` of the device's free memory; on the CPU, of the pipeline's
        size). Changes nothing: apply it with :meth:`set_residency`.

        ``warmup``: an async callable running one representative request through this
        controller (``lambda: pipe.generate(ctl=ctl)``), run once to measure which components
        a request uses, in what order, how often and for how long; or ``uses``: that order
        declared (names, or ``(name, seconds[, forwards])``); neither: every component once,
        in attach order. Measurements are taken once and reused (``remeasure=True`` takes
        them again), so plans for different budgets are comparable. Raises
        :class:`InfeasibleBudget` when nothing fits."""
        t0 = time.perf_counter()
        if self.phase is Phase.UNINITIALIZED:
            raise TransitionRejected("plan", self.phase, NOT_INITIALIZED)
        m = await self._measure(warmup, uses, remeasure)
        if activation_reserve is not None or self.activation_reserve is not None:
            reserve = activation_reserve if activation_reserve is not None else \
                self.activation_reserve
            m = dataclasses.replace(m, activation_reserve=int(reserve or 0))
        budget = parse_budget(device_budget, free_bytes=self._free_for_plan(),
                              pipeline_bytes=m.pipeline_bytes)
        # The search is pure Python (milliseconds to a fraction of a second): off the loop.
        plan = await anyio.to_thread.run_sync(
            functools.partial(make_plan, m, budget, planner_started=t0), limiter=self._threads)
        return dataclasses.replace(plan, warmup=warmup)

    def _free_for_plan(self) -> int | None:
        """Device bytes a plan may use: free now plus what the library holds (it can move)."""
        free = self._layer.free_bytes()
        return None if free is None else free + self._layer.held_bytes

    async def _measure(self, warmup: Callable[[], Awaitable[object]] | None,
                       uses: Sequence[str | tuple[str, float] | tuple[str, float, int]] | None,
                       remeasure: bool) -> Measurements:
        cached = self._measurements
        source = "warm-up" if warmup is not None else "declared" if uses is not None else None
        if cached is not None and not remeasure and (source is None or source == cached.source) \
                and uses is None:
            return cached
        components = list(self._uses.components.items())
        async with self._lock:  # no move while the inventories are taken (in a worker thread)
            sizes = await anyio.to_thread.run_sync(lambda: tuple(
                ComponentSizes.of(n, c.module, c.strategy.store, c.fsdp) for n, c in components),
                limiter=self._threads)
        bandwidth, latency = await self._measure_link(sizes)
        reserve, other = 0, 0.0
        if warmup is not None:
            trace, other, reserve = await self._record(warmup)
            self._warmup = warmup
        elif uses is not None:
            trace = declared_uses(uses, self._uses.components)
        else:
            trace = tuple(Use(n) for n in self._uses.components)
        m = Measurements(sizes, trace, bandwidth, other, reserve,
                         source or "sizes (each component once, in attach order)", latency,
                         self._layer.copies_overlap_compute)
        self._measurements = m
        return m

    async def _measure_link(self, sizes: Sequence[ComponentSizes]) -> tuple[float, float]:
        """The link's rate and per-copy seconds, measured with copies the size of the
        pipeline's typical move (its largest layer, else its largest component; 1 MiB to
        256 MiB): allocators behave differently at different sizes."""
        typical = max((max(s.layers) if s.layers else s.whole for s in sizes), default=2**20)
        nbytes = min(max(typical, 2**20), 256 * 2**20)
        return await anyio.to_thread.run_sync(self._layer.measure_link, nbytes,
                                              limiter=self._threads)

    async def _record(self, warmup: Callable[[], Awaitable[object]]
                      ) -> tuple[tuple[Use, ...], float, int]:
        """Run ``warmup`` once, recording every use; returns the uses, the seconds outside
        any use, and the activation bytes seen on the device (CUDA; 0 on the CPU)."""
        records: list[UseRecord] = []
        counts = self._uses.forwards
        handles = []
        for name, c in self._uses.components.items():
            counts[name] = 0

            def count(module: nn.Module, args: Any, name: str = name) -> None:
                counts[name] += 1
            handles.append(c.module.register_forward_pre_hook(count))
        self.reset_peak()
        self._uses.recorder = records
        t0 = time.perf_counter()
        try:
            await warmup()
        finally:
            total = time.perf_counter() - t0
            self._uses.recorder = None
            for h in handles:
                h.remove()
        allocator = self._layer.allocator_peak()
        reserve = 0 if allocator is None else max(0, allocator - self._layer.peak_bytes)
        trace: list[Use] = []
        for k, r in enumerate(records):
            prev = records[k - 1] if k else None
            prefetched = bool(
                prev is not None and self._uses.prefetch_components and r.request is not None
                and prev.request == r.request and prev.name != r.name
                and prev.name in r.order and r.name in r.order
                and r.order.index(r.name) == r.order.index(prev.name) + 1)
            trace.append(Use(r.name, max(1, r.forwards), r.seconds, prefetched,
                             prev.seconds if prev is not None else 0.0))
        other = max(0.0, total - sum(r.seconds + r.placing_seconds for r in records))
        return tuple(trace), other, reserve

    async def _plan_at_attach(self, found: Mapping[str, nn.Module]) -> ResidencyPlan:
        """residency='auto': a plan from sizes alone (each component used once per request,
        in attach order), before anything is placed."""
        t0 = time.perf_counter()
        assert self.device_budget is not None
        sizes = tuple(ComponentSizes.of(n, m, TensorStore(n, m, self._layer),
                                        is_fsdp_managed(m)) for n, m in found.items())
        bandwidth, latency = await self._measure_link(sizes)
        m = Measurements(sizes, tuple(Use(n) for n in found), bandwidth, 0.0,
                         int(self.activation_reserve or 0),
                         "sizes (each component once, in attach order)", latency,
                         self._layer.copies_overlap_compute)
        budget = parse_budget(self.device_budget, free_bytes=self._free_for_plan(),
                              pipeline_bytes=m.pipeline_bytes)
        plan = await anyio.to_thread.run_sync(
            functools.partial(make_plan, m, budget, planner_started=t0), limiter=self._threads)
        _log.info(events.PLAN_APPLIED, config=plan.config.to_string(), budget=budget,
                  predicted_peak=plan.predicted_peak_bytes, rank=self.rank, controller=self.id)
        return plan

    async def _set_residency(self, config: ResidencyConfig) -> ResidencyChange:
        if self.phase is Phase.UNINITIALIZED:
            raise TransitionRejected("set_residency", self.phase, NOT_INITIALIZED)
        components = self._uses.components
        config.validate_components(components)
        wanted: dict[str, Shape] = {}
        for name, c in components.items():
            shape = Shape.wanted(name, c.module, config)
            if shape != Shape.of(c.strategy):
                if c.fsdp:
                    raise ComponentResidencyError(
                        f"Component {name!r} is FSDP-managed: FSDP owns its placement, so its "
                        f"residency stays {c.strategy.mode.value}")
                wanted[name] = shape
        emptied = [n for n in wanted if components[n].strategy.store.discarded is not None]
        if emptied:
            raise TransitionRejected("set_residency", self.phase, f"components {emptied} were "
                                     "discarded by the sleep: wake first (their residency can "
                                     "change once they have places again)")
        t0 = time.perf_counter()
        changed = {n: (components[n].strategy.mode.value, s.mode.value) for n, s in wanted.items()}
        source = self.phase

        async def prepare(moves: list[PreparedMove]) -> None:
            for name, shape in wanted.items():
                moves.append(await self._prepare_shape(components[name], shape))

        with events.bound(transition="set_residency", transition_id=next(_ids)):
            async with self._gate("set_residency"):
                self._resync_structure("set_residency")
                self._transition = "set_residency"
                try:
                    copied = await self._transact("set_residency", prepare)
                finally:
                    self._transition = None
            self.config = config
            await self._release_cache()
            seconds = time.perf_counter() - t0
            self._summary("set_residency", source, copied, seconds)
        return ResidencyChange(True, f"residency set: {config.to_string() or 'all resident'}"
                               + (f"; changed {changed}" if changed else "; nothing changed"),
                               config.to_string(), MappingProxyType(changed), copied, seconds)

    async def _prepare_shape(self, c: Component, shape: Shape) -> PreparedMove:
        """Prepare ``c``'s move to ``shape``: a new store over the old one's storages, placed
        as the phase wants; the strategies are swapped at commit."""
        old = c.strategy.store
        new = shape.store(c.name, c.module, self._layer, layout=old)
        on_device = shape.awake_units(new) if self.phase is Phase.AWAKE else []
        move = await prepare_regroup(old, new, on_device)

        def swap() -> None:
            c.strategy.close()
            strategy = shape.strategy(c.name, new)
            strategy.forward_check = functools.partial(self._check_forward, c.name)
            c.strategy = strategy
            if shape.mode is ResidencyMode.LAYERWISE_OFFLOAD:
                if c.module not in self._enabled:
                    self._enabled.append(c.module)
            elif c.module in self._enabled:
                self._enabled.remove(c.module)

        move.on_commit = swap
        return move

    # -- sleep / wake ------------------------------------------------------------------
    async def sleep(self, discard: Discard = False) -> OccupationResult:
        """Release every device byte of every component; host mirrors keep the weights.

        Unchanged weights are not copied (their mirror is current). All-or-nothing.
        ``discard`` (``True``, ``"all"`` or component names): those components' parameters and
        persistent buffers are dropped instead, with no host copy; after the wake they hold
        undefined values and serve nothing until updates write them (see lifecycle._discard).
        A stale component's stale tensors are dropped again whatever ``discard`` says."""
        return self._stamped(await self._occupation("sleep", discard))

    async def wake(self) -> OccupationResult:
        """Restore every component's awake placement, bit-identically. All-or-nothing."""
        return self._stamped(await self._occupation("wake"))

    async def release_memory_occupation(self, discard: Discard = None) -> OccupationResult:
        """The reference system's name for :meth:`sleep`; ``discard`` defaults to the
        controller's ``discard_on_release``."""
        return await self.sleep(self.discard_on_release if discard is None else discard)

    async def resume_memory_occupation(self) -> OccupationResult:
        """The reference system's name for :meth:`wake`."""
        return await self.wake()

    async def _occupation(self, trigger: str, discard: Discard = None) -> OccupationResult:
        async with self._lock, self._collective(trigger):
            refusal = self._refusal(trigger)
            if refusal:
                how, message = refusal
                _log.info(events.TRANSITION_REJECTED, trigger=trigger, phase=self.phase.value,
                          outcome="noop" if how is Refusal.NOOP else "refused", reason=message,
                          rank=self.rank, controller=self.id)
                return OccupationResult(how is Refusal.NOOP, self.phase is Phase.SLEEPING,
                                        message, self.phase)
            dropped = resolve_discard(discard, self._uses.components)
            with events.bound(transition=trigger, transition_id=next(_ids)):
                async with self._gate(trigger):
                    return await self._move_all(trigger, dropped)

    async def _release_cache(self) -> None:
        """Give the allocator's cached blocks back to the driver, after a committed move (in a
        worker thread: it synchronizes the device; shielded: the move is done)."""
        with anyio.CancelScope(shield=True):
            await self._layer.release_cache(self._threads)

    @asynccontextmanager
    async def _gate(self, trigger: str) -> AsyncIterator[None]:
        """Close admission, drop unused prefetches, drain leases; reopen afterwards."""
        async with self._admission.closed(trigger, lambda: self.phase,
                                          self._uses.stop_prefetches,
                                          exempt=self._uses.own_leases()):
            for c in self._uses.components.values():
                c.strategy.quiesce()
            if self._layer.needs_sync:
                # Uses drained, but their kernels and copies may still run behind the host
                # (CUDA): no move may free, and no host write may touch, a buffer they read.
                await anyio.to_thread.run_sync(self._layer.synchronize, limiter=self._threads)
            yield

    async def _move_all(self, trigger: str, discard: frozenset[str] = frozenset()
                        ) -> OccupationResult:
        way = _DIRECTIONS[trigger]
        source = self.phase
        discarded: list[str] = []
        t0 = time.perf_counter()
        # A sleep right after a weight update waits for the mirror refresh still in flight
        # (then copies only what it left stale), before counting what is dirty.
        await self._land_refreshes(discard)
        before = self._device_bytes()
        if way.resync:
            self._resync_structure(trigger)
        plan = [(c, way.select(c.strategy)) for c in self._uses.components.values()]
        total = 0 if self.progress is None else sum(
            u.nbytes for _, units in plan for u in units if way.counts(u))
        done = 0

        def progress(nbytes: int) -> None:
            nonlocal done
            done += nbytes
            if self.progress is not None:
                self.progress(trigger, done, total)

        async def prepare(moves: list[PreparedMove]) -> None:
            for c, units in plan:
                m0 = time.perf_counter()
                move = await way.prepare(c, units, progress, discard)
                moves.append(move)
                if isinstance(move, DiscardMove):
                    discarded.append(c.name)
                self._move_event(c.name, move, time.perf_counter() - m0)

        self._transition = trigger
        try:
            copied = await self._transact(trigger, prepare, land=False)  # landed above
        finally:
            self._transition = None
        self._commit_phase(trigger)
        if way.empty_cache:
            await self._release_cache()
        seconds = time.perf_counter() - t0
        after = self._device_bytes()
        self._summary(trigger, source, copied, seconds, released=max(0, before - after))
        message = f"{trigger} succeeded" + (f" (discarded {discarded}: no host copy; update "
                                            "their weights after the wake)" if discarded else "")
        return OccupationResult(True, self.phase is Phase.SLEEPING, message, self.phase, copied,
                                max(0, before - after), seconds, discarded=tuple(discarded))

    def _resync_structure(self, trigger: str) -> None:
        """Re-inventory components whose tensors were replaced behind our back; where that
        cannot be done safely, refuse the transition before anything moves."""
        for c in self._uses.components.values():
            store = c.strategy.store
            if store.structure_changed() or store.drifted():
                _log.warning(events.STORE_RESCAN, component=c.name,
                             drifted=store.drifted()[:8], rank=self.rank, controller=self.id)
                try:
                    store.rescan()
                except StoreError as exc:
                    raise TransitionRejected(trigger, self.phase, str(exc)) from exc

    # -- events ------------------------------------------------------------------------
    def _move_event(self, component: str, move: Move | DiscardMove | UndiscardMove,
                    seconds: float) -> None:
        if not events.wanted(_log, logging.DEBUG):
            return
        _log.debug(events.MOVE_PREPARED, component=component, to=move.to, units=len(move.units),
                   bytes=move.bytes_copied, seconds=round(seconds, 6),
                   gbps=round(gbps(move.bytes_copied, seconds), 3),
                   rank=self.rank, controller=self.id)

    def _summary(self, trigger: str, source: Phase, copied: int, seconds: float,
                 released: int = 0) -> None:
        if not events.wanted(_log, logging.INFO):
            return
        _log.info(events.TRANSITION_COMMITTED, trigger=trigger, source=source.value,
                  dest=self.phase.value, outcome="committed", seconds=round(seconds, 6),
                  bytes=copied, released=released,
                  gbps=round(gbps(copied, seconds), 3), rank=self.rank, controller=self.id)

    # -- weight updates --------------------------------------------------------------
    @property
    def weights_version(self) -> int:
        """+1 per successful weight update since this controller was made."""
        return self._version

    @property
    def weight_version_label(self) -> str | None:
        """The ``weight_version`` of the last successful update that gave one (a failed
        update keeps it), else None: the trainer's name for the weights served."""
        return self._label

    def weights_checksum(self, components: Sequence[str] | None = None, *,
                         algorithm: ChecksumAlgorithm = "reference") -> dict[str, str]:
        """SHA-256 per component, read from wherever the bytes are: identical weights give
        identical sums whatever their placement. ``"reference"``: the reference's (its
        parameters sorted by name, each name then bytes: what trainers compare after a sync);
        ``"full"``: every tensor (buffers too) with dtype and shape (see lifecycle._checksum)."""
        names = list(self._uses.components) if components is None else list(components)
        refuse_stale(self._component(n) for n in names)
        return {n: component_checksum(self._component(n).module, self._component(n).strategy.store,
                                      algorithm) for n in names}

    async def weights_checksum_across_ranks(self, components: Sequence[str] | None = None, *,
                                            algorithm: ChecksumAlgorithm = "reference"
                                            ) -> RankChecksums:
        """Every rank's :meth:`weights_checksum` (collective: every rank calls it), to find
        the ranks whose copy of a replicated component differs (``.disagreeing()``)."""
        local = await self.weights_checksum_async(components, algorithm=algorithm)
        if self._group is None:
            return RankChecksums({n: {self.rank: s} for n, s in local.items()})
        try:
            gathered = await self._group.gather(local)
        except GroupFailure as exc:
            raise GroupBroken("checksum", self.phase, exc, self._group.describe()) from exc
        names = sorted({n for g in gathered if isinstance(g, dict) for n in g})
        return RankChecksums({n: {r: g.get(n, "not_found") if isinstance(g, dict)
                                  else "not_found" for r, g in enumerate(gathered)}
                              for n in names})

    async def weights_checksum_async(self, components: Sequence[str] | None = None, *,
                                     algorithm: ChecksumAlgorithm = "reference"
                                     ) -> dict[str, str]:
        """:meth:`weights_checksum` hashed in a worker thread (the event loop keeps serving),
        under the controller's lock so that no move or update runs meanwhile."""
        async with self._lock:
            return await anyio.to_thread.run_sync(
                functools.partial(self.weights_checksum, components, algorithm=algorithm),
                limiter=self._threads)

    async def check_tensor_hashes(self, target_module: str, expected: Mapping[str, str]
                                  ) -> TensorHashCheck:
        """Compare ``{name: sha256}`` (as the reference's clients hash a tensor: dtype, shape,
        bytes) with ``target_module``'s tensors: names every one that differs or is missing.
        Hashed in a worker thread, under the lock."""
        wanted = check_expected(expected)
        if target_module not in self._uses.components:
            raise UnknownComponent(target_module, list(self._uses.components))
        async with self._lock:
            store = self._component(target_module).strategy.store
            return await anyio.to_thread.run_sync(check_hashes, store, target_module, wanted,
                                                  limiter=self._threads)

    async def update_weights_from_disk(self, model_path: str | os.PathLike[str],
                                       target_modules: Sequence[str] | None = None, *,
                                       weight_version: str | None = None,
                                       flush_cache: bool = False) -> UpdateResult:
        """Load ``<model_path>/<component>/*.safetensors`` (or one ``.safetensors`` file with
        ``<component>.<name>`` keys) into the pipeline, all or nothing."""
        stores = self._stores()
        return self._answer(await self._update("update_from_disk", lambda: plan_from_disk(
            stores, model_path, None if target_modules is None else list(target_modules)),
            label=_label(weight_version), flush=flush_cache))

    async def update_weights_from_tensors(
            self, named_tensors: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
            target_module: str = "transformer", *, weight_update_mode: str | None = None,
            lora_alpha: float | None = None, lora_rank: int | None = None,
            weight_version: str | None = None, flush_cache: bool = False) -> UpdateResult:
        """Write ``named_tensors`` (names inside ``target_module``) into it, all or nothing.
        ``weight_update_mode="lora_merge"``: they are LoRA A/B tensors, merged into their
        linears' pristine bases (see lifecycle._lora)."""
        stores, label, mode = self._stores(), _label(weight_version), parse_mode(weight_update_mode)
        if mode == "lora_merge":
            scale, items = parse_scale(mode, lora_alpha, lora_rank), _items(named_tensors)
            return self._answer(await self._update("update_from_tensors", lambda: (
                plan_lora_from_tensors(stores, items, target_module, scale, self._lora)),
                label=label, flush=flush_cache))
        return self._answer(await self._update(
            "update_from_tensors", lambda: plan_from_tensors(stores, named_tensors, target_module),
            label=label, flush=flush_cache))

    # -- weight sync over a trainer's process group (lifecycle._weight_sync) ------------------
    @property
    def weight_update_groups(self) -> Mapping[str, WeightUpdateGroupState]:
        """This rank's weight update groups by name (``broken`` says why one broke)."""
        return MappingProxyType(self._weight_sync.states())

    async def init_weights_update_group(
            self, master_address: str, master_port: int, rank_offset: int, world_size: int,
            group_name: str = "weight_update_group", backend: str = "nccl", *,
            timeout: float = DEFAULT_TIMEOUT, bucket_bytes: int = DEFAULT_BUCKET_BYTES
            ) -> WeightUpdateGroupResult:
        """Join the trainer's group (it is rank 0 and serves the store at
        ``master_address:master_port``) as rank ``rank_offset + self.rank``; waits at most
        ``timeout`` seconds for every rank. Not a transition: nothing moves."""
        return await self._weight_sync.init(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend, rank=self.rank,
            device=self.device, timeout=timeout, bucket_bytes=bucket_bytes)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group"
                                           ) -> WeightUpdateGroupResult:
        """Leave the group (a broken one too); an absent group is a success."""
        return await self._weight_sync.destroy(group_name)

    async def update_weights_from_distributed(
            self, names: Sequence[str], dtypes: Sequence[str | torch.dtype],
            shapes: Sequence[Sequence[int]], group_name: str = "weight_update_group",
            target_modules: Sequence[str] = ("transformer",), *, flush_cache: bool = False,
            weight_version: str | None = None, weight_update_mode: str | None = None,
            lora_alpha: float | None = None, lora_rank: int | None = None,
            timeout: float = DEFAULT_TIMEOUT, bucket_bytes: int | None = None) -> UpdateResult:
        """Receive the tensors the trainer broadcasts over ``group_name`` (each in list order)
        into ``target_modules[0]``, all or nothing (see lifecycle._weight_sync): checked
        before the broadcast starts, staged in buckets of at most ``bucket_bytes``, a trainer
        that dies or stalls ``timeout`` seconds fails the update and breaks the group."""
        label = _label(weight_version)
        return self._answer(await self._weight_sync.update(
            functools.partial(self._update, "update_from_distributed", label=label,
                              flush=flush_cache),
            self._stores(), self._lora, names=names, dtypes=dtypes, shapes=shapes,
            group_name=group_name, target_modules=target_modules,
            weight_update_mode=weight_update_mode, lora_alpha=lora_alpha, lora_rank=lora_rank,
            timeout=timeout, bucket_bytes=bucket_bytes))

    def _answer(self, result: UpdateResult) -> UpdateResult:
        """An update's result, stamped with the rank, the weight version label and the
        components still stale (with how many tensors, and a few names, in the message)."""
        stale = stale_counts(self._uses.components.values())
        if stale and result.success:
            few = {n: self._component(n).strategy.store.stale_names()[:3] for n in stale}
            result = dataclasses.replace(result, message=result.message + "; still stale (not "
                                         "served until updated): " + ", ".join(
                                             f"{n} ({k} tensor(s): {', '.join(few[n])}...)"
                                             for n, k in stale.items()))
        return dataclasses.replace(self._stamped(result), weight_version=self._label,
                                   stale=MappingProxyType(stale))

    def _stamped(self, result: _R) -> _R:
        """``result`` saying which rank answered and how many ranks there are."""
        return dataclasses.replace(result, rank=self.rank, world_size=self.world_size)

    def _stores(self) -> dict[str, Any]:
        return {n: c.strategy.store for n, c in self._uses.components.items()}

    async def _update(self, kind: str, make_plan: Callable[[], UpdatePlan], *,
                      label: str | None = None, flush: bool = False) -> UpdateResult:
        async with self._lock, self._collective(kind):
            refusal = self._refusal("begin_update", kind)
            if refusal:
                _log.info(events.TRANSITION_REJECTED, trigger=kind, phase=self.phase.value,
                          outcome="refused", reason=refusal[1], rank=self.rank, controller=self.id)
                return UpdateResult(False, refusal[1], self._version)
            with events.bound(transition=kind, transition_id=next(_ids)):
                plan: UpdatePlan | None = None
                refused: UpdateRefused | TransitionRejected | None = None
                try:
                    self._resync_structure(kind)
                    plan = await anyio.to_thread.run_sync(make_plan, limiter=self._threads)
                except (UpdateRefused, TransitionRejected) as exc:
                    refused = exc
                # Several ranks: every rank's plan must be valid before any rank writes.
                failures = {} if self._section is None else \
                    await self._vote(kind, refused, final=False)
                if refused is not None or failures:
                    if plan is not None:
                        plan.close()
                    message = str(refused) if not failures else "update refused on " + \
                        "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
                    _log.info(events.TRANSITION_REJECTED, trigger=kind, phase=self.phase.value,
                              outcome="refused", reason=message, rank=self.rank,
                              controller=self.id)
                    return UpdateResult(False, message, self._version, failed_ranks=failures)
                assert plan is not None
                try:
                    async with self._gate(kind):
                        result = await self._apply(kind, plan)
                finally:
                    plan.close()
                if result.success:
                    self._label = label if label is not None else self._label
                    if flush:
                        await self._release_cache()
                return result

    async def _apply(self, kind: str, plan: UpdatePlan) -> UpdateResult:
        t0 = time.perf_counter()
        before = self._version
        stores = self._stores()

        async def prepare(moves: list[PreparedMove]) -> None:
            await plan.write(stores, moves, self._threads)
            bases = await self._lora.prepare_commit(plan, stores, self._threads)
            if bases is not None:
                moves.append(bases)

        self._commit_phase("begin_update")
        try:
            written = await self._transact(kind, prepare, land=False)
        except GroupBroken:
            raise
        except TransitionFailed as exc:
            return UpdateResult(False, f"update failed and was rolled back; weights are "
                                f"unchanged: {type(exc.cause).__name__}: {exc.cause}", before,
                                rolled_back=True, failed_ranks=exc.failed_ranks)
        finally:
            self._commit_phase("end_update")
        self._version += 1
        seconds = time.perf_counter() - t0
        if plan.casts:
            _log.info(events.UPDATE_CAST, tensors=len(plan.casts), casts=plan.casts[:16],
                      rank=self.rank, controller=self.id)
        self._summary(kind, Phase.AWAKE, written, seconds)
        return UpdateResult(True, f"updated {len(plan.writes)} tensor(s) of "
                            f"{list(plan.components)} to version {self._version}",
                            self._version, plan.components, written, seconds)

    # -- uses ------------------------------------------------------------------------
    @property
    def auto_wake(self) -> bool:
        """Whether a ``use()`` while sleeping wakes the pipeline (once for many callers)."""
        return self._uses.auto_wake

    @auto_wake.setter
    def auto_wake(self, value: bool) -> None:
        self._uses.auto_wake = value

    def use(self, name: str) -> AbstractAsyncContextManager[nn.Module]:
        """Hold a lease on component ``name`` and place it for use per its strategy.

        Waits while a transition is in progress (at most ``admission_timeout``); while the
        pipeline sleeps raises :class:`ComponentAsleep`, or wakes it first with
        ``auto_wake=True``. The lease is returned on every exit path."""
        return self._uses.use(name)

    def request(self, order: Sequence[str]) -> AbstractAsyncContextManager[None]:
        """Declare this request's use order so the next component's move-in starts while
        the current one runs (``prefetch_components``; on CUDA only when memory allows)."""
        return self._uses.request(order)


def _label(weight_version: object) -> str | None:
    """A ``weight_version`` label: a string, or None for none."""
    if weight_version is None or isinstance(weight_version, str):
        return weight_version
    raise InvalidRequest("weight_version", f"weight_version must be a string, got "
                                           f"{type(weight_version).__name__}")


def _items(named: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]]
           ) -> list[tuple[str, torch.Tensor]]:
    return list(named.items()) if isinstance(named, Mapping) else list(named)
