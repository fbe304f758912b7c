"""LoRA merges (``weight_update_mode="lora_merge"``), without drift.

A trainer that fine-tunes with LoRA sends only the adapter: for each targeted linear,
``<linear>.lora_A.weight`` (``[r, in]``) and ``<linear>.lora_B.weight`` (``[out, r]``), named as
its PEFT model names them (the ``base_model.model.`` prefix and the ``.default`` adapter infix
are accepted: ``base_model.model.blocks.0.attn.to_q.lora_A.default.weight``). Each targeted
weight becomes::

    W = W_base + (lora_alpha / lora_rank) * (B @ A)      in fp32, cast to W's dtype

with ``lora_alpha`` defaulting to ``lora_rank`` (scale 1, as the reference does) and
``lora_rank`` to the adapter's own rank. Entries whose product term is exactly zero keep the
base's bits (``-0.0`` included), so that a zero adapter gives the base back bit for bit.

**No drift.** The reference merges into the live weight, so a thousand syncs accumulate a
thousand roundings. Here the first merge into a weight keeps its pristine base (a host copy,
reported as ``lora_base_bytes`` in ``ctl.report()``), and every merge starts from that base.
A full-weight update of a LoRA-targeted weight (tensors, disk, distributed) replaces its base.
Bases are kept and replaced at the update's commit, like the weights (a failed update keeps
the old ones), and forgotten at detach. Writes that bypass the controller (``param.data``)
are not seen.

Everything is checked before anything is written (typed refusals naming what is wrong):
every name is a LoRA A/B name, each targeted linear exists with a 2-D weight, A and B come as
a pair with ``A: [r, in]``, ``B: [out, r]`` against ``W: [out, in]``, and ``lora_rank`` (when
given) equals r. A payload with known and unknown targets is refused whole.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import anyio
import torch

from strategies.protocol import PreparedMove, TensorStore, to_thread

from ._errors import InvalidRequest
from ._updates import PlannedWrite, UpdatePlan, UpdateRefused, plan_from_tensors

__all__ = ["PEFT_PREFIX", "WEIGHT_UPDATE_MODES", "LoraBases", "LoraMergeNotFinite", "LoraScale",
           "LoraTarget", "lora_layout", "merge_plan", "merged_weight", "parse_lora_name", "parse_mode",
           "parse_scale", "plan_lora_from_tensors", "plan_tensors"]

WeightUpdateMode = Literal["full", "lora_merge"]
WEIGHT_UPDATE_MODES: tuple[str, ...] = ("full", "lora_merge")
PEFT_PREFIX = "base_model.model."
_LORA_NAME = re.compile(r"^(?P<target>.+)\.lora_(?P<half>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
_SHOWN = 20  # names shown in one message


def parse_mode(mode: object) -> WeightUpdateMode:
    """``weight_update_mode``: ``None`` or ``"full"`` (replace tensors), ``"lora_merge"``."""
    if mode is None or mode == "full":
        return "full"
    if mode == "lora_merge":
        return "lora_merge"
    raise InvalidRequest("weight_update_mode", f"weight_update_mode must be one of "
                                               f"{list(WEIGHT_UPDATE_MODES)}, got {mode!r}")


@dataclass(frozen=True)
class LoraScale:
    """``lora_alpha`` and ``lora_rank`` as given (each may be None)."""

    alpha: float | None = None
    rank: int | None = None

    def of(self, rank: int) -> float:
        """The scale of an adapter of rank ``rank``: alpha / rank (alpha defaults to rank)."""
        return 1.0 if self.alpha is None else self.alpha / rank


def parse_scale(mode: WeightUpdateMode, lora_alpha: object, lora_rank: object) -> LoraScale:
    """Check ``lora_alpha`` (a finite number) and ``lora_rank`` (an integer >= 1): given only
    with ``weight_update_mode="lora_merge"`` (ignored otherwise, as the reference does)."""
    if mode != "lora_merge":
        return LoraScale()
    if lora_rank is not None and (isinstance(lora_rank, bool) or not isinstance(lora_rank, int)
                                  or lora_rank < 1):
        raise InvalidRequest("lora_rank", f"lora_rank must be an integer >= 1, got {lora_rank!r}")
    if lora_alpha is not None and (isinstance(lora_alpha, bool)
                                   or not isinstance(lora_alpha, int | float)
                                   or not math.isfinite(lora_alpha)):
        raise InvalidRequest("lora_alpha", f"lora_alpha must be a finite number, got "
                                           f"{lora_alpha!r}")
    return LoraScale(None if lora_alpha is None else float(lora_alpha), lora_rank)


def parse_lora_name(name: str) -> tuple[str, str, str | None] | None:
    """``(linear, "A" or "B", adapter)`` of a LoRA tensor name (PEFT prefix dropped), or None."""
    found = _LORA_NAME.match(name.removeprefix(PEFT_PREFIX))
    if found is None:
        return None
    return found["target"], found["half"], found["adapter"]


@dataclass(eq=False)
class LoraTarget:
    """One targeted weight: where its A and B are among the update's entries, its rank and
    scale, and the pristine base it is merged from (kept, or taken by this update)."""

    component: str
    weight: str  # the weight's name in the component (its first name, if tied)
    a: int  # index of lora_A among the entries
    b: int
    rank: int
    scale: float
    dtype: torch.dtype  # the weight's
    device: torch.device  # where the merge is computed: where the weight is now
    base: torch.Tensor | None = None  # on the host
    captured: bool = False  # taken by this update (kept from its commit on)
    nbytes: int = 0


def _show(names: Sequence[str]) -> str:
    shown = sorted(names)
    more = f" (and {len(shown) - _SHOWN} more)" if len(shown) > _SHOWN else ""
    return f"{shown[:_SHOWN]}{more}"


def lora_layout(store: TensorStore, component: str,
                entries: Sequence[tuple[str, Sequence[int], torch.dtype]], scale: LoraScale
                ) -> list[LoraTarget]:
    """Check the LoRA entries ``(name, shape, dtype)`` of an update of ``component`` against
    it (see the module doc) and return its targets, in the order their A first appears.
    Raises :class:`UpdateRefused` naming every fault of the first kind found."""
    halves: dict[str, dict[str, int]] = {}
    not_lora: list[str] = []
    adapters: set[str] = set()
    twice: list[str] = []
    for i, (name, _, _) in enumerate(entries):
        parsed = parse_lora_name(name)
        if parsed is None:
            not_lora.append(name)
            continue
        target, half, adapter = parsed
        if adapter not in (None, "default"):
            adapters.add(adapter)
        if half in halves.setdefault(target, {}):
            twice.append(name)
        halves[target][half] = i
    if not_lora:
        raise UpdateRefused(f"weight_update_mode='lora_merge' takes only LoRA tensors named "
                            f"<linear>.lora_A.weight and <linear>.lora_B.weight (PEFT's "
                            f"'{PEFT_PREFIX}' prefix and '.default' adapter accepted); "
                            f"{len(not_lora)} name(s) are not: {_show(not_lora)}; nothing was "
                            "updated")
    if adapters:
        raise UpdateRefused(f"only PEFT's 'default' adapter can be merged, got adapter(s) "
                            f"{sorted(adapters)}; nothing was updated")
    if twice:
        raise UpdateRefused(f"LoRA tensor(s) given twice (with and without a prefix or "
                            f"adapter infix?): {_show(twice)}; nothing was updated")
    unpaired = [f"{t} (lora_{'B' if 'A' in h else 'A'} missing)" for t, h in halves.items()
                if len(h) != 2]
    if unpaired:
        raise UpdateRefused(f"LoRA A and B come in pairs: {_show(unpaired)}; nothing was "
                            "updated")
    unknown: list[str] = []
    targets: list[LoraTarget] = []
    faults: list[str] = []
    for target, pair in halves.items():
        weight = f"{target}.weight"
        live = store.tensor_named(weight)
        if live is None or live.dim() != 2 or not live.is_floating_point():
            unknown.append(target)
            continue
        (_, a_shape, a_dtype), (_, b_shape, b_dtype) = entries[pair["A"]], entries[pair["B"]]
        out, inp = (int(d) for d in live.shape)
        a_shape, b_shape = tuple(int(d) for d in a_shape), tuple(int(d) for d in b_shape)
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[1] != inp or b_shape[0] != out \
                or a_shape[0] != b_shape[1] or a_shape[0] < 1:
            faults.append(f"{target}: A {list(a_shape)} and B {list(b_shape)} do not fit "
                          f"W {[out, inp]} (A must be [r, {inp}], B [{out}, r])")
            continue
        rank = a_shape[0]
        if rank > min(out, inp):
            faults.append(f"{target}: the adapter's rank {rank} is over min(out, in) = "
                          f"{min(out, inp)} of W {[out, inp]}, the most a LoRA rank can be")
            continue
        if scale.rank is not None and scale.rank != rank:
            faults.append(f"{target}: lora_rank={scale.rank} but the adapter has rank {rank} "
                          f"(A {list(a_shape)}, B {list(b_shape)})")
            continue
        if not (a_dtype.is_floating_point and b_dtype.is_floating_point):
            faults.append(f"{target}: A and B must be floating point, got {a_dtype} and "
                          f"{b_dtype}")
            continue
        canonical = store.slot_named(weight)[0].names[0]
        targets.append(LoraTarget(component, canonical, pair["A"], pair["B"], rank,
                                  scale.of(rank), live.dtype, live.device,
                                  nbytes=int(live.nbytes)))
    if unknown:
        known = len(halves) - len(unknown)
        raise UpdateRefused(f"{len(unknown)} LoRA target(s) match no linear weight of "
                            f"{component} (<target>.weight, 2-D): {_show(unknown)}"
                            + (f" ({known} other target(s) known: the payload is refused "
                               "whole)" if known else "") + "; nothing was updated")
    if faults:
        raise UpdateRefused("LoRA shapes do not fit: " + "; ".join(faults[:_SHOWN])
                            + "; nothing was updated")
    return targets


class LoraMergeNotFinite(ValueError):
    """A merge whose result has an inf or NaN where the base was finite (``lora_alpha`` or
    the adapter too large for the weight's dtype): the client's fault, rolled back."""


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``base + scale * (b @ a)`` in fp32 on ``device``, cast to ``dtype``; where the product
    term is exactly zero the base's own bits are kept (a zero adapter gives the base back)."""
    base32 = base.to(device=device, dtype=torch.float32)
    delta = torch.mm(b.to(device=device, dtype=torch.float32),
                     a.to(device=device, dtype=torch.float32))
    delta.mul_(scale)
    keep = delta == 0
    delta.add_(base32)
    merged = torch.where(keep, base32, delta).to(dtype)
    if not bool((torch.isfinite(merged) | ~torch.isfinite(base32)).all()):
        raise LoraMergeNotFinite(f"the merge (scale {scale:g}) makes values that are not finite "
                                 f"in {dtype}; lora_alpha or the adapter is too large")
    if merged.device.type == "cuda":  # the write copies it on another stream: landed first
        torch.cuda.current_stream(merged.device).synchronize()
    return merged


def _merge(target: LoraTarget, get: Callable[[int], torch.Tensor]) -> torch.Tensor:
    assert target.base is not None
    return merged_weight(target.base, get(target.a), get(target.b), target.scale,
                         target.dtype, target.device)


def merge_plan(component: str, targets: Sequence[LoraTarget],
               get: Callable[[int], torch.Tensor]) -> UpdatePlan:
    """The writes of a merge: each target's weight, computed from its base when written
    (``get(i)``: the i-th entry's tensor, called then)."""
    plan = UpdatePlan([PlannedWrite(component, t.weight, functools.partial(_merge, t, get), t.nbytes)
                       for t in targets], (component,))
    plan.merged = {(component, t.weight) for t in targets}
    plan.captured = {(component, t.weight): t.base for t in targets
                     if t.captured and t.base is not None}
    return plan


def plan_lora_from_tensors(stores: Mapping[str, TensorStore],
                           named: Sequence[tuple[str, torch.Tensor]], target: str,
                           scale: LoraScale, bases: LoraBases) -> UpdatePlan:
    """Plan merging the LoRA tensors ``named`` into component ``target`` (in a worker
    thread: the bases taken now are copied to the host)."""
    if target not in stores:
        raise UpdateRefused(f"Module(s) requested for update not found in pipeline: "
                            f"{[target]}. Available Module(s): {sorted(stores)}")
    entries: list[tuple[str, Sequence[int], torch.dtype]] = []
    tensors: list[torch.Tensor] = []
    for i, item in enumerate(named):
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)
                and isinstance(item[1], torch.Tensor)):
            raise UpdateRefused(f"entry {i} must be a (str, torch.Tensor) pair")
        name, tensor = item
        if tensor.is_meta or tensor.layout != torch.strided:
            raise UpdateRefused(f"tensor {name!r} has no dense data ({tensor.device}, "
                                f"{tensor.layout})")
        entries.append((name, tensor.shape, tensor.dtype))
        tensors.append(tensor)
    store = stores[target]
    targets = lora_layout(store, target, entries, scale)
    bases.attach_bases(store, targets)
    return merge_plan(target, targets, tensors.__getitem__)


