"""Updates through a component's own weight loader, or through a name mapping.

SGLang's and vLLM's models define ``load_weights(weights)``, ``weights`` an iterable of
``(checkpoint name, tensor)``: the model knows its fused or renamed parameters (a fused
``qkv_proj`` filled from ``q_proj``, ``k_proj`` and ``v_proj``, each shard by its
``weight_loader``). An update of such a component runs its ``load_weights`` on a *shadow*:
a copy of the module whose parameters and buffers are host copies of the served values (its
hooks left out, each parameter's own attributes such as ``weight_loader`` kept). What the
loader changed there becomes the update's plan, validated like any other (shapes, dtypes
cast and reported) and written by the same two-phase writes, so it is all or nothing and
rolls back the same way; the served module is never touched by the loader. The shadow costs
one host copy of the component's tensors while the plan is made.

A name mapping (``{"checkpoint name": "parameter name"}`` or a callable) renames the
tensors instead, then plans them directly.
"""

from __future__ import annotations

import copy
import functools
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from strategies.protocol import TensorStore

from ._updates import UpdatePlan, UpdateRefused, _Planner

__all__ = ["NameMap", "disk_plan", "loader_of", "plan_named", "renamed", "tensors_plan"]

NameMap = Mapping[str, str] | Callable[[str], str]
Items = Sequence[tuple[str, torch.Tensor]]


def loader_of(module: nn.Module, component: str, load_weights: bool | None
              ) -> Callable[[Iterable[tuple[str, torch.Tensor]]], object] | None:
    """The component's own loader to update it through: its ``load_weights`` when it has
    one and ``load_weights`` is None (auto) or True; None when it is False or there is none
    (True without one is refused)."""
    fn = getattr(module, "load_weights", None)
    if load_weights is False:
        return None
    if not callable(fn):
        if load_weights:
            raise UpdateRefused(f"component {component!r} ({type(module).__name__}) defines no "
                                "load_weights(weights) to update it through")
        return None
    return fn  # type: ignore[no-any-return]


def _routed(module: nn.Module, load_weights: bool | None, name_map: NameMap | None) -> bool:
    """Whether an update of ``module`` goes through here (a refusal is the plan's to say)."""
    return name_map is not None or bool(load_weights) or \
        (load_weights is None and callable(getattr(module, "load_weights", None)))


def renamed(items: Items, name_map: NameMap, component: str) -> list[tuple[str, torch.Tensor]]:
    """``items`` with each name mapped (a name the mapping lacks keeps its name); two names
    mapped onto one are refused."""
    out: list[tuple[str, torch.Tensor]] = []
    origin: dict[str, str] = {}
    for name, tensor in items:
        new = name_map(name) if callable(name_map) else name_map.get(name, name)
        if not isinstance(new, str) or not new:
            raise UpdateRefused(f"name_map maps {name!r} to {new!r}, not a tensor name of "
                                f"{component!r}")
        if new in origin:
            raise UpdateRefused(f"name_map maps both {origin[new]!r} and {name!r} onto "
                                f"{component}.{new}; nothing was updated")
        origin[new] = name
        out.append((new, tensor))
    return out


def checked(named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
            ) -> list[tuple[str, torch.Tensor]]:
    """``named`` as a list of ``(str, dense tensor)`` pairs, or the entry that is not."""
    items = list(named.items()) if isinstance(named, Mapping) else list(named)
    for i, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise UpdateRefused(f"entry {i} must be a (str, torch.Tensor) pair")
        if item[1].is_meta or item[1].layout != torch.strided:
            raise UpdateRefused(f"tensor {item[0]!r} has no dense data ({item[1].device}, "
                                f"{item[1].layout})")
    return items


