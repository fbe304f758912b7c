"""``layerwise-offload``: layer weights live in host stores and stream in around each layer.

Each layer of the component's block lists is one unit: one flat host buffer (pinned on
CUDA), one device buffer while it is in, so one copy moves a whole layer. Non-layer weights
(embeddings, norms, heads) stay on the device while awake.

A forward pre-hook on every layer makes sure the layer is in (waiting on its copy if it was
prefetched, fetching it now otherwise), then starts copying the next ``prefetch`` layers in
the background (copy stream on CUDA, a copy thread on CPU). A forward post-hook releases a
streamed layer. Resident layers, chosen by the policy, stay in for the whole ``use()``.

The order layers run in is *learned* (each layer's successor in the last pass), never
assumed from the definition order: skipped or reordered blocks only cost a missed prefetch,
and every layer is checked before it runs. Layers prefetched off the predicted path are
evicted, so the device never holds more than non-layer bytes + (resident + prefetch + 1)
layers.
"""

from __future__ import annotations

import contextlib
import difflib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._base import ResidencyStrategy
from ._config import LayerwiseTuning, ResidencyMode
from ._inventory import Unit
from ._store import Fetch, Move, TensorStore

__all__ = [
    "LayerwiseOffloadStrategy",
    "detect_block_lists",
    "enable_layerwise_offload",
    "is_layerwise_offloaded",
    "layerwise_blocks",
]

_ATTR = "_residency_layerwise_blocks"


def _normal_tensors() -> contextlib.AbstractContextManager[Any]:
    """Hooks may run under ``torch.inference_mode``: the views we re-point parameters at
    must still be normal tensors (inference tensors cannot be updated in place later)."""
    if torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return contextlib.nullcontext()


def _block_lists(module: nn.Module) -> dict[str, nn.ModuleList | nn.Sequential]:
    return {name: m for name, m in module.named_modules()
            if name and isinstance(m, nn.ModuleList | nn.Sequential) and len(m) > 0}


def _nbytes(module: nn.Module) -> int:
    return sum(t.nbytes for t in list(module.parameters()) + list(module.buffers()))


# A detected block list holding less than this fraction of the bytes of the largest one is
# a head or an embedding table, not a stack of blocks: it stays with the non-layer weights.
MIN_LIST_FRACTION = 0.1


def _is_block_list(m: nn.Module) -> bool:
    """Repeated blocks: an ``nn.ModuleList`` of at least two children of one class, each
    holding weights."""
    children = list(m.children())
    return (isinstance(m, nn.ModuleList) and len(children) >= 2
            and len({type(c) for c in children}) == 1
            and all(next(c.parameters(), None) is not None for c in children))


def detect_block_lists(module: nn.Module) -> tuple[str, ...]:
    """Every list of repeated blocks in ``module``, outermost first, in definition order.

    A block list is an ``nn.ModuleList`` of two or more children of one class that hold
    weights (see :func:`_is_block_list`); lists inside a block list belong to its blocks and
    are not searched, lists of mixed blocks (a UNet's ``down_blocks``) are searched for the
    lists inside them. Lists much smaller than the largest one (heads, embedding tables:
    under :data:`MIN_LIST_FRACTION` of its bytes) are left out."""
    found: list[tuple[str, int]] = []

    def walk(prefix: str, m: nn.Module) -> None:
        for name, child in m.named_children():
            path = f"{prefix}.{name}" if prefix else name
            if _is_block_list(child):
                found.append((path, _nbytes(child)))
            else:
                walk(path, child)

    walk("", module)
    largest = max((b for _, b in found), default=0)
    return tuple(name for name, b in found if b > 0 and b >= MIN_LIST_FRACTION * largest)


def enable_layerwise_offload(module: nn.Module, layers: Sequence[str] | None = None
                             ) -> tuple[str, ...]:
    """Make ``module`` layerwise-capable: its block lists (dotted names of ``nn.ModuleList``
    or ``nn.Sequential`` children) stream layer by layer, all of them as one sequence of
    layers. ``None`` streams every list of repeated blocks :func:`detect_block_lists` finds
    (Flux and HunyuanVideo have two). Returns the block-list names."""
    names = check_block_lists(module, layers)
    setattr(module, _ATTR, names)
    return names


