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
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ._base import ResidencyStrategy
from ._config import LayerwiseTuning, ResidencyMode
from ._store import Fetch, Move, TensorStore, Unit

__all__ = [
    "LayerwiseOffloadStrategy",
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


def enable_layerwise_offload(module: nn.Module, layers: Sequence[str] | None = None
                             ) -> tuple[str, ...]:
    """Make ``module`` layerwise-capable: its block lists (dotted names of ``nn.ModuleList``
    or ``nn.Sequential`` children) stream layer by layer. ``None`` picks the largest
    ``nn.ModuleList`` by bytes. Returns the block-list names."""
    lists = _block_lists(module)
    if layers is None:
        candidates = {n: m for n, m in lists.items() if isinstance(m, nn.ModuleList)}
        if not candidates:
            raise ValueError(f"{type(module).__name__} has no nn.ModuleList of blocks to offload "
                             "layer by layer; pass layers=[...] naming its block lists")
        names: tuple[str, ...] = (max(candidates, key=lambda n: _nbytes(candidates[n])),)
    else:
        names = tuple(layers)
        unknown = [n for n in names if n not in lists]
        if unknown or not names:
            raise ValueError(f"layers {unknown or list(names)} are not block lists of "
                             f"{type(module).__name__}; block lists: {sorted(lists)}")
        nested = [a for a in names for b in names if a != b and a.startswith(b + ".")]
        if nested:
            raise ValueError(f"block lists {nested} are nested inside other listed block lists")
    setattr(module, _ATTR, names)
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


def layer_keys(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``("blocks.3", block)`` for every layer of every recorded block list, in order."""
    out: list[tuple[str, nn.Module]] = []
    for name in layerwise_blocks(module):
        out += [(f"{name}.{i}", block) for i, block in
                enumerate(module.get_submodule(name).children())]
    return out


class LayerwiseOffloadStrategy(ResidencyStrategy):
    """Streams layers through forward hooks; see the module docstring."""

    mode = ResidencyMode.LAYERWISE_OFFLOAD

    def __init__(self, name: str, store: TensorStore, tuning: LayerwiseTuning,
                 layers: list[tuple[str, nn.Module]]) -> None:
        super().__init__(name, store)
        self.tuning = tuning
        self.layers = layers
        n = len(layers)
        self.prefetch, resident = tuning.resolve(n)
        self.resident = frozenset(resident)
        self.units: list[Unit | None] = [store.by_key.get(key) for key, _ in layers]
        self._fetches: dict[int, Fetch] = {}
        self._running: dict[int, int] = {}
        self._next: dict[int, int] = {}
        self._first = next((i for i in range(n) if i not in self.resident), 0)
        self._last: int | None = None
        self._pinned = False  # resident layers held in for a use
        self.fetched = 0  # layer copies started (fetches and prefetches)
        self._handles: list[RemovableHandle] = []
        for i, (_, block) in enumerate(layers):
            self._handles.append(block.register_forward_pre_hook(self._make_pre(i)))
            self._handles.append(block.register_forward_hook(self._make_post(i), always_call=True))
        # A forward of the whole component outside a use(): nothing more will run, so the
        # layers prefetched for a next pass are released with it.
        self._handles.append(store.module.register_forward_hook(self._after_root,
                                                                always_call=True))

    # -- placement decisions -------------------------------------------------------
    def _layer_units(self) -> set[int]:
        return {id(u) for u in self.units if u is not None}

    def awake_units(self) -> list[Unit]:
        layer_ids = self._layer_units()
        return [u for u in self.store.units if id(u) not in layer_ids]

    def _successor(self, i: int) -> int:
        return self._next.get(i, i + 1 if i + 1 < len(self.layers) else self._first)

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
            if self._last is not None and self._last != i:
                self._next[self._last] = i
            self._last = i
            self._running[i] = self._running.get(i, 0) + 1
            with _normal_tensors():
                self._bring_in(i)
                window = self._window(i, include_start=False)
                self._evict_except(set(window) | {i})
                for j in window:
                    self._start(j)
        return pre

    def _make_post(self, i: int) -> Callable[[nn.Module, Any, Any], None]:
        def post(module: nn.Module, args: Any, output: Any) -> None:
            self._running[i] -= 1
            if not self._running[i]:
                del self._running[i]
                if not self._held(i):
                    with _normal_tensors():
                        self._evict(i)
        return post

    def _after_root(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._pinned and not self._running:
            with _normal_tensors():
                self._evict_except(set())

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
        fetch = self._fetches.pop(i, None)
        if fetch is not None:
            fetch.complete()
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
        self.quiesce()
        self._pinned = True
        wanted = sorted(self.resident | set(self._window(self._first, include_start=True)))
        units = [u for i in wanted if (u := self.units[i]) is not None and u.where == "host"]
        try:
            return await self.store.prepare_to_device(units) if units else None
        except BaseException:
            self._pinned = False
            raise

    async def finish_use(self) -> int:
        self._pinned = False
        self.quiesce()
        return sum(self.store.evict(u) for i, u in enumerate(self.units)
                   if u is not None and u.where == "device" and i not in self._running)

    def quiesce(self) -> None:
        """Land every prefetch in flight (before a transition moves the store)."""
        for i in list(self._fetches):
            self._fetches.pop(i).complete()

    def close(self) -> None:
        self.quiesce()
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def peak_bound(self) -> int:
        """Device bytes this component may hold during a use (non-layer + (resident +
        prefetch + 1) x largest layer)."""
        layer_ids = self._layer_units()
        nonlayer = sum(u.nbytes for u in self.store.units if id(u) not in layer_ids)
        largest = max((u.nbytes for u in self.units if u is not None), default=0)
        return nonlayer + (len(self.resident) + self.prefetch + 1) * largest
