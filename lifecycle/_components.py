"""The attached components: the controller's registry, and how a pipeline's modules become
components (strategies built, layerwise offload enabled where configured), change shape
(``set_residency``) and are given back (detach, a refused attach).

The controller owns one :class:`Components` and is the only one to change it: attach installs
what it built and placed, detach releases it, a residency change swaps strategies at commit.
``use()`` (``lifecycle._uses``) and the planner's measurements read it. Here too: what a
forward outside ``use()`` may do, and the bookkeeping every transition does over all
components (mirror refreshes landed, tensors replaced behind our back taken in again).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType

import anyio
from torch import nn

from strategies import (
    CheckpointChanged,
    ComponentResidencyError,
    DeviceLayer,
    ResidencyConfig,
    ResidencyMode,
    StoreError,
    disable_layerwise_offload,
    enable_layerwise_offload,
    is_fsdp_managed,
    is_layerwise_offloaded,
    layerwise_blocks,
)
from strategies.protocol import (
    ComputeGuard,
    KeptMirrors,
    PreparedMove,
    Shape,
    TensorStore,
    Unit,
    build_strategy,
    needs_restore,
    prepare_file_wake,
    prepare_regroup,
    prepare_restore,
)

from . import _events as events
from ._discard import refuse_stale, stale_counts
from ._errors import (
    NOT_INITIALIZED,
    ComponentAsleep,
    ComponentBusy,
    ComponentNotPlaced,
    InvalidRequest,
    TransitionRejected,
    UnknownComponent,
)
from ._events import get_logger
from ._owner import Owner
from ._phase import Phase
from ._results import ComponentPlacement, PlacementReport
from ._uses import AttachedComponent

__all__ = ["Components", "abandon", "adopt", "attach_mirrors", "build", "prepare_placement",
           "prepare_release", "refuse_managed"]

_log = get_logger("lifecycle")

# Every module (and submodule) an attached controller manages: its registry (weakly: a
# controller dropped without a detach manages nothing), the controller's id, the component.
# Process-wide, weak: a module garbage-collected is forgotten. One module under two
# controllers would run each one's guard and hooks over the other's placement.
_managed: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref[Components], int, str]] = \
    weakref.WeakKeyDictionary()


def refuse_managed(found: Mapping[str, nn.Module], controller_id: int, phase: Phase,
                   trigger: str = "attach") -> None:
    """Before an attach (or an add_component) moves anything: refuse modules another
    controller manages, naming it (as diffusers refuses a second offload manager on one
    module)."""
    for name, module in found.items():
        for sub in module.modules():
            owner = _managed.get(sub)
            if owner is not None and owner[1] != controller_id and owner[0]() is not None:
                what = "" if sub is module else f" (its {type(sub).__name__})"
                raise TransitionRejected(
                    trigger, phase, f"component {name!r}{what} is managed by controller "
                    f"{owner[1]} as component {owner[2]!r}: detach it there first")


class Components(Mapping[str, AttachedComponent]):
    """The attached components by name (none while detached), and the modules made
    layerwise-capable for them. ``phase``: the controller's now, and ``transition``: the move
    it is making (:meth:`moving`): what a forward may do depends on them; ``owner``: the
    controller (``phase`` read from it; its id and rank named in events)."""

    def __init__(self, layer: DeviceLayer, owner: Owner) -> None:
        self._layer = layer
        self._owner = owner
        self.transition: str | None = None
        self._by_name: dict[str, AttachedComponent] = {}
        self._enabled: list[nn.Module] = []  # modules layerwise offload was enabled on by us
        self.budget_source = "none"  # how the host budgets were found (the report says it)
        # The components asleep (a partial sleep: see lifecycle._select); every one while the
        # phase is sleeping. Changed only at a sleep's or a wake's commit.
        self.asleep: frozenset[str] = frozenset()

    def __getitem__(self, name: str) -> AttachedComponent:
        return self._by_name[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def component(self, name: str) -> AttachedComponent:
        """Component ``name``, or :class:`UnknownComponent` naming the components there are."""
        try:
            return self._by_name[name]
        except KeyError:
            raise UnknownComponent(name, list(self._by_name)) from None

    def stores(self) -> dict[str, TensorStore]:
        return {n: c.strategy.store for n, c in self._by_name.items()}

    def device_bytes(self) -> int:
        return sum(c.strategy.store.device_bytes for c in self._by_name.values())

    def stale(self) -> dict[str, int]:
        """``{name: stale tensors}`` of the stale components (see lifecycle._discard)."""
        return stale_counts(self._by_name.values())

    def warn_if_stale(self) -> None:
        """Before a detach: warn naming the stale components, if any (it leaves their
        discarded tensors with undefined values)."""
        stale = self.stale()  # (file-backed ones are read back from their files)
        if stale:
            self._owner.log.warning(events.DETACH_STALE, components=stale)

    def fsdp(self) -> bool:
        """Whether FSDP places any of them."""
        return any(c.fsdp for c in self._by_name.values())

    def placements(self, lora_bytes: Callable[[str], int]) -> dict[str, ComponentPlacement]:
        """Where every component's bytes are right now (``lora_bytes``: of its LoRA bases)."""
        out = {}
        for name, c in self._by_name.items():
            store = c.strategy.store
            r = store.report()
            out[name] = ComponentPlacement(c.strategy.mode.value, r.device_bytes, r.host_bytes,
                                           r.pinned_bytes, store.nbytes, lora_bytes(name),
                                           0 if r.file_backed_bytes else store.stale_count,
                                           r.file_backed_bytes,
                                           store.pin_reason if r.host_bytes else "")
        return out

    def report(self, lora_bytes: Callable[[str], int], world_size: int, label: str | None
               ) -> PlacementReport:
        """The controller's ``report()``: :meth:`placements`, and the device's bytes."""
        reserved = self._layer.reserved()
        ledger = self._layer.host
        held = ledger.held()
        return PlacementReport(self._owner.phase, MappingProxyType(self.placements(lora_bytes)),
                               self._layer.memory_allocated(), self._owner.rank, world_size,
                               self._layer.peak_bytes, self._layer.allocator_peak(),
                               reserved_bytes=None if reserved is None else reserved[0],
                               reserved_peak_bytes=None if reserved is None else reserved[1],
                               weight_version=label, host_budget=ledger.host_budget,
                               pin_budget=ledger.pin_budget, host_held_pinned=held.pinned,
                               host_held_pageable=held.pageable, peak_host_bytes=ledger.peak,
                               host_budget_source=self.budget_source)

    def check_forward(self, name: str) -> None:
        """Run before every forward of component ``name`` outside ``use()``: refuses one
        while sleeping, unplaced, stale, or streaming while its stores move or are written."""
        phase = self._owner.phase
        if phase is Phase.SLEEPING or name in self.asleep:
            raise ComponentAsleep(name)
        strategy = self._by_name[name].strategy
        # Stale first: discarded weights serve nothing wherever they are (inside use() too),
        # so that is the reason to give even when the component is also not placed.
        if strategy.store.stale_count:
            refuse_stale([self._by_name[name]])
        if phase is not Phase.UNINITIALIZED and not strategy.ready():
            raise ComponentNotPlaced(name, strategy.mode.value)
        # Uses are drained before either is set: a forward now runs outside use(), and a
        # streaming one would fetch from (or evict into) host stores the move or the update
        # is copying or writing.
        transition = self.transition
        if strategy.streams and (phase is Phase.UPDATING_WEIGHTS or transition is not None):
            raise ComponentBusy(name, transition or "a weight update")

    @contextlib.contextmanager
    def moving(self, trigger: str) -> Iterator[None]:
        """Name ``trigger`` as the move in progress while its moves are prepared and
        committed (a streaming component's forwards are refused meanwhile)."""
        self.transition = trigger
        try:
            yield
        finally:
            self.transition = None

    # -- what every transition does first ----------------------------------------------
    async def land_refreshes(self, discard: frozenset[str] = frozenset()) -> None:
        """Wait for every mirror refresh still running after a weight update (only what
        is in flight: a landed one costs a look-up); report those that failed (their
        tensors stay stale, so the next sleep copies them). The refreshes of components a
        sleep discards are cancelled instead (what they copy is dropped)."""
        for c in list(self._by_name.values()):  # (a component may go while this waits)
            store = c.strategy.store
            if c.name in discard or store.stale_count:
                await store.cancel_refresh()
                continue
            stale = await store.land_refresh()
            if stale is not None:
                self.mirror_stale(c.name, stale)

    def release_mirrors(self) -> int:
        """Drop the host mirror of every unit on the device (after a committed wake: the
        device bytes are the only copy until the next sleep copies them again; nothing can
        fail). Returns the host bytes released."""
        released = 0
        for c in self._by_name.values():
            store = c.strategy.store
            for unit in store.units:
                if unit.where == "device" and unit.host is not None:
                    released += unit.nbytes
                    store.drop_mirror(unit)
        return released

    def mirror_stale(self, component: str, error: BaseException) -> None:
        """Report a mirror refresh that failed (the next sleep copies what it left)."""
        self._owner.log.warning(events.UPDATE_MIRROR_STALE, component=component,
                                error=f"{type(error).__name__}: {error}")

    @staticmethod
    async def undo(moves: Sequence[PreparedMove]) -> None:
        """Undo prepared ``moves``, the last first (shielded: a rollback runs to its end)."""
        with anyio.CancelScope(shield=True):
            for move in reversed(moves):
                await move.undo()

    async def settle(self, moves: Sequence[PreparedMove]) -> int:
        """After commit, the work that cannot undo it (a write starts its mirror refresh,
        which runs in the background; its errors are reported when it is landed). Returns
        the bytes the moves copied."""
        for move in moves:
            stale = await move.settle()
            if stale is not None:
                self.mirror_stale(move.store.name, stale)
        return sum(m.bytes_copied for m in moves)

    def rescan(self, trigger: str, names: Sequence[str] | None = None) -> None:
        """Re-inventory components (``names``, default all) whose tensors were replaced
        behind our back; where that cannot be done safely, refuse ``trigger`` before
        anything moves."""
        for c in self._by_name.values() if names is None else map(self.component, names):
            store = c.strategy.store
            if store.structure_changed() or store.drifted():
                self._owner.log.warning(events.STORE_RESCAN, component=c.name,
                                        drifted=store.drifted()[:8])
                try:
                    store.rescan()
                except StoreError as exc:
                    raise TransitionRejected(trigger, self._owner.phase, str(exc)) from exc

    # -- attach / detach ---------------------------------------------------------------
    def install(self, components: dict[str, AttachedComponent], enabled: list[nn.Module]) -> None:
        """Take ``components`` (built and placed by attach) as the attached ones, their
        forwards checked."""
        self._by_name, self._enabled = components, enabled
        self.asleep = frozenset()
        for c in components.values():
            self._guard(c)

    def _guard(self, c: AttachedComponent) -> None:
        """Register ``c``'s modules as this controller's and check its forwards."""
        for sub in c.module.modules():
            _managed[sub] = (weakref.ref(self), self._owner.id, c.name)
        check = functools.partial(self.check_forward, c.name)
        c.strategy.forward_check = check
        c.guard = ComputeGuard(c.module, check, c.strategy.store.note_training_forward,
                               root_check=functools.partial(self._check_compute, c))

    def _unguard(self, c: AttachedComponent) -> None:
        """Undo :meth:`_guard` (detach, remove_component)."""
        if c.guard:
            c.guard.remove()
        for sub in c.module.modules():
            owner = _managed.get(sub)
            if owner is not None and owner[0]() is self:
                del _managed[sub]

    def _check_compute(self, c: AttachedComponent) -> None:
        """The device layer's stream and graph-capture check, for a component whose weights
        move around its forwards: a resident one's stay put while awake (a transition
        synchronizes the device before moving them), so it may run on any stream, captured."""
        if c.strategy.mode not in (ResidencyMode.RESIDENT, ResidencyMode.RESIDENT_STABLE):
            self._layer.check_compute()

    def release(self) -> None:
        """Forget every component (detach): guards and hooks removed, layerwise marks
        taken back."""
        for c in self._by_name.values():
            self._unguard(c)
        abandon(self._by_name.values(), self._enabled)
        self._by_name, self._enabled = {}, []
        self.asleep = frozenset()

    # -- residency while attached ------------------------------------------------------
    def reshapes(self, config: ResidencyConfig) -> dict[str, Shape]:
        """The components whose shape (mode and tuning) ``config`` changes, with their new
        shapes; refused before anything moves for an FSDP-placed or a discarded one."""
        config.validate_components(self._by_name)
        wanted: dict[str, Shape] = {}
        for name, c in self._by_name.items():
            shape = Shape.wanted(name, c.module, config)
            if shape != Shape.of(c.strategy):
                if ResidencyMode.RESIDENT_STABLE in (shape.mode, c.strategy.mode):
                    raise ComponentResidencyError(
                        f"Component {name!r}: a change to or from resident-stable is not made "
                        f"while attached (its arena is laid out at attach); it stays "
                        f"{c.strategy.mode.value}: detach and attach it again in the new mode")
                if c.fsdp:
                    raise ComponentResidencyError(
                        f"Component {name!r} is FSDP-managed: FSDP owns its placement, so its "
                        f"residency stays {c.strategy.mode.value}")
                wanted[name] = shape
        emptied = [n for n in wanted if self._by_name[n].strategy.store.discarded is not None]
        if emptied:
            raise TransitionRejected("set_residency", self._owner.phase,
                                     f"components {emptied} were discarded by the sleep: wake "
                                     "first (their residency can change once they have places "
                                     "again)")
        return wanted

    def reshaping(self, config: ResidencyConfig) -> tuple[
            dict[str, tuple[str, str]], Callable[[list[PreparedMove]], Awaitable[None]]]:
        """``config``'s change (see :meth:`reshapes`): ``{name: (old mode, new mode)}`` of
        every component it reshapes, and what prepares their moves."""
        wanted = self.reshapes(config)
        changed = {n: (self[n].strategy.mode.value, s.mode.value) for n, s in wanted.items()}

        async def prepare(moves: list[PreparedMove]) -> None:
            for name, shape in wanted.items():
                moves.append(await self.prepare_shape(self[name], shape))

        return changed, prepare

    async def prepare_shape(self, c: AttachedComponent, shape: Shape, *,
                            mirrors: KeptMirrors | None = None) -> PreparedMove:
        """Prepare ``c``'s move to ``shape``: a new store over the old one's storages, placed
        as the phase wants; the strategies are swapped at commit. ``mirrors``: an earlier
        store's, given back (``prepare_regroup``)."""
        old = c.strategy.store
        new = shape.store(c.name, c.module, self._layer, layout=old)
        on_device = shape.awake_units(new) if self._owner.phase is Phase.AWAKE else []
        move = await prepare_regroup(old, new, on_device, mirrors=mirrors)

        def swap() -> None:
            c.strategy.close()
            strategy = shape.strategy(c.name, new)
            strategy.forward_check = functools.partial(self.check_forward, c.name)
            c.strategy = strategy
            if c.guard is not None:  # training forwards are the new store's to note (and the
                c.guard.on_training_forward = new.note_training_forward  # old one is freed)
            if shape.mode is ResidencyMode.LAYERWISE_OFFLOAD:
                if c.module not in self._enabled:
                    self._enabled.append(c.module)
            elif c.module in self._enabled:
                self._enabled.remove(c.module)

        move.on_commit = swap
        return move

    # -- components added or removed while attached -----------------------------------
    def refuse_add(self, name: object, module: object) -> None:
        """Raise why component ``name`` (``module``) cannot be added now, if it cannot: not
        attached, sleeping, a name taken, a module (or a part of it) already a component
        here or guarded by another controller."""
        trigger, phase = "add_component", self._owner.phase
        if not isinstance(name, str) or not name.strip():
            raise InvalidRequest("name", f"a component name must be a non-empty string, "
                                 f"got {name!r}")
        if not isinstance(module, nn.Module):
            raise InvalidRequest("module", f"component {name!r} must be a torch.nn.Module, "
                                 f"got {type(module).__name__}")
        if phase is Phase.UNINITIALIZED:
            raise TransitionRejected(trigger, phase, f"{NOT_INITIALIZED}: attach() a pipeline "
                                     "first")
        if phase is not Phase.AWAKE:
            raise TransitionRejected(trigger, phase, f"cannot add component {name!r} while "
                                     f"{phase.value}: wake the pipeline first (a component is "
                                     "added placed for serving)")
        if name in self._by_name:
            raise TransitionRejected(trigger, phase, f"a component named {name!r} is attached "
                                     f"already (components: {sorted(self._by_name)}); "
                                     f"remove_component({name!r}) first")
        parts = {id(m) for m in module.modules()}
        for other in self._by_name.values():
            if parts & {id(m) for m in other.module.modules()}:
                raise TransitionRejected(trigger, phase, f"module {type(module).__name__} of "
                                         f"{name!r} is (or shares modules with) component "
                                         f"{other.name!r}: a module is managed once")
        refuse_managed({name: module}, self._owner.id, phase, trigger)

    def add(self, c: AttachedComponent, enabled: list[nn.Module]) -> None:
        """Take ``c`` (built and placed by ``add_component``) as one more attached component,
        its forwards checked. A new mapping: iterations in progress see the old one."""
        self._guard(c)
        self._by_name = {**self._by_name, c.name: c}
        self._enabled = [*self._enabled, *enabled]

    def refuse_remove(self, name: str) -> AttachedComponent:
        """Component ``name``, or why it cannot be removed now: not attached, unknown, the
        only one, in use, its weights discarded."""
        trigger, phase = "remove_component", self._owner.phase
        if phase is Phase.UNINITIALIZED:
            raise TransitionRejected(trigger, phase, NOT_INITIALIZED)
        if name not in self._by_name:
            raise UnknownComponent(name, list(self._by_name))
        c = self._by_name[name]
        if len(self._by_name) == 1:
            raise TransitionRejected(trigger, phase, f"{name!r} is the only component: "
                                     "detach() the pipeline instead")
        if c.users:
            raise TransitionRejected(trigger, phase, f"component {name!r} is in use "
                                     f"({c.users} use(s) in flight): remove it once they end")
        if c.strategy.store.stale_count or c.strategy.store.discarded is not None:
            raise TransitionRejected(trigger, phase, f"component {name!r} holds weights "
                                     "discarded by the sleep (undefined values): update or "
                                     "wake it first, or detach() the pipeline")
        return c

    def remove(self, name: str) -> None:
        """Forget component ``name`` (its move to the host committed): guard and hooks
        removed, a layerwise mark we made taken back. A new mapping, as in :meth:`add`."""
        c = self._by_name[name]
        self._unguard(c)
        abandon([c], [m for m in self._enabled if m is c.module])
        self._by_name = {n: other for n, other in self._by_name.items() if n != name}
        self._enabled = [m for m in self._enabled if m is not c.module]