def plan_tensors(stores: Mapping[str, TensorStore],
                 named: Mapping[str, torch.Tensor] | Sequence[tuple[str, torch.Tensor]],
                 target: str, mode: object, lora_alpha: object, lora_rank: object,
                 bases: LoraBases) -> Callable[[], UpdatePlan]:
    """What plans ``update_weights_from_tensors``: ``named`` written into ``target`` as
    they are, or (``mode="lora_merge"``) merged into its linears' pristine ``bases``. The
    arguments are checked now, the plan is made when called (in a worker thread)."""
    if parse_mode(mode) == "lora_merge":
        scale = parse_scale("lora_merge", lora_alpha, lora_rank)
        items = list(named.items()) if isinstance(named, Mapping) else list(named)
        return lambda: plan_lora_from_tensors(stores, items, target, scale, bases)
    return lambda: plan_from_tensors(stores, named, target)


def _host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of ``t`` (read from wherever it lives), never an inference tensor."""
    with torch.inference_mode(False):
        return t.detach().to("cpu", copy=True)


@dataclass(eq=False)
class _KeepBases:
    """A prepared move (see :class:`strategies.PreparedMove`) that keeps new bases at the
    update's commit: those a merge took first, and those a full write replaced."""

    store: TensorStore
    bases: LoraBases
    new: dict[tuple[str, str], torch.Tensor]
    bytes_copied: int = 0

    def commit(self) -> None:
        self.bases._bases.update(self.new)
        self.new = {}

    async def undo(self) -> None:
        self.new = {}

    async def settle(self) -> BaseException | None:
        return None