def check_block_lists(module: nn.Module, layers: Sequence[str] | None = None
                      ) -> tuple[str, ...]:
    """The block lists :func:`enable_layerwise_offload` would stream (ValueError when it
    would refuse), without marking the module."""
    lists = _block_lists(module)
    if layers is None:
        names = detect_block_lists(module)
        if not names:
            raise ValueError(f"{type(module).__name__} has no nn.ModuleList of repeated blocks "
                             "to offload layer by layer; pass layers=[...] naming its block "
                             f"lists (nn.ModuleList / nn.Sequential: {sorted(lists)})")
    else:
        names = tuple(layers)
        unknown = [n for n in names if n not in lists]
        if unknown or not names:
            hints = [f"{m[0]!r} for {n!r}" for n in unknown
                     if (m := difflib.get_close_matches(n, list(lists), n=1, cutoff=0.6))]
            hint = f" (did you mean {', '.join(hints)}?)" if hints else ""
            raise ValueError(f"layers {unknown or list(names)} are not block lists of "
                             f"{type(module).__name__}{hint}; block lists: {sorted(lists)}")
        nested = [a for a in names for b in names if a != b and a.startswith(b + ".")]
        if nested:
            raise ValueError(f"block lists {nested} are nested inside other listed block lists")
        if len(set(names)) != len(names):
            raise ValueError(f"block lists {list(names)} name a list twice")
    return names


def disable_layerwise_offload(module: nn.Module) -> None:
    """Undo :func:`enable_layerwise_offload` (before any strategy was built on it)."""
    if hasattr(module, _ATTR):
        delattr(module, _ATTR)


def is_layerwise_offloaded(module: nn.Module) -> bool:
    """Whether :func:`enable_layerwise_offload` was applied to ``module``."""
    return bool(getattr(module, _ATTR, ()))


def layerwise_blocks(module: nn.Module) -> tuple[str, ...]:
    """The block-list names :func:`enable_layerwise_offload` recorded (empty when none)."""
    return tuple(getattr(module, _ATTR, ()))


def layer_keys(module: nn.Module, lists: Sequence[str] | None = None
               ) -> list[tuple[str, nn.Module]]:
    """``("blocks.3", block)`` for every layer of every block list (``lists``, default the
    recorded ones), in order."""
    out: list[tuple[str, nn.Module]] = []
    for name in layerwise_blocks(module) if lists is None else lists:
        out += [(f"{name}.{i}", block) for i, block in
                enumerate(module.get_submodule(name).children())]
    return out


def _holders(module: nn.Module, keys: Sequence[str]) -> list[nn.Module]:
    """``module`` and every submodule a layer (dotted ``keys``) sits in, once each."""
    names = {""} | {".".join(key.split(".")[:n]) for key in keys
                    for n in range(1, key.count(".") + 1)}
    found = {id(m): m for m in (module.get_submodule(name) for name in sorted(names))}
    return list(found.values())


class _ThreadState(threading.local):
    """What one thread's forward has seen: the layer it ran last (to learn successors) and
    the layers of its current root pass, in order (to learn the execution order)."""

    def __init__(self) -> None:
        self.last: int | None = None
        self.trace: list[int] | None = None
        self.entered: list[int] = []  # layers whose pre-hook succeeded, innermost last
        self.depth = 0  # forwards of modules holding layers this thread is in