def build(found: Mapping[str, nn.Module], config: ResidencyConfig, layer: DeviceLayer
          ) -> tuple[dict[str, AttachedComponent], list[nn.Module]]:
    """Strategies for every component, enabling layerwise offload where it is configured
    and possible; on any refusal nothing is left changed. Returns the components and
    the modules layerwise offload was enabled on."""
    enabled: list[nn.Module] = []
    components: dict[str, AttachedComponent] = {}
    try:
        for name, module in found.items():
            if config.mode_for(name) is not ResidencyMode.LAYERWISE_OFFLOAD:
                continue
            lists = config.layers_for(name)
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
            components[name] = AttachedComponent(name, module, build_strategy(name, module, config, layer),
                                         fsdp=is_fsdp_managed(module))
    except BaseException:
        abandon(components.values(), enabled)
        raise
    return components, enabled


def abandon(components: Iterable[AttachedComponent], enabled: list[nn.Module]) -> None:
    """Undo a refused or failed attach: hooks removed, layerwise marks taken back."""
    for c in components:
        c.strategy.close()
    for module in enabled:
        disable_layerwise_offload(module)


def attach_mirrors(components: Iterable[AttachedComponent]) -> list[tuple[AttachedComponent, list[Unit]]]:
    """The units attach gives a host mirror: those loaded on the host (adopted) and those
    its placement leaves on the host."""
    out = []
    for c in components:
        awake = {id(u) for u in c.strategy.awake_units()}
        out.append((c, [u for u in c.strategy.store.units
                        if u.where == "host" or id(u) not in awake]))
    return out


