"""``LifecycleController``: one lock, check -> act -> commit.

Every transition travels the same road: take the lock; look the (trigger, phase) pair up in
the refusal table (no-op, failure result or typed rejection); prepare every component's move
(allocate and copy; nothing is re-pointed, so a failure or a cancellation is undone by
dropping what was prepared); commit all moves (re-pointing only, cannot fail); fire the
trigger on the ``transitions`` machine; log one summary event.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import MappingProxyType
from typing import Any, Self, TypeVar

import anyio
import torch
from torch import nn

from strategies import (
    DeviceLayer,
    ResidencyConfig,
    ResidencyMode,
    ResidencyStrategy,
    make_device_layer,
)
from strategies.protocol import (
    KeptMirrors,
    PreparedMove,
    Shape,
    forget_files,
    host_backup_bytes,
    record_files,
    regroup_device_bytes,
    to_thread,
)

from . import _events as events
from . import _results as results
from ._admission import Admission
from ._checksum import ChecksumAlgorithm, Checksums
from ._collective import Collective, describe
from ._components import (
    Components,
    abandon,
    adopt,
    attach_mirrors,
    build,
    prepare_placement,
    prepare_release,
    refuse_managed,
)
from ._discard import Discard, resolve_discard, with_stale
from ._errors import (
    ALREADY_AWAKE,
    ALREADY_SLEEPING,
    NOT_INITIALIZED,
    UPDATE_WHILE_SLEEPING,
    DrainTimeout,
    GroupBroken,
    HandOffExceedsBudget,
    InvalidRequest,
    TransitionFailed,
    TransitionRejected,
    WeightUpdateWhileSleeping,
    as_text,
    failures_roll_back,
    forget_locals,
)
from ._filebacking import after_update, verify_checkpoint
from ._handoff import Reshape, hand_off_peak
from ._hostbudget import derive_budgets
from ._hostbudget import local_world_size as local_world_size_of
from ._hosttiers import plan_mirrors, plan_reshape
from ._loaders import NameMap, disk_plan, tensors_plan
from ._lora import LoraBases, plan_tensors
from ._measure import Measurer, fixed_modes, is_auto
from ._multi import plan_from_modules
from ._owner import Owner
from ._phase import Phase, PhaseMachine, Refusal, Rule, refusal
from ._pipeline import components_of
from ._planner import ResidencyPlan
from ._results import OccupationResult, ResidencyChange, UpdateResult
from ._select import resolve_components
from ._sleep import Run
from ._updates import UpdatePlan, UpdateRefused, plan_from_disk, version_label
from ._uses import Uses
from ._weight_sync import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_TIMEOUT,
    DistributedUpdate,
    RefusedBroadcast,
    WeightSync,
    WeightSyncLimits,
)

__all__ = ["LifecycleController"]

_ids = itertools.count(1)
_controller_ids = itertools.count(1)
_R = TypeVar("_R", OccupationResult, UpdateResult)


class LifecycleController:
    """Attaches a pipeline and moves its weights between device and host, transactionally.

    ``device``: ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a ``torch.device``; ``None`` picks CUDA
    when available. ``residency``: a :class:`~strategies.ResidencyConfig` or anything
    :meth:`ResidencyConfig.parse` takes. ``device_layer`` replaces the device layer (tests
    inject faults through it).

    Host memory (see docs/limits.md): ``host_budget`` caps every host byte the library holds
    and ``pin_budget`` the page-locked part (bytes or ``"64GiB"``: this rank's own; ``"80%"``
    or ``"auto"``: derived from the cgroup limits and ``/proc/meminfo``, less
    ``host_reserve``, split between ``local_world_size`` ranks, default
    ``$LOCAL_WORLD_SIZE``). A transition that would pass the host budget is refused before
    it allocates (:class:`~strategies.HostBudgetExceeded`); mirrors past the pin budget are
    pageable. ``release_mirrors_after_wake``: drop the mirrors of what is on the device after
    each wake (the next sleep copies it again).
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
                 prefetch_headroom: int = 2**30, discard_on_release: Discard = None,
                 weight_sync_limits: WeightSyncLimits | None = None,
                 host_budget: int | float | str | None = None,
                 pin_budget: int | float | str | None = None,
                 local_world_size: int | None = None,
                 host_reserve: int | None = None,
                 release_mirrors_after_wake: bool = False) -> None:
        self._layer = device_layer if device_layer is not None else make_device_layer(device)
        # Host bytes this controller may hold, and the pinned part (lifecycle._hostbudget):
        # bytes or a size are this rank's own; "auto" or "80%" are derived from the cgroup
        # and /proc/meminfo and split between the ranks of this node.
        self.host_budgets = derive_budgets(host_budget, pin_budget,
                                           ranks=local_world_size_of(local_world_size),
                                           reserve=host_reserve)
        self._layer.host.set_budgets(self.host_budgets.host, self.host_budgets.pin)
        # After each wake, drop the host mirrors of what is on the device again (hosts short
        # of memory): the next sleep copies those bytes from the device again.
        self.release_mirrors_after_wake = release_mirrors_after_wake
        # In every event of this controller (with ``rank``): tells controllers of one process
        # apart, e.g. for lifecycle.metrics.
        self.id = next(_controller_ids)
        # What the collaborators know of this controller (id, rank, phase), and its logger.
        self._owner = Owner(self)
        # With a process group every transition is collective (see lifecycle._collective).
        self._ranks = Collective(process_group, collective_timeout, self._owner)
        self.use_fsdp_inference = use_fsdp_inference
        self.rank = rank if self._ranks.group is None else self._ranks.group.rank
        self._auto = is_auto(residency, device_budget)  # plan at attach (lifecycle._measure)
        self.device_budget = device_budget
        self.activation_reserve = activation_reserve
        # What every release_memory_occupation() discards unless told otherwise (the
        # reference's clients send an empty body): see lifecycle._discard.
        self.discard_on_release: Discard = discard_on_release
        self.config = ResidencyConfig() if self._auto else ResidencyConfig.parse(residency)
        # "auto,transformer=layerwise-offload": the modes the plan at attach keeps.
        self._fixed = fixed_modes(residency) if self._auto else ResidencyConfig()
        self.last_plan: ResidencyPlan | None = None  # the plan attach applied (auto)
        # Told (trigger, bytes copied so far, bytes to copy) during sleep and wake.
        self.progress = progress
        self._admission = Admission(drain_timeout, admission_timeout)
        self._machine = PhaseMachine()
        # fast_acquire: an uncontended acquire does not yield to the loop (a clean sleep is
        # bookkeeping only; the moves themselves checkpoint between chunks).
        self._lock = anyio.Lock(fast_acquire=True)
        self._components = Components(self._layer, self._owner)  # the attached ones
        self._components.budget_source = self.host_budgets.source
        # Worker threads for planning, reading and hashing: the library's own, so that it
        # never takes the application's share of anyio's default limiter.
        self._threads = anyio.CapacityLimiter(2)
        # A request prefetch starts only when the device has the next component's bytes plus
        # ``prefetch_headroom`` free (the running component's activations need room too).
        self._uses = Uses(self._admission, self._layer, self._components, self._owner,
                          self.wake, self._threads,
                          auto_wake=auto_wake, prefetch_components=prefetch_components,
                          prefetch_headroom=prefetch_headroom)
        self._version = 0
        self._measurer = Measurer(self._uses, self._lock)
        self._lora = LoraBases()  # the pristine bases of LoRA-merged weights (lifecycle._lora)
        # groups joined with trainers (lifecycle._weight_sync), bounded by weight_sync_limits
        self._weight_sync = WeightSync(weight_sync_limits)
        self._label: str | None = None  # the trainer's weight_version of the served weights
        self._checksums = Checksums(self._components, self._lock, self._threads, self._ranks,
                                    self._owner)

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
            await to_thread(self._layer.close, limiter=self._threads)

    # -- introspection -----------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._machine.phase

    @property
    def world_size(self) -> int:
        """Ranks this controller's transitions span (1 without a process group)."""
        return self._ranks.world_size

    def rebind(self, process_group: Any, collective_timeout: float | None = None) -> None:
        """Make the controller collective over ``process_group`` (a new group of the
        survivors after :class:`GroupBroken`, or a first group). The local state is kept
        as it is; the next collective call checks that every rank is in the same phase."""
        self.rank = self._ranks.rebind(process_group, collective_timeout)

    @property
    def device(self) -> torch.device:
        return self._layer.device

    @property
    def device_layer(self) -> DeviceLayer:
        return self._layer

    @property
    def transition(self) -> str | None:
        """The trigger in progress (gate closed or moving), if any."""
        return self._components.transition or self._admission.closed_by

    @property
    def in_flight(self) -> int:
        """Live leases: uses in progress and request-level prefetches."""
        return self._admission.in_flight

    @property
    def stale(self) -> Mapping[str, int]:
        """Stale components: their weights were discarded by a sleep and updates have not
        written all of them since (how many tensors are left). They serve nothing."""
        return MappingProxyType(self._components.stale())

    @property
    def components(self) -> Mapping[str, nn.Module]:
        return MappingProxyType({n: c.module for n, c in self._components.items()})

    def strategy(self, name: str) -> ResidencyStrategy:
        return self._components.component(name).strategy

    def report(self) -> results.PlacementReport:
        """Where every component's bytes are right now."""
        return self._components.report(self._lora.nbytes, self.world_size, self._label)

    def set_host_budget(self, host_budget: int | float | str | None,
                        pin_budget: int | float | str | None = None, *,
                        local_world_size: int | None = None,
                        host_reserve: int | None = None) -> None:
        """Hold the controller to new host and pin budgets from now on (what the constructor
        takes). Nothing moves: host bytes held already stay, and a transition that would
        add any past the new budget is refused."""
        budgets = derive_budgets(host_budget, pin_budget,
                                 ranks=local_world_size_of(local_world_size),
                                 reserve=host_reserve)
        self._layer.host.set_budgets(budgets.host, budgets.pin)
        self.host_budgets = budgets
        self._components.budget_source = budgets.source

    def forget_checkpoint(self, components: Sequence[str] | None = None) -> None:
        """Stop keeping ``components``' weights (all: None) in their checkpoint files: awake,
        the next sleep keeps host copies again; asleep, the wake gives them places with their
        weights discarded (stale until updated: the way out when a file changed)."""
        for name in list(self._components) if components is None else list(components):
            store = self._components.component(name).strategy.store
            if store.file_backing is not None and store.file_backing.asleep:
                store.file_backing = None  # the discarded sleep it is underneath remains
            else:
                forget_files(store)

    def reset_peak(self) -> None:
        """Start ``report().peak_device_bytes`` (and, on CUDA, the allocator's peaks of
        allocated and reserved bytes) again from the bytes held now."""
        self._layer.reset_peak()

    async def wait_for_mirrors(self) -> None:
        """Wait for the host-mirror refreshes that weight updates leave running (an update
        answers once its writes commit; its mirrors are refreshed from the device behind it),
        as every transition does first. After it, the next sleep copies nothing an update
        wrote. Call it in an idle moment to keep that wait off the next sleep's clock, or
        before reading host memory or the mirrors; a refresh that failed is logged
        (``update.mirror_stale``: the next sleep copies what it left)."""
        await self._components.land_refreshes()

    def mark_dirty(self, components: list[str] | None = None) -> None:
        """Declare host mirrors stale after writes through ``param.data`` (which bypass
        torch's version counter): the next sleep copies those components again."""
        for name in components or list(self._components):
            self._components.component(name).strategy.store.mark_dirty()

    # -- the road every transition travels ---------------------------------------------
    def _refusal(self, trigger: str, called: str | None = None) -> Rule | None:
        """The refusal table's answer (lifecycle._phase.refusal): a rejection is raised (and
        logged as one); a noop or a failure is returned. ``called``: the name the caller
        knows the call by (``update_from_disk`` for the ``begin_update`` trigger), in the
        event."""
        rule = refusal(trigger, self.phase, fsdp=self.use_fsdp_inference or self._components.fsdp())
        if rule is None or rule.error is None:
            return rule
        self._rejected(called or trigger, rule.message)
        raise rule.error(trigger, self.phase, rule.message)

    def _rejected(self, trigger: str, reason: str, outcome: str = "refused") -> None:
        self._owner.log.info(events.TRANSITION_REJECTED, trigger=trigger, phase=self.phase.value,
                             outcome=outcome, reason=reason)

    async def _transact(self, trigger: str,
                        prepare: Callable[[list[PreparedMove]], Awaitable[None]], *,
                        land: bool = True) -> int:
        """Run ``prepare`` (which appends prepared moves), then commit all of them, or roll
        every one back and raise :class:`TransitionFailed` (cancellation propagates as is).
        Returns the bytes copied. ``land``: first wait for the mirror refreshes weight
        updates left running (a weight update does not: its write supersedes the refresh of
        the store it writes, and the others run on)."""
        if land:
            await self._components.land_refreshes()
        moves: list[PreparedMove] = []
        with failures_roll_back(trigger, self._owner):
            local: BaseException | None = None
            try:
                await prepare(moves)
            except BaseException as exc:
                local = exc
            # Several ranks: all commit or none.
            local, failures = await self._ranks.decide(trigger, local)
            if local is not None or failures:
                await self._components.undo(moves)
                error = local if local is not None else RuntimeError(describe(failures))
                forget_locals(error)  # the frames held the moves' buffers and backups
                events.rolled_back(self._owner.log, trigger, self.phase.value, error,
                                   as_text(failures))
                raise self._ranks.failure(trigger, error, failures, own=local is not None,
                                          drain_timeout=self._admission.drain_timeout)
        for move in moves:
            move.commit()
        return await self._components.settle(moves)

    # -- attach / detach ---------------------------------------------------------------
    async def attach(self, pipeline: Any, *,
                     checkpoint: str | os.PathLike[str] | None = None) -> Phase:
        """Take the pipeline's components, build their strategies and place them for serving.

        Everything is validated before anything moves: the pipeline's shape, the residency
        configuration against the component names, every tensor (meta, sparse, foreign
        device) and every component's mode (FSDP, layerwise).

        ``checkpoint``: the safetensors files the weights were loaded from (laid out as
        :meth:`update_weights_from_disk` reads them), checked byte for byte first
        (:class:`CheckpointMismatch`): the components they cover keep no host copy while
        asleep and are read back from them at wake (the file-backed tier)."""
        async with self._lock, self._ranks.section("attach"):
            self._refusal("attach")
            found = components_of(pipeline)
            try:
                refuse_managed(found, self.id, self.phase)
            except TransitionRejected as exc:
                self._rejected("attach", exc.reason)
                raise
            if self._auto:
                assert self.device_budget is not None
                self._fixed.validate_components(found)
                self.last_plan = await self._measurer.plan_at_attach(
                    found, self.device_budget, int(self.activation_reserve or 0), self._fixed,
                    self.host_budgets.host)
                self.config = self.last_plan.config
            self.config.validate_components(found)
            resolve_discard(self.discard_on_release, found, "discard_on_release")
            components, enabled = build(found, self.config, self._layer)
            with events.bound(transition="attach", transition_id=next(_ids)):
                t0 = time.perf_counter()
                try:
                    files = {} if checkpoint is None else await to_thread(
                        verify_checkpoint, {n: c.strategy.store for n, c in components.items()},
                        checkpoint, limiter=self._threads)
                    plan_mirrors(self._layer, attach_mirrors(components.values()), "attach")
                    adopted = 0

                    async def prepare(moves: list[PreparedMove]) -> None:
                        # In the transaction: a fault copying tensors loaded on the host into
                        # their mirrors fails it, typed, on every rank.
                        nonlocal adopted
                        adopted = await adopt(components.values())
                        await prepare_placement(components.values(), moves)

                    with self._components.moving("attach"):
                        copied = await self._transact("attach", prepare)
                        copied += adopted
                except BaseException:
                    abandon(components.values(), enabled)
                    raise
                self._components.install(components, enabled)
                for name, regions in files.items():
                    record_files(components[name].strategy.store, regions)
                self._machine.fire("attach")
                self._summary("attach", Phase.UNINITIALIZED, copied, time.perf_counter() - t0)
            return self.phase

    async def detach(self) -> Phase:
        """Leave every weight on the host (current), remove hooks, forget the pipeline."""
        async with self._lock, self._ranks.section("detach"):
            if self._refusal("detach"):
                return self.phase
            source = self.phase
            t0 = time.perf_counter()
            with events.bound(transition="detach", transition_id=next(_ids)):
                self._components.warn_if_stale()
                # Never refused for the host budget: the bytes go back to the caller's modules.
                async with self._uses.drained("detach"):
                    with self._layer.host.unbudgeted():
                        copied = await self._transact("detach", functools.partial(
                            prepare_release, self._components.values()))
                self._components.release()
                self._lora.clear()
                self._machine.fire("detach")
                await self._release_cache()
                self._summary("detach", source, copied, time.perf_counter() - t0)
            return self.phase

    # -- components added or removed while attached -------------------------------------
    async def add_component(self, name: str, module: nn.Module, *,
                            residency: str | ResidencyMode | None = None) -> Phase:
        """Attach one more component (an adapter, a refiner, a second text encoder loaded
        later) and place it for serving, all or nothing: a fault at any allocation or copy,
        or a cancellation, leaves the pipeline as it was and ``module`` as it came.

        ``residency``: its mode (else the configuration's, by name, group or ``all``). Only
        while awake, and not for a name taken, a module already a component here (or part
        of one) or one another controller manages: refused with :class:`TransitionRejected`
        saying why (:class:`InvalidRequest` for a malformed name or module). The other
        components' uses go on meanwhile. With a process group, every rank calls it."""
        async with self._lock, self._ranks.section("add_component"):
            self._components.refuse_add(name, module)
            config = self.config if residency is None else dataclasses.replace(
                self.config, modes={**self.config.modes,
                                    name: ResidencyConfig.parse({name: residency}).mode_for(name)})
            config.validate_components([*self._components, name])
            others = sorted(n for n in self._components
                            if config.mode_for(n) is not self.config.mode_for(n))
            if others:
                raise TransitionRejected("add_component", self.phase,
                                         f"residency {residency!r} for {name!r} would also "
                                         f"change components {others} (a group selector): "
                                         "name it with set_residency instead")
            built, enabled = build({name: module}, config, self._layer)
            adopted = 0

            async def prepare(moves: list[PreparedMove]) -> None:
                nonlocal adopted  # in the transaction: a fault there fails it, typed
                adopted = await adopt(built.values())
                await prepare_placement(built.values(), moves)

            with events.bound(transition="add_component", transition_id=next(_ids)):
                t0 = time.perf_counter()
                try:
                    copied = adopted + await self._transact("add_component", prepare, land=False)
                except BaseException as exc:
                    abandon(built.values(), enabled)
                    # The caller may keep the error: its frames must not keep the failed
                    # placement's buffers alive (device memory no report counts).
                    built, enabled = {}, []
                    forget_locals(exc)
                    raise
                self._components.add(built[name], enabled)
                self.config = config
                self._summary("add_component", self.phase, copied, time.perf_counter() - t0)
            return self.phase

    async def remove_component(self, name: str) -> Phase:
        """Give component ``name`` back (its module holding its own weights on the host, its
        hooks removed) and forget it, all or nothing; the others stay as they are.

        Drains uses like any transition; refused with :class:`TransitionRejected` while it is
        in use, when it is the only component (detach instead) or holds discarded weights;
        :class:`UnknownComponent` for a name not attached. With a process group, every rank
        calls it."""
        async with self._lock, self._ranks.section("remove_component"):
            c = self._components.refuse_remove(name)
            with events.bound(transition="remove_component", transition_id=next(_ids)):
                t0 = time.perf_counter()
                async with self._uses.drained("remove_component"):
                    self._components.refuse_remove(name)  # a use may have started meanwhile
                    try:
                        copied = await self._transact(
                            "remove_component", functools.partial(prepare_release, [c]))
                    except BaseException as exc:
                        forget_locals(exc)  # as in add_component
                        raise
                self._components.remove(name)
                self.config = self.config.without(name)
                self._lora.forget(name)
                await self._release_cache()
                self._summary("remove_component", self.phase, copied, time.perf_counter() - t0)
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
        it takes more than ``latency_tolerance`` longer than predicted, or it raises (or is
        cancelled: restored, then the cancellation goes on), the previous residency is
        restored and the result says why. ``validate=False`` skips it. A plan whose
        hand-off, from the layout held now, would pass its budget while old and new
        placements are held together (above what is held now too) is refused before
        anything moves (:class:`HandOffExceedsBudget`); the result's
        ``transient_peak_bytes`` is that predicted peak."""
        config = residency.config if isinstance(residency, ResidencyPlan) else \
            ResidencyConfig.parse(residency)
        previous = self.config
        budget = residency.budget_bytes if isinstance(residency, ResidencyPlan) else None
        async with self._lock, self._ranks.section("set_residency"):
            change = await self._set_residency(config, budget)
        if not isinstance(residency, ResidencyPlan):
            return change
        return await self._measurer.validate(residency, change, validate, self.set_residency,
                                             previous, latency_tolerance)

    # -- planning ------------------------------------------------------------------------
    async def plan(self, device_budget: int | float | str,
                   warmup: Callable[[], Awaitable[object]] | None = None, *,
                   uses: Sequence[str | tuple[str, float] | tuple[str, float, int]] | None = None,
                   activation_reserve: int | None = None,
                   remeasure: bool = False,
                   host_budget: int | float | str | None = None) -> ResidencyPlan:
        """Propose the fastest residency whose predicted peak fits ``device_budget`` (bytes,
        ``"20GiB"``, or ``"90%"`` of the device's free memory; on the CPU, of the pipeline's
        size). Changes nothing: apply it with :meth:`set_residency`.

        ``warmup``: an async callable running one representative request through this
        controller (``lambda: pipe.generate(ctl=ctl)``), run once to measure which components
        a request uses, in what order, how often and for how long; or ``uses``: that order
        declared (names, or ``(name, seconds[, forwards])``); neither: every component once,
        in attach order. Measurements are taken once and reused (``remeasure=True`` takes
        them again), so plans for different budgets are comparable. ``host_budget``: host
        bytes the layout may hold while awake (the mirrors of what it offloads; default: the
        controller's host budget). Raises :class:`InfeasibleBudget` naming the budget that
        does not fit when nothing does."""
        if self.phase is Phase.UNINITIALIZED:
            raise TransitionRejected("plan", self.phase, NOT_INITIALIZED)
        reserve = activation_reserve if activation_reserve is not None else \
            self.activation_reserve
        host = self.host_budgets.host if host_budget is None else \
            derive_budgets(host_budget, ranks=self.host_budgets.ranks).host
        plan = await self._measurer.plan(device_budget, warmup, uses, reserve, remeasure, host)
        async with self._lock:  # the layout held now, not one a transition is changing
            if self.phase is not Phase.AWAKE or self._components.asleep:
                return plan  # asleep: applying it puts nothing on the device until a wake
            _, peak = self._transient_peak(self._components.reshapes(plan.config))
        return dataclasses.replace(plan, transient_peak_bytes=peak)

    async def _set_residency(self, config: ResidencyConfig, budget: int | None = None
                             ) -> ResidencyChange:
        if self.phase is Phase.UNINITIALIZED:
            raise TransitionRejected("set_residency", self.phase, NOT_INITIALIZED)
        if self.phase is Phase.AWAKE and self._components.asleep:
            raise TransitionRejected("set_residency", self.phase, (
                f"components {sorted(self._components.asleep)} are asleep (a partial sleep); "
                "wake them, or sleep every component, before changing the residency"))
        wanted = self._components.reshapes(config)  # refused here before anything moves
        changed = {n: (self._components[n].strategy.mode.value, s.mode.value)
                   for n, s in wanted.items()}
        t0 = time.perf_counter()
        source = self.phase
        with events.bound(transition="set_residency", transition_id=next(_ids)):
            async with self._uses.drained("set_residency"):
                self._components.rescan("set_residency")
                # Predicted once uses are drained (what they had loaded is released).
                held, peak = self._transient_peak(wanted)
                # (A plan shrinking a layout already over its budget peaks at what is held.)
                if budget is not None and peak > max(budget, held):
                    raise HandOffExceedsBudget(peak, budget, list(wanted), held)
                # Refused before the first allocation when its host buffers do not fit.
                plan_reshape(self._layer, {n: self._components[n] for n in wanted}, wanted,
                             self.phase is Phase.AWAKE)
                with self._components.moving("set_residency"):
                    copied = await self._hand_off(wanted)
            self.config = config
            await self._release_cache()
            seconds = time.perf_counter() - t0
            self._summary("set_residency", source, copied, seconds)
        return ResidencyChange(True, f"residency set: {config.to_string() or 'all resident'}"
                               + (f"; changed {changed}" if changed else "; nothing changed"),
                               config.to_string(), MappingProxyType(changed), copied, seconds,
                               transient_peak_bytes=peak)

    def _hand_off_steps(self, wanted: dict[str, Shape]) -> list[dict[str, Shape]]:
        """The transactions :meth:`_hand_off` runs for ``wanted``, in order: the components
        going to an offload mode (while awake, from the device) first when others come
        onto the device too, else all in one."""
        offload = (ResidencyMode.COMPONENT_OFFLOAD, ResidencyMode.SNAPSHOT_OFFLOAD)
        first = {n: s for n, s in wanted.items() if self.phase is Phase.AWAKE
                 and s.mode in offload and self._components[n].strategy.store.device_bytes}
        if not first or len(first) == len(wanted):
            return [wanted]
        return [first, {n: s for n, s in wanted.items() if n not in first}]

    def _transient_peak(self, wanted: dict[str, Shape]) -> tuple[int, int]:
        """The device bytes held now and the peak predicted for :meth:`_hand_off` of
        ``wanted`` from there (stores are built unplaced to count what each move allocates;
        nothing moves)."""
        awake = self.phase is Phase.AWAKE

        def reshape(name: str, shape: Shape) -> Reshape:
            c = self._components[name]
            old = c.strategy.store
            if not awake:  # (while sleeping nothing goes to the device)
                return Reshape(name, old.device_bytes, 0, 0)
            new = shape.store(name, c.module, self._layer, layout=old)
            after, fresh = regroup_device_bytes(old, new, shape.awake_units(new))
            return Reshape(name, old.device_bytes, after, fresh)

        held = self._layer.held_bytes
        return held, hand_off_peak(held, [[reshape(n, s) for n, s in step.items()]
                                          for step in self._hand_off_steps(wanted)])

    async def _hand_off(self, wanted: dict[str, Shape]) -> int:
        """Move components to their ``wanted`` shapes; returns the bytes copied.

        One transaction, unless it is a hand-off while awake: components going to an offload
        mode leave the device while others come onto it. Then, as SGLang does, the old owners
        are released first (a transaction of its own, committed) and the new ones loaded
        after (a second), so the device never holds both; a load that fails or is cancelled
        is followed by putting the released ones back as they were (shielded), and its error
        raised. (If that put-back fails too, its own TransitionFailed is raised and those
        components stay in their new, offloaded, shape.)"""
        def prepare_for(shapes: Mapping[str, Shape], kept: Mapping[str, KeptMirrors] | None = None
                        ) -> Callable[[list[PreparedMove]], Awaitable[None]]:
            async def prepare(moves: list[PreparedMove]) -> None:
                for name, shape in shapes.items():
                    moves.append(await self._components.prepare_shape(
                        self._components[name], shape, mirrors=(kept or {}).get(name)))
            return prepare

        steps = self._hand_off_steps(wanted)
        if len(steps) == 1:
            return await self._transact("set_residency", prepare_for(wanted))
        first, then = steps
        old = {n: Shape.of(self._components[n].strategy) for n in first}
        # The released ones' host mirrors, held until the load is done: a put-back gives them
        # back (their placement and host bytes as before, not only their mode).
        kept = {n: self._components[n].strategy.store.kept_mirrors() for n in first}
        copied = await self._transact("set_residency", prepare_for(first))
        try:
            return copied + await self._transact("set_residency", prepare_for(then))
        except BaseException:
            try:
                with anyio.CancelScope(shield=True):
                    await self._transact("set_residency", prepare_for(old, kept))
            finally:
                kept.clear()  # (the error raised keeps this frame: not the mirrors)
            raise

    # -- sleep / wake ------------------------------------------------------------------
    @property
    def asleep(self) -> frozenset[str]:
        """The components asleep now: every one while sleeping; some after a partial sleep
        (the phase stays awake while any component is awake)."""
        return self._components.asleep

    async def sleep(self, discard: Discard = False, *,
                    components: Sequence[str] | str | None = None) -> OccupationResult:
        """Release every device byte of every component; host mirrors keep the weights.

        Unchanged weights are not copied (their mirror is current). All-or-nothing.
        ``discard`` (``True``, ``"all"`` or component names): those components' parameters and
        persistent buffers are dropped instead, with no host copy; after the wake they hold
        undefined values and serve nothing until updates write them (see lifecycle._discard).
        A stale component's stale tensors are dropped again whatever ``discard`` says.

        ``components`` (names or groups: ``dit``, ``text_encoder``, ``image_encoder``,
        ``vae``, ``all``): only those sleep (a *partial* sleep); the phase becomes sleeping
        once every component is asleep. An asleep component refuses uses, requests naming it,
        forwards and updates writing it, while the others serve. ``discard=True`` then drops
        the weights of the components this sleep releases."""
        return self._stamped(await self._occupation("sleep", discard, components))

    async def _release(self, discard: Discard, components: Sequence[str] | str | None
                       ) -> OccupationResult:
        return self._stamped(await self._occupation("sleep", discard, components, narrow=True))

    async def wake(self, *, components: Sequence[str] | str | None = None) -> OccupationResult:
        """Restore every component's awake placement, bit-identically. All-or-nothing.
        ``components``: only those (names or groups) wake; the rest stay asleep."""
        return self._stamped(await self._occupation("wake", None, components))

    async def release_memory_occupation(self, discard: Discard = None, *,
                                        components: Sequence[str] | str | None = None
                                        ) -> OccupationResult:
        """The reference system's name for :meth:`sleep`; ``discard`` defaults to the
        controller's ``discard_on_release`` (of a partial release: the components it names
        that this release releases)."""
        if discard is None:
            return await self._release(self.discard_on_release, components)
        return await self.sleep(discard, components=components)

    async def resume_memory_occupation(self, *, components: Sequence[str] | str | None = None
                                       ) -> OccupationResult:
        """The reference system's name for :meth:`wake`."""
        return await self.wake(components=components)

    @asynccontextmanager
    async def _locked(self, trigger: str) -> AsyncIterator[None]:
        """The controller's lock for a release or resume, waited for at most the drain
        timeout (an update in progress holds it: one over a trainer's group may wait for its
        broadcast); past it :class:`DrainTimeout` (409 over HTTP), nothing changed."""
        timeout = self._admission.drain_timeout
        acquired = False
        with anyio.move_on_after(float("inf") if timeout is None else timeout):
            await self._lock.acquire()
            acquired = True
        if not acquired:
            assert timeout is not None
            raise DrainTimeout(trigger, self.phase, ["an update in progress"], timeout)
        try:
            yield
        finally:
            self._lock.release()

    def _partial(self, trigger: str, components: Sequence[str] | str | None
                 ) -> tuple[str, frozenset[str]] | None:
        """The machine's trigger for a sleep or wake of ``components`` and the components it
        moves; None when they are all already where it would put them (a noop)."""
        everyone = frozenset(self._components)
        named = resolve_components(components, everyone)
        asleep = self._components.asleep
        if trigger == "sleep":
            moving = named - asleep
            return None if not moving else (
                "sleep" if asleep | moving == everyone else "sleep_some", moving)
        moving = named & asleep
        if not moving:
            return None
        return ("wake" if self.phase is Phase.SLEEPING else "wake_some"), moving

    async def _occupation(self, trigger: str, discard: Discard = None,
                          components: Sequence[str] | str | None = None, *,
                          narrow: bool = False) -> OccupationResult:
        """A sleep or wake (of ``components``); ``narrow``: ``discard`` is a default, kept to
        the components this sleep releases (else naming others is refused)."""
        async with self._locked(trigger), self._ranks.section(trigger):
            if self.phase is not Phase.UNINITIALIZED:
                resolve_components(components, self._components)  # names checked first
            # A wake while some components are asleep (others awake) is a transition.
            some = trigger == "wake" and self.phase is Phase.AWAKE and self._components.asleep
            rule = self._refusal("wake_some" if some else trigger, trigger)
            partial = None if rule is not None else self._partial(trigger, components)
            if rule is None and partial is None:  # every named one is where this puts it
                rule = Rule(Refusal.NOOP, ALREADY_SLEEPING if trigger == "sleep" else
                            ALREADY_AWAKE)
            if rule:
                noop = rule.kind is Refusal.NOOP
                self._rejected(trigger, rule.message, "noop" if noop else "refused")
                return OccupationResult(noop, self.phase is Phase.SLEEPING, rule.message,
                                        self.phase, asleep=tuple(sorted(self.asleep)))
            assert partial is not None
            machine, moving = partial
            dropped = resolve_discard(discard, self._components)
            if narrow or discard is True or discard == "all":
                dropped &= moving
            elif dropped - moving:
                raise InvalidRequest("discard", f"discard names {sorted(dropped - moving)}, "
                                                f"which this sleep does not release (it "
                                                f"releases {sorted(moving)})")
            with events.bound(transition=trigger, transition_id=next(_ids)):
                async with self._uses.drained(trigger):
                    return await self._move_all(trigger, dropped, machine, moving)

    async def _release_cache(self) -> None:
        """Give the allocator's cached blocks back to the driver, after a committed move (in a
        worker thread: it synchronizes the device; shielded: the move is done)."""
        with anyio.CancelScope(shield=True):
            await self._layer.release_cache(self._threads)

    async def _move_all(self, trigger: str, discard: frozenset[str], machine: str,
                        moving: frozenset[str]) -> OccupationResult:
        source = self.phase
        t0 = time.perf_counter()
        run = await Run.start(trigger, self._components, discard, self.progress, self._owner,
                              only=moving)

        async def prepare(moves: list[PreparedMove]) -> None:
            # Refused before the first allocation when the new host copies do not fit.
            plan_mirrors(self._layer, run.mirrors(), trigger)
            await run.prepare(moves)

        with self._components.moving(trigger):
            copied = await self._transact(trigger, prepare, land=False)  # landed by start
        asleep = self._components.asleep
        self._components.asleep = asleep | moving if trigger == "sleep" else asleep - moving
        self._machine.fire(machine)
        if trigger == "wake" and self.release_mirrors_after_wake:
            self._components.release_mirrors()
        if run.way.empty_cache:
            await self._release_cache()
        seconds = time.perf_counter() - t0
        released = max(0, run.before - self._components.device_bytes())
        self._summary(trigger, source, copied, seconds, released=released)
        return dataclasses.replace(run.result(self.phase, copied, released, seconds),
                                   asleep=tuple(sorted(self.asleep)))

    def _summary(self, trigger: str, source: Phase, copied: int, seconds: float,
                 released: int = 0) -> None:
        events.committed(self._owner.log, trigger, source.value, self.phase.value, copied,
                         seconds, released)

    # -- weight updates --------------------------------------------------------------
    @property
    def weights_version(self) -> int:
        """+1 per successful weight update since this controller was made."""
        return self._version

    @property
    def weight_version_label(self) -> str | None:
        """The ``weight_version`` of the last successful update that gave one (a failed
        update keeps it), else None: the trainer's name for the weights served. Set it to
        rename the weights served without an update (the reference's
        ``/update_weight_version``)."""
        return self._label

    @weight_version_label.setter
    def weight_version_label(self, label: str | None) -> None:
        self._label = version_label(label)

    @property
    def admission_timeout(self) -> float | None:
        """Seconds a use waits for a transition to end (None: as long as it takes)."""
        return self._admission.admission_timeout

    @property
    def drain_timeout(self) -> float | None:
        """Seconds a transition waits for the uses in flight to end."""
        return self._admission.drain_timeout

    def weights_checksum(self, components: Sequence[str] | None = None, *,
                         algorithm: ChecksumAlgorithm = "reference") -> dict[str, str]:
        """SHA-256 per component, read from wherever the bytes are: identical weights give
        identical sums whatever their placement. ``"reference"``: the reference's (its
        parameters sorted by name, each name then bytes: what trainers compare after a sync);
        ``"full"``: every tensor (buffers too) with dtype and shape (see lifecycle._checksum)."""
        return self._checksums.now(components, algorithm)

    async def weights_checksum_across_ranks(self, components: Sequence[str] | None = None, *,
                                            algorithm: ChecksumAlgorithm = "reference"
                                            ) -> results.RankChecksums:
        """Every rank's :meth:`weights_checksum` (collective: every rank calls it), to find
        the ranks whose copy of a replicated component differs (``.disagreeing()``)."""
        return await self._checksums.across_ranks(components, algorithm)

    async def weights_checksum_async(self, components: Sequence[str] | None = None, *,
                                     algorithm: ChecksumAlgorithm = "reference"
                                     ) -> dict[str, str]:
        """:meth:`weights_checksum` hashed in a worker thread (the event loop keeps serving),
        under the controller's lock so that no move or update runs meanwhile."""
        return await self._checksums.locked(components, algorithm)

    async def check_tensor_hashes(self, target_module: str, expected: Mapping[str, str]
                                  ) -> results.TensorHashCheck:
        """Compare ``{name: sha256}`` (as the reference's clients hash a tensor: dtype, shape,
        bytes) with ``target_module``'s tensors: names every one that differs or is missing.
        Hashed in a worker thread, under the lock."""
        return await self._checksums.tensors(target_module, expected)

    async def update_weights_from_disk(self, model_path: str | os.PathLike[str],
                                       target_modules: Sequence[str] | None = None, *,
                                       weight_version: str | None = None,
                                       flush_cache: bool = False,
                                       load_weights: bool | None = None,
                                       name_map: NameMap | None = None) -> UpdateResult:
        """Load ``<model_path>/<component>/*.safetensors`` (or one ``.safetensors`` file with
        ``<component>.<name>`` keys) into the pipeline, all or nothing.

        A component whose module defines ``load_weights(weights)`` is updated through it
        (``load_weights=False``: not; ``True``: refused for one without); ``name_map``
        renames the checkpoint's names instead (see lifecycle._loaders)."""
        stores = self._components.stores()
        targets = None if target_modules is None else list(target_modules)
        make = disk_plan(stores, model_path, targets, load_weights, name_map) or \
            (lambda: plan_from_disk(stores, model_path, targets))
        return self._answer(await self._update("update_from_disk", make,
                                               label=version_label(weight_version),
                                               flush=flush_cache))

    async def update_weights_from_tensors(
            self, named_tensors: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
            target_module: str = "transformer", *, weight_update_mode: str | None = None,
            lora_alpha: float | None = None, lora_rank: int | None = None,
            weight_version: str | None = None, flush_cache: bool = False,
            load_weights: bool | None = None, name_map: NameMap | None = None) -> UpdateResult:
        """Write ``named_tensors`` (names inside ``target_module``) into it, all or nothing.
        ``weight_update_mode="lora_merge"``: they are LoRA A/B tensors, merged into their
        linears' pristine bases (see lifecycle._lora). A module defining
        ``load_weights(weights)`` is updated through it, and ``name_map`` renames the names,
        as in :meth:`update_weights_from_disk`."""
        stores, label = self._components.stores(), version_label(weight_version)
        own = None if weight_update_mode == "lora_merge" else \
            tensors_plan(stores, named_tensors, target_module, load_weights, name_map)
        if weight_update_mode == "lora_merge" and (name_map is not None or load_weights):
            raise InvalidRequest("weight_update_mode", "lora_merge merges LoRA tensors by "
                                 "their own names: it takes no name_map or load_weights")
        make = own or plan_tensors(stores, named_tensors, target_module, weight_update_mode,
                                   lora_alpha, lora_rank, self._lora)
        return self._answer(await self._update("update_from_tensors", make, label=label,
                                               flush=flush_cache))

    async def update_weights_from_modules(
            self, modules: Mapping[str, Sequence[tuple[str, torch.Tensor]]], *,
            weight_version: str | None = None, flush_cache: bool = False) -> UpdateResult:
        """Write each module's named tensors into it (``{module: [(name, tensor), ...]}``) as
        one update: every module written, or none (see lifecycle._multi)."""
        stores, label = self._components.stores(), version_label(weight_version)
        given = {m: list(named) for m, named in modules.items()}
        return self._answer(await self._update(
            "update_from_tensors", lambda: plan_from_modules(stores, given), label=label,
            flush=flush_cache))

    async def tensor_hashes(self, components: Sequence[str] | None = None
                            ) -> dict[str, dict[str, str]]:
        """``{component: {tensor name: SHA-256}}`` of every parameter and buffer (the
        reference clients' per-tensor hash, read from wherever the bytes are), hashed in a
        worker thread under the lock."""
        return await self._checksums.named(components)

    async def tensor_copies(self, component: str, names: Sequence[str]
                            ) -> list[tuple[str, torch.Tensor]]:
        """Host copies of ``component``'s tensors ``names`` (what an update can restore
        them from), read under the lock in a worker thread."""
        return await self._checksums.copies(component, names)

    # -- weight sync over a trainer's process group (lifecycle._weight_sync) ------------------
    @property
    def weight_update_groups(self) -> Mapping[str, results.WeightUpdateGroupState]:
        """This rank's weight update groups by name (``broken`` says why one broke)."""
        return MappingProxyType(self._weight_sync.states())

    async def init_weights_update_group(
            self, master_address: str, master_port: int, rank_offset: int, world_size: int,
            group_name: str = "weight_update_group", backend: str = "nccl", *,
            timeout: float = DEFAULT_TIMEOUT, bucket_bytes: int = DEFAULT_BUCKET_BYTES
            ) -> results.WeightUpdateGroupResult:
        """Join the trainer's group (it is rank 0 and serves the store at
        ``master_address:master_port``) as rank ``rank_offset + self.rank``; waits at most
        ``timeout`` seconds for every rank. Not a transition: nothing moves."""
        return await self._weight_sync.init(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend, rank=self.rank,
            device=self.device, timeout=timeout, bucket_bytes=bucket_bytes)

    def stop_weight_sync(self, after: float = 0.0) -> None:
        """The server is stopping: joins of weight update groups in progress stop now, and
        every wait on a trainer's broadcast ``after`` seconds from now (its update rolls
        back and answers); new inits and updates are refused. Safe in a signal handler."""
        self._weight_sync.shutdown(after)

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group"
                                           ) -> results.WeightUpdateGroupResult:
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
        return await self.update_from_broadcast(DistributedUpdate.parse({
            "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "target_modules": target_modules, "flush_cache": flush_cache,
            "weight_version": weight_version, "weight_update_mode": weight_update_mode,
            "lora_alpha": lora_alpha, "lora_rank": lora_rank, "timeout": timeout,
            "bucket_bytes": bucket_bytes}))

    async def update_from_broadcast(self, request: DistributedUpdate | RefusedBroadcast
                                    ) -> UpdateResult:
        """:meth:`update_weights_from_distributed` of a checked request
        (:meth:`DistributedUpdate.parse`). A :class:`RefusedBroadcast` is received over its
        group and dropped (the trainer's broadcast completes), then its error raised."""
        update = request if isinstance(request, DistributedUpdate) else None
        return self._answer(await self._weight_sync.update(
            functools.partial(self._update, "update_from_distributed",
                              label=None if update is None else update.weight_version,
                              flush=update is not None and update.flush_cache),
            self._components.stores(), self._lora, request))

    async def receive_from_distributed(
            self, names: Sequence[str], dtypes: Sequence[str | torch.dtype],
            shapes: Sequence[Sequence[int]], group_name: str = "weight_update_group", *,
            timeout: float = DEFAULT_TIMEOUT, held: int = 0) -> list[torch.Tensor]:
        """Receive the tensors the trainer broadcasts over ``group_name`` into host tensors
        (one per name, in list order), written nowhere: the caller stages them and writes
        them later as one update (``update_weights_from_modules``). ``held``: bytes already
        staged from the group, counted against its ``max_staging_bytes`` (see
        lifecycle._weight_sync). Not a transition: nothing moves, the weights are untouched."""
        return await self._weight_sync.receive_tensors(
            group_name, names, dtypes, shapes, timeout=timeout, held=held)

    def _answer(self, result: UpdateResult) -> UpdateResult:
        """An update's result, stamped with the rank, the weight version label and the
        components still stale (lifecycle._discard)."""
        return dataclasses.replace(self._stamped(with_stale(result, self._components.values())),
                                   weight_version=self._label)

    def _stamped(self, result: _R) -> _R:
        """``result`` saying which rank answered and how many ranks there are."""
        return dataclasses.replace(result, rank=self.rank, world_size=self.world_size)

    async def _update(self, kind: str, make_plan: Callable[[], UpdatePlan], *,
                      label: str | None = None, flush: bool = False) -> UpdateResult:
        async with self._lock, self._ranks.section(kind):
            rule = self._refusal("begin_update", kind)
            if rule:
                self._rejected(kind, rule.message)
                return UpdateResult(False, rule.message, self._version)
            with events.bound(transition=kind, transition_id=next(_ids)):
                plan: UpdatePlan | None = None
                refused: UpdateRefused | TransitionRejected | None = None
                try:
                    self._components.rescan(kind)
                    plan = await to_thread(make_plan, limiter=self._threads)
                    asleep = sorted(set(plan.components) & self._components.asleep)
                    if asleep:  # a partial sleep: the reference's refusal, word for word
                        self._owner.log.info(events.TRANSITION_REJECTED, trigger=kind,
                                             asleep=asleep, phase=self.phase.value,
                                             outcome="refused", reason="target asleep")
                        raise WeightUpdateWhileSleeping(kind, self.phase, UPDATE_WHILE_SLEEPING)
                except (UpdateRefused, TransitionRejected) as exc:
                    refused = exc
                # Several ranks: every rank's plan must be valid before any rank writes.
                failures = await self._ranks.vote(kind, refused, final=False)
                if refused is not None or failures:
                    if plan is not None:
                        plan.close()
                    message = str(refused) if not failures else \
                        f"update refused on {describe(failures)}"
                    self._rejected(kind, message)
                    return UpdateResult(False, message, self._version,
                                        failed_ranks=as_text(failures))
                assert plan is not None
                try:
                    async with self._uses.drained(kind):
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
        stores = self._components.stores()

        async def prepare(moves: list[PreparedMove]) -> None:
            # Refused before the first write when its backups do not fit the host budget.
            self._layer.host.check(sum(host_backup_bytes(stores[n], plan.sources(n))
                                       for n in plan.components), kind)
            await plan.write(stores, moves, self._threads)
            bases = await self._lora.prepare_commit(plan, stores, self._threads)
            if bases is not None:
                moves.append(bases)

        self._machine.fire("begin_update")
        try:
            written = await self._transact(kind, prepare, land=False)
        except GroupBroken:
            raise
        except TransitionFailed as exc:
            return plan.undone(exc, before)
        finally:
            self._machine.fire("end_update")
        self._version += 1
        after_update(kind, plan, stores)  # written tensors: their files' bytes, or anonymous
        seconds = time.perf_counter() - t0
        if plan.casts:
            self._owner.log.info(events.UPDATE_CAST, tensors=len(plan.casts),
                                 casts=plan.casts[:16])
        self._summary(kind, Phase.AWAKE, written, seconds)
        return plan.applied(self._version, written, seconds)

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