class LayerwiseOffloadStrategy(ResidencyStrategy):
    """Streams layers through forward hooks; see the module docstring.

    Forwards may run concurrently (several threads, each in its own forward: the diffusers
    adapter runs pipelines in worker threads). Every decision about a layer (start a fetch,
    wait for it, evict) is taken under one lock, so a layer has at most one fetch in flight
    and one device buffer, and the bytes in flight are counted exactly once."""

    mode = ResidencyMode.LAYERWISE_OFFLOAD
    streams = True

    def __init__(self, name: str, store: TensorStore, tuning: LayerwiseTuning,
                 layers: list[tuple[str, nn.Module]]) -> None:
        super().__init__(name, store)
        self.tuning = tuning
        self.layers = layers
        n = len(layers)
        self.units: list[Unit | None] = [store.by_key.get(key) for key, _ in layers]
        # A callable policy picks resident layers by definition index, once, before any
        # hook is registered (so a policy that raises leaves the module untouched).
        self._picked = tuning.pick([(key, _nbytes(block)) for key, block in layers])
        self._lock = threading.RLock()
        self._fetches: dict[int, Fetch] = {}
        self._running: dict[int, int] = {}
        self._next: dict[int, int] = {}
        self._thread = _ThreadState()
        self._pinned = False  # resident layers held in for a use
        self.fetched = 0  # layer copies started (fetches and prefetches)
        self.stalled = 0.0  # seconds forwards waited for layers to come in (the planner's)
        # Definition order until a whole root pass has been seen; then the order they ran.
        self.order: list[int] = list(range(n))
        self._learned: list[int] | None = None
        self.prefetch, self.resident, self._first = 0, frozenset[int](), 0
        self._apply_order(self.order)
        self._handles: list[RemovableHandle] = []
        for i, (_, block) in enumerate(layers):
            self._handles.append(block.register_forward_pre_hook(self._make_pre(i)))
            self._handles.append(block.register_forward_hook(self._make_post(i), always_call=True))
        self._handles.append(store.module.register_forward_pre_hook(self._before_root))
        # A forward of the whole component outside a use(): nothing more will run, so the
        # layers prefetched for a next pass are released with it.
        self._handles.append(store.module.register_forward_hook(self._after_root,
                                                                always_call=True))
        # A pass may also enter below the root (``vae.decode`` runs ``vae.decoder``, never
        # ``vae.forward``): when the outermost module holding layers returns outside a use,
        # the pass is over all the same, and its next-pass prefetches go with it (else they
        # stay in flight, holding device buffers, with nobody left to wait for them).
        for holder in _holders(store.module, [key for key, _ in layers]):
            self._handles.append(holder.register_forward_pre_hook(self._enter_holder))
            self._handles.append(holder.register_forward_hook(self._exit_holder,
                                                              always_call=True))

    def _apply_order(self, order: list[int]) -> None:
        """Resident layers and the first streamed one, counted over ``order`` (execution
        order once learned): ``resident_layers=2, policy=leading`` keeps the first two layers
        that *run*, whichever block list they are in."""
        self.order = order
        self._pos = {i: p for p, i in enumerate(order)}
        picked = None if self._picked is None else \
            [p for p, i in enumerate(order) if i in self._picked]
        self.prefetch, positions = self.tuning.resolve(len(order), picked)
        self.resident = frozenset(order[p] for p in positions)
        self._first = next((i for i in order if i not in self.resident), order[0])

    # -- placement decisions -------------------------------------------------------
    def _layer_units(self) -> set[int]:
        return {id(u) for u in self.units if u is not None}

    def awake_units(self) -> list[Unit]:
        layer_ids = self._layer_units()
        return [u for u in self.store.units if id(u) not in layer_ids]

    def _successor(self, i: int) -> int:
        if i in self._next:
            return self._next[i]
        pos = self._pos[i] + 1
        return self.order[pos] if pos < len(self.order) else self._first

    def _held(self, i: int) -> bool:
        return self._pinned and i in self.resident

    def _window(self, start: int, include_start: bool) -> list[int]:
        """The next ``prefetch`` streamed layers on the predicted path."""
        out: list[int] = []
        i = start if include_start else self._successor(start)
        for _ in range(len(self.layers)):
            if len(out) >= self.prefetch:
                break
            if not self._held(i) and i not in out and self.units[i] is not None:
                out.append(i)
            i = self._successor(i)
        return out

    # -- hooks ---------------------------------------------------------------------
    def _make_pre(self, i: int) -> Callable[[nn.Module, Any], None]:
        def pre(module: nn.Module, args: Any) -> None:
            self.forward_check()
            self.store.layer.check_compute()  # the layer moves now: only where it can
            state = self._thread
            if state.trace is not None:
                state.trace.append(i)
            with self._lock, _normal_tensors():
                if state.last is not None and state.last != i:
                    self._next[state.last] = i
                state.last = i
                self._running[i] = self._running.get(i, 0) + 1
                t0 = time.perf_counter()
                try:
                    self._bring_in(i)
                except BaseException:
                    self._leave(i)
                    raise
                finally:
                    self.stalled += time.perf_counter() - t0
                state.entered.append(i)
                window = self._window(i, include_start=False)
                self._evict_except(set(window) | {i})
                for j in window:
                    self._start(j)
        return pre

    def _make_post(self, i: int) -> Callable[[nn.Module, Any, Any], None]:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            # Called even when a pre-hook raised (always_call): leave only what was entered.
            entered = self._thread.entered
            if not entered or entered[-1] != i:
                return
            entered.pop()
            with self._lock, _normal_tensors():
                self._leave(i)
        return post

    def _leave(self, i: int) -> None:
        """Layer ``i``'s forward ended (in one thread); the last one out releases it."""
        self._running[i] -= 1
        if not self._running[i]:
            del self._running[i]
            if not self._held(i):
                self._evict(i)

    def _before_root(self, module: nn.Module, args: Any) -> None:
        self._thread.trace = []

    def _after_root(self, module: nn.Module, args: Any, output: Any) -> None:
        state = self._thread
        trace, state.trace = state.trace, None
        with self._lock, _normal_tensors():
            if trace is not None and len(trace) == len(self.layers) \
                    and len(set(trace)) == len(trace) and trace != self.order:
                self._learned = trace  # every layer once: this is the execution order
            if not self._pinned:
                self._relearn()
                if not self._running:
                    self._evict_except(set())

    def _enter_holder(self, module: nn.Module, args: Any) -> None:
        self._thread.depth += 1

    def _exit_holder(self, module: nn.Module, args: Any, output: Any) -> None:
        state = self._thread
        state.depth = max(0, state.depth - 1)  # a pre-hook before ours may have raised
        if state.depth:
            return
        with self._lock, _normal_tensors():
            if not self._pinned and not self._running:
                self._evict_except(set())

    def _relearn(self) -> None:
        """Adopt a learned execution order (only between uses: resident layers change)."""
        if self._learned is not None:
            self._apply_order(self._learned)
            self._learned = None

    def _start(self, i: int) -> None:
        unit = self.units[i]
        if unit is not None and unit.where == "host" and i not in self._fetches:
            self._fetches[i] = self.store.start_fetch(unit)
            self.fetched += 1

    def _bring_in(self, i: int) -> None:
        self._start(i)
        fetch = self._fetches.pop(i, None)
        if fetch is not None:
            fetch.complete()

    def _evict(self, i: int) -> None:
        # A prefetch nobody used is dropped, not completed: compute need not wait for a copy
        # it will never read (see Fetch.drop: on CUDA the buffer is recorded on the copy
        # stream, so its block is not reused before the copy ran; on CPU the copier thread
        # holds it until done). The unit never left the host.
        fetch = self._fetches.pop(i, None)
        if fetch is not None:
            fetch.drop()
            return
        unit = self.units[i]
        if unit is not None and unit.where == "device":
            self.store.evict(unit)

    def _evict_except(self, keep: set[int]) -> None:
        for j, unit in enumerate(self.units):
            if j in keep or self._held(j) or j in self._running or unit is None:
                continue
            if unit.where == "device" or j in self._fetches:
                self._evict(j)

    # -- the strategy protocol -----------------------------------------------------
    def ready(self) -> bool:
        return all(u.where == "device" for u in self.awake_units())

    async def prepare_use(self) -> Move | None:
        with self._lock:
            for i in list(self._fetches):  # likely the first layers: kept
                self._fetches.pop(i).complete()
            self._relearn()
            self._pinned = True
            wanted = sorted(self.resident | set(self._window(self._first, include_start=True)))
            units = [u for i in wanted if (u := self.units[i]) is not None and u.where == "host"]
        try:
            return await self.store.prepare_to_device(units) if units else None
        except BaseException:
            with self._lock:
                self._pinned = False
            raise

    async def finish_use(self) -> int:
        with self._lock:
            self._pinned = False
            self._quiesce()
            self._relearn()
            return sum(self.store.evict(u) for i, u in enumerate(self.units)
                       if u is not None and u.where == "device" and i not in self._running)

    def quiesce(self) -> None:
        """Give up every prefetch in flight (before a transition moves the store, which
        first waits for the device's queued work)."""
        with self._lock:
            self._quiesce()

    def _quiesce(self) -> None:
        for i in list(self._fetches):
            self._fetches.pop(i).drop()

    def close(self) -> None:
        self.quiesce()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def peak_bound(self) -> int:
        """Device bytes this component may hold during a use (non-layer + (resident +
        prefetch + 1) x largest layer), weights recomputed from parameters included."""
        layer_ids = self._layer_units()
        store = self.store
        nonlayer = sum(u.nbytes + store.derived_nbytes(u) for u in store.units
                       if id(u) not in layer_ids)
        largest = max((u.nbytes + store.derived_nbytes(u) for u in self.units if u is not None),
                      default=0)
        return nonlayer + (len(self.resident) + self.prefetch + 1) * largest