@dataclass(eq=False)
class LoraBases:
    """The pristine base weights of the LoRA-merged weights of one controller's pipeline:
    ``(component, weight name) -> host tensor``."""

    _bases: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)

    def base(self, component: str, weight: str) -> torch.Tensor | None:
        return self._bases.get((component, weight))

    def nbytes(self, component: str) -> int:
        """Host bytes of the bases kept for ``component``."""
        return sum(int(t.nbytes) for (c, _), t in self._bases.items() if c == component)

    def names(self, component: str) -> list[str]:
        """The weights of ``component`` with a kept base."""
        return sorted(w for c, w in self._bases if c == component)

    def clear(self) -> None:
        """Forget every base (the pipeline was detached)."""
        self._bases.clear()

    def forget(self, component: str) -> None:
        """Forget the bases of ``component`` (it was removed)."""
        for key in [k for k in self._bases if k[0] == component]:
            del self._bases[key]

    def attach_bases(self, store: TensorStore, targets: Sequence[LoraTarget]) -> None:
        """Give each target its kept base, or take one now from the live weight (kept only
        if the update commits). Blocking: in a worker thread."""
        for t in targets:
            kept = self.base(t.component, t.weight)
            if kept is None:
                live = store.tensor_named(t.weight)
                assert live is not None
                t.base, t.captured = _host_copy(live), True
            else:
                t.base = kept

    async def prepare_commit(self, plan: UpdatePlan, stores: Mapping[str, TensorStore],
                             limiter: anyio.CapacityLimiter | None) -> PreparedMove | None:
        """After ``plan``'s writes were prepared: the move that keeps its new bases at commit
        (bases it took; full writes of weights with a base replace it, copied from the live
        weight just written), or None when it has none."""
        new = dict(plan.captured)
        rebased: list[tuple[str, str]] = []
        for w in plan.writes if self._bases else []:
            if w.component not in stores:
                continue
            canonical = stores[w.component].slot_named(w.name)[0].names[0]
            key = (w.component, canonical)
            if key in self._bases and key not in plan.merged:
                rebased.append(key)
        if rebased:
            def copies() -> dict[tuple[str, str], torch.Tensor]:
                out = {}
                for component, weight in rebased:
                    live = stores[component].tensor_named(weight)
                    assert live is not None
                    out[(component, weight)] = _host_copy(live)
                return out

            new.update(await to_thread(copies, limiter=limiter))
        if not new:
            return None
        component = next(iter(new))[0]
        return _KeepBases(stores[component], self, new)