async def adopt(components: Iterable[AttachedComponent]) -> int:
    """Attach, before placing: the bytes of tensors loaded on the host copied into the
    stores' own mirrors (see ``TensorStore.adopt``)."""
    adopted = 0
    for c in components:
        adopted += await c.strategy.store.adopt()
    return adopted


async def prepare_placement(components: Iterable[AttachedComponent], moves: list[PreparedMove]) -> None:
    """Every component's move to its awake placement (attach): its awake units to the
    device, the others to the host."""
    for c in components:
        store = c.strategy.store
        wanted = c.strategy.awake_units()
        if store.arena is not None:  # resident-stable: its tensors re-homed into its arena
            moves.append(await store.prepare_rehome())
        moves.append(await store.prepare_to_device([u for u in wanted if u.where == "host"]))
        moves.append(await store.prepare_to_host(
            [u for u in store.select("device") if u not in wanted]))


async def prepare_release(components: Iterable[AttachedComponent], moves: list[PreparedMove]) -> None:
    """Every component's move to the host, its mirrors current (detach)."""
    for c in components:
        store = c.strategy.store
        if store.file_backing is not None and store.file_backing.asleep:
            # Asleep with its weights only in its files: read back into host buffers (a
            # file that changed leaves them discarded, as a discarding sleep would).
            try:
                moves.append(await prepare_file_wake(store, []))
                continue
            except CheckpointChanged as exc:
                _log.warning(events.DETACH_STALE, components={c.name: store.stale_count},
                             reason=str(exc))
                store.file_backing = None
        if needs_restore(store):
            # The module gets its own storages back (not views of our flat mirrors, not
            # pinned memory): as it came, so another tool (or another controller) can place
            # it per storage again.
            moves.append(await prepare_restore(store))
        else:
            moves.append(await store.prepare_to_host(store.select("device")))