def disk_items(root: Path, component: str) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of ``<root>/<component>/*.safetensors`` (or, ``root`` one file, its
    ``<component>.``-prefixed keys, the prefix taken off), read into memory."""
    if root.is_file():
        files, prefix = [root], component + "."
    else:
        files, prefix = sorted((root / component).glob("*.safetensors")), ""
    if not files:
        raise UpdateRefused(f"Cannot update weights: missing weight files for modules: "
                            f"{[component]}. No partial updates allowed.")
    items: list[tuple[str, torch.Tensor]] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                items += [(key[len(prefix):], f.get_tensor(key)) for key in sorted(f.keys())
                          if key.startswith(prefix)]
        except (SafetensorError, OSError) as exc:
            raise UpdateRefused(f"cannot read weight file {path}: not a valid safetensors "
                                f"file ({exc})") from exc
    if not items:
        raise UpdateRefused(f"Cannot update weights: missing weight files for modules: "
                            f"{[component]}. No partial updates allowed.")
    return items


def tensors_plan(stores: Mapping[str, TensorStore],
                 named: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                 target: str, load_weights: bool | None, name_map: NameMap | None
                 ) -> Callable[[], UpdatePlan] | None:
    """What plans ``update_weights_from_tensors`` through ``target``'s own loader or
    ``name_map``, or None when neither applies (the plain plan does)."""
    if target not in stores or not _routed(stores[target].module, load_weights, name_map):
        return None
    return lambda: plan_named(stores, {target: checked(named)}, load_weights, name_map)


def disk_plan(stores: Mapping[str, TensorStore], path: str | os.PathLike[str],
              targets: Sequence[str] | None, load_weights: bool | None,
              name_map: NameMap | None) -> Callable[[], UpdatePlan] | None:
    """What plans ``update_weights_from_disk`` through the targets' own loaders or
    ``name_map`` (their tensors read into memory first), or None when neither applies to
    any target (the plain plan reads straight into place)."""
    root = Path(path)
    if targets is not None:
        wanted = [t for t in targets if t in stores]
    elif root.is_file():
        wanted = list(stores)
    else:
        wanted = [c for c in stores if any((root / c).glob("*.safetensors"))]
    if not any(_routed(stores[c].module, load_weights, name_map) for c in wanted):
        return None

    def make() -> UpdatePlan:
        if targets is None and root.is_file():
            parts = {c: items for c in wanted if (items := _prefixed(root, c))}
        else:
            parts = {c: disk_items(root, c) for c in (targets or wanted)}
        if not parts:
            raise UpdateRefused(f"no weight files under {root}: expected <path>/<component>/"
                                f"*.safetensors for components {sorted(stores)}")
        return plan_named(stores, parts, load_weights, name_map)

    return make


def _prefixed(root: Path, component: str) -> list[tuple[str, torch.Tensor]]:
    try:
        return disk_items(root, component)
    except UpdateRefused:
        return []


def plan_named(stores: Mapping[str, TensorStore], parts: Mapping[str, Items],
               load_weights: bool | None, name_map: NameMap | None) -> UpdatePlan:
    """The plan writing ``parts`` (``{component: [(name, tensor), ...]}``), each component
    through its own loader (see :func:`loader_of`) or, with ``name_map``, renamed."""
    missing = [c for c in parts if c not in stores]
    if missing:
        raise UpdateRefused(f"Module(s) requested for update not found in pipeline: {missing}. "
                            f"Available Module(s): {sorted(stores)}")
    planner = _Planner(stores)
    for component, items in parts.items():
        store = stores[component]
        loader = None if name_map is not None else \
            loader_of(store.module, component, load_weights)
        if loader is None:
            named = items if name_map is None else renamed(items, name_map, component)
            for name, tensor in named:
                planner.add(component, name, tensor.shape, tensor.dtype,
                            functools.partial(_same, tensor))
        else:
            _through_loader(planner, store, component, items)
    return planner.finish(list(parts))


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _host(t: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode(False):
        return t.detach().to("cpu", copy=True)


def _shadow(module: nn.Module, store: TensorStore) -> nn.Module:
    """A copy of ``module`` over host copies of the served values of its parameters and
    buffers (read from wherever they live), without its hooks (ours and anyone's)."""
    memo: dict[int, Any] = {}
    for m in module.modules():
        for attr, value in vars(m).items():
            if "hook" in attr and isinstance(value, dict):
                memo[id(value)] = type(value)()
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) not in memo:
            live = store.tensor_named(name)
            q = nn.Parameter(_host(p if live is None else live), requires_grad=p.requires_grad)
            q.__dict__.update(p.__dict__)  # weight_loader, output_dim, ... as the model set them
            memo[id(p)] = q
    for name, b in module.named_buffers(remove_duplicate=False):
        if id(b) not in memo:
            live = store.tensor_named(name)
            memo[id(b)] = _host(b if live is None else live)
    try:
        return copy.deepcopy(module, memo)
    except Exception as exc:
        raise UpdateRefused(f"cannot copy {type(module).__name__} to run its load_weights "
                            f"({type(exc).__name__}: {exc}); nothing was updated") from None


def _through_loader(planner: _Planner, store: TensorStore, component: str,
                    items: Items) -> None:
    """Run ``component``'s ``load_weights`` on a shadow and plan every tensor it changed."""
    if store.stale_count:
        raise UpdateRefused(f"component {component!r} holds weights discarded by the sleep: "
                            "its load_weights would start from undefined values; update it "
                            "with its own parameter names (load_weights=False) first")
    shadow = _shadow(store.module, store)
    read = itertools.count()

    def feed() -> Iterator[tuple[str, torch.Tensor]]:
        for item in items:
            next(read)
            yield item

    try:
        with torch.no_grad():
            returned = shadow.load_weights(feed())  # type: ignore[operator]
    except Exception as exc:
        raise UpdateRefused(f"{component}.load_weights raised {type(exc).__name__}: {exc}; "
                            "nothing was updated") from None
    taken = next(read)
    if taken != len(items):
        raise UpdateRefused(f"{component}.load_weights read {taken} of the {len(items)} "
                            "tensors given; nothing was updated")
    if isinstance(returned, (set, frozenset, list, tuple)):
        unknown = sorted(str(n) for n in returned if store.tensor_named(str(n)) is None)
        if unknown:
            raise UpdateRefused(f"{component}.load_weights reports loading {unknown}, which "
                                f"{component!r} does not have; nothing was updated")
    now = dict(itertools.chain(shadow.named_parameters(remove_duplicate=False),
                               shadow.named_buffers(remove_duplicate=False)))
    for name, live in store.named_tensors():
        new = now.get(name)
        if new is None:
            continue  # a plain tensor attribute: not the loader's
        new = new.detach()
        if tuple(new.shape) == tuple(live.shape) and new.dtype == live.dtype \
                and torch.equal(new, _host(live)):
            continue  # unchanged
        planner.add(component, name, new.shape, new.dtype, functools.partial(_same, new))
