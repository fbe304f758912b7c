"""``LifecycleController``: one lock, check -> act -> commit.

Every transition travels the same road: take the lock; look the (trigger, phase) pair up in
the refusal table (no-op, failure result or typed rejection); prepare every component's move
(allocate and copy; nothing is re-pointed, so a failure or a cancellation is undone by
dropping what was prepared); commit all moves (re-pointing only, cannot fail); fire the
trigger on the ``transitions`` machine; log one summary event.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import anyio
import structlog
import torch
from torch import nn
from transitions import Machine

from strategies import (
    DeviceLayer,
    Move,
    ResidencyConfig,
    ResidencyStrategy,
    build_strategy,
    is_fsdp_managed,
    make_device_layer,
)
from strategies._guard import ComputeGuard

from ._errors import (
    ComponentAsleep,
    ComponentNotPlaced,
    FSDPInferenceUnsupported,
    TransitionFailed,
    TransitionRejected,
    WeightUpdateWhileSleeping,
)
from ._events import get_logger
from ._phase import REFUSALS, TRANSITIONS, Phase, Refusal
from ._pipeline import components_of
from ._results import ComponentPlacement, OccupationResult, PlacementReport

__all__ = ["LifecycleController"]

_log = get_logger("lifecycle")
_ids = itertools.count(1)
_T = TypeVar("_T")


@dataclass(eq=False)
class _Component:
    name: str
    module: nn.Module
    strategy: ResidencyStrategy
    guard: ComputeGuard | None = None


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
                 device_layer: DeviceLayer | None = None) -> None:
        self._layer = device_layer if device_layer is not None else make_device_layer(device)
        self.use_fsdp_inference = use_fsdp_inference
        self.rank = rank
        self.config = ResidencyConfig.parse(residency)
        self._fsm_model = _PhaseModel()
        self._fsm = _build_machine(self._fsm_model)
        self._lock = anyio.Lock()
        self._components: dict[str, _Component] = {}
        self._transition: str | None = None

    # -- introspection -----------------------------------------------------------------
    @property
    def phase(self) -> Phase:
        return self._fsm_model.state

    @property
    def device(self) -> torch.device:
        return self._layer.device

    @property
    def device_layer(self) -> DeviceLayer:
        return self._layer

    @property
    def transition(self) -> str | None:
        """The trigger in progress, if any."""
        return self._transition

    @property
    def components(self) -> Mapping[str, nn.Module]:
        return MappingProxyType({n: c.module for n, c in self._components.items()})

    def strategy(self, name: str) -> ResidencyStrategy:
        return self._component(name).strategy

    def report(self) -> PlacementReport:
        """Where every component's bytes are right now."""
        comps = {}
        for name, c in self._components.items():
            r = c.strategy.store.report()
            comps[name] = ComponentPlacement(c.strategy.mode.value, r.device_bytes, r.host_bytes,
                                             r.pinned_bytes, c.strategy.store.nbytes)
        return PlacementReport(self.phase, MappingProxyType(comps), self._layer.memory_allocated())

    def mark_dirty(self, components: list[str] | None = None) -> None:
        """Declare host mirrors stale after writes through ``param.data`` (which bypass
        torch's version counter): the next sleep copies those components again."""
        for name in components or list(self._components):
            self._component(name).strategy.store.mark_dirty()

    def _component(self, name: str) -> _Component:
        try:
            return self._components[name]
        except KeyError:
            raise KeyError(f"no component {name!r}; components: {sorted(self._components)}") \
                from None

    # -- the road every transition travels ---------------------------------------------
    def _refusal(self, trigger: str) -> tuple[Refusal, str] | None:
        """Noop first, then FSDP (sleep/wake), then failure/rejection: the reference's order."""
        found = REFUSALS.get((trigger, self.phase))
        if found and found[0] is Refusal.NOOP:
            return found
        if trigger in ("sleep", "wake") and (
                self.use_fsdp_inference or any(is_fsdp_managed(c.module)
                                               for c in self._components.values())):
            raise FSDPInferenceUnsupported(trigger, self.phase)
        if found and found[0] is Refusal.REJECT:
            if trigger == "begin_update":
                raise WeightUpdateWhileSleeping(trigger, self.phase)
            raise TransitionRejected(trigger, self.phase, found[1])
        if found is None and not self._fsm_model.may_trigger(trigger):  # type: ignore[attr-defined]
            raise TransitionRejected(trigger, self.phase,
                                     f"{trigger} is not valid in phase {self.phase.value}")
        return found

    async def _transact(self, trigger: str,
                        prepare: Callable[[list[Move]], Awaitable[None]]) -> int:
        """Run ``prepare`` (which appends prepared moves), then commit all of them, or roll
        every one back and raise :class:`TransitionFailed` (cancellation propagates as is).
        Returns the bytes copied."""
        moves: list[Move] = []
        try:
            await prepare(moves)
        except BaseException as exc:
            for move in reversed(moves):
                move.rollback()
            _log.warning("transition.rolled_back", trigger=trigger, phase=self.phase.value,
                         error=f"{type(exc).__name__}: {exc}", rank=self.rank)
            if isinstance(exc, Exception):
                raise TransitionFailed(trigger, self.phase, exc) from exc
            raise
        for move in moves:
            move.commit()
        return sum(m.bytes_copied for m in moves)

    def _commit_phase(self, trigger: str) -> None:
        self._fsm_model.trigger(trigger)  # type: ignore[attr-defined]

    def _check_forward(self, name: str) -> None:
        phase = self.phase
        if phase is Phase.SLEEPING:
            raise ComponentAsleep(name)
        strategy = self._components[name].strategy
        if phase is not Phase.UNINITIALIZED and not strategy.ready():
            raise ComponentNotPlaced(name, strategy.mode.value)

    # -- attach / detach ---------------------------------------------------------------
    async def attach(self, pipeline: Any) -> Phase:
        """Take the pipeline's components, build their strategies and place them for serving.

        Everything is validated before anything moves: the pipeline's shape, the residency
        configuration against the component names, every tensor (meta, sparse, foreign
        device) and every component's mode (FSDP, layerwise)."""
        async with self._lock:
            self._refusal("attach")
            found = components_of(pipeline)
            self.config.validate_components(found)
            components = {name: _Component(name, module,
                                           build_strategy(name, module, self.config, self._layer))
                          for name, module in found.items()}
            with structlog.contextvars.bound_contextvars(transition="attach",
                                                         transition_id=next(_ids)):
                t0 = time.perf_counter()
                self._transition = "attach"
                try:
                    copied = await self._place(components)
                finally:
                    self._transition = None
                self._components = components
                for c in components.values():
                    c.guard = ComputeGuard(c.module, functools.partial(self._check_forward, c.name),
                                           c.strategy.store.note_training_forward)
                self._commit_phase("attach")
                self._summary("attach", Phase.UNINITIALIZED, copied, time.perf_counter() - t0)
            return self.phase

    async def _place(self, components: dict[str, _Component]) -> int:
        """Move every component to its awake placement (adopting host-loaded tensors)."""
        adopted = 0
        for c in components.values():
            adopted += await c.strategy.store.adopt()

        async def prepare(moves: list[Move]) -> None:
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
        async with self._lock:
            if self._refusal("detach"):
                return self.phase
            source = self.phase
            t0 = time.perf_counter()

            async def prepare(moves: list[Move]) -> None:
                for c in self._components.values():
                    store = c.strategy.store
                    moves.append(await store.prepare_to_host(store.select("device")))

            copied = await self._transact("detach", prepare)
            for c in self._components.values():
                if c.guard:
                    c.guard.remove()
                c.strategy.close()
            self._components = {}
            self._commit_phase("detach")
            self._layer.empty_cache()
            self._summary("detach", source, copied, time.perf_counter() - t0)
            return self.phase

    # -- sleep / wake ------------------------------------------------------------------
    async def sleep(self) -> OccupationResult:
        """Release every device byte of every component; host mirrors keep the weights.

        Unchanged weights are not copied (their mirror is current). All-or-nothing."""
        return await self._occupation("sleep")

    async def wake(self) -> OccupationResult:
        """Restore every component's awake placement, bit-identically. All-or-nothing."""
        return await self._occupation("wake")

    async def release_memory_occupation(self) -> OccupationResult:
        """The reference system's name for :meth:`sleep`."""
        return await self.sleep()

    async def resume_memory_occupation(self) -> OccupationResult:
        """The reference system's name for :meth:`wake`."""
        return await self.wake()

    async def _occupation(self, trigger: str) -> OccupationResult:
        async with self._lock:
            refusal = self._refusal(trigger)
            if refusal:
                how, message = refusal
                _log.info("transition.rejected", trigger=trigger, phase=self.phase.value,
                          reason=message, rank=self.rank)
                return OccupationResult(how is Refusal.NOOP, self.phase is Phase.SLEEPING,
                                        message, self.phase)
            with structlog.contextvars.bound_contextvars(transition=trigger,
                                                         transition_id=next(_ids)):
                return await self._move_all(trigger)

    async def _move_all(self, trigger: str) -> OccupationResult:
        source = self.phase
        before = self.report().device_bytes
        t0 = time.perf_counter()
        if trigger == "sleep":
            self._resync_structure()

        async def prepare(moves: list[Move]) -> None:
            for c in self._components.values():
                store = c.strategy.store
                m0 = time.perf_counter()
                if trigger == "sleep":
                    move = await store.prepare_to_host(store.select("device"))
                else:
                    move = await store.prepare_to_device(
                        [u for u in c.strategy.awake_units() if u.where == "host"])
                moves.append(move)
                self._move_event(c.name, move, time.perf_counter() - m0)

        self._transition = trigger
        try:
            copied = await self._transact(trigger, prepare)
        finally:
            self._transition = None
        self._commit_phase(trigger)
        if trigger == "sleep":
            self._layer.empty_cache()
        seconds = time.perf_counter() - t0
        after = self.report().device_bytes
        self._summary(trigger, source, copied, seconds, released=max(0, before - after))
        return OccupationResult(True, self.phase is Phase.SLEEPING, f"{trigger} succeeded",
                                self.phase, copied, max(0, before - after), seconds)

    def _resync_structure(self) -> None:
        """Re-inventory components whose tensors were replaced behind our back."""
        for c in self._components.values():
            store = c.strategy.store
            if store.structure_changed() or store.drifted():
                _log.warning("store.rescan", component=c.name,
                             drifted=store.drifted()[:8], rank=self.rank)
                store.rescan()

    # -- events ------------------------------------------------------------------------
    def _move_event(self, component: str, move: Move, seconds: float) -> None:
        _log.debug("move.prepared", component=component, to=move.to, units=len(move.units),
                   bytes=move.bytes_copied, seconds=round(seconds, 6),
                   gbps=round(move.bytes_copied / seconds / 1e9, 3) if seconds > 0 else 0.0,
                   rank=self.rank)

    def _summary(self, trigger: str, source: Phase, copied: int, seconds: float,
                 released: int = 0) -> None:
        _log.info("transition.committed", trigger=trigger, source=source.value,
                  dest=self.phase.value, outcome="committed", seconds=round(seconds, 6),
                  bytes=copied, released=released,
                  gbps=round(copied / seconds / 1e9, 3) if seconds > 0 else 0.0, rank=self.rank)

    # -- uses --------------------------------------------------------------------------
    @asynccontextmanager
    async def use(self, name: str) -> Any:
        """Place component ``name`` for use per its strategy for the body of the block."""
        c = self._component(name)
        if self.phase is Phase.SLEEPING:
            raise ComponentAsleep(name)
        yield c.module
