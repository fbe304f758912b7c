"""The residency planner: the fastest placement of a pipeline under a device-memory budget.

Inputs are measured, never guessed (:class:`Measurements`, taken once per controller and
reused, so plans for different budgets are comparable):

* sizes: for every component, the exact bytes each mode would hold, from the stores that mode
  would build (per-storage units, one whole unit, one unit per layer: alignment included);
* the request: which components a request uses, in what order, how many root forwards each
  use runs and its compute seconds (from one warm-up request run through the controller, or
  declared), and whether the next component can move in while one runs (request prefetch);
* the link: host-to-device bandwidth from a short device-layer copy.

The model (exact arithmetic over those inputs, see :func:`predict`):

* bytes on the device: every component's *idle* bytes (resident: all; layerwise: the
  non-layer weights; offloaded: none), plus, during a use, the used component's *working*
  bytes (offloaded: all of it; layerwise: (resident + prefetch + 1) x its largest layer) and
  the *fetch* bytes of the next component a request prefetch brings in meanwhile; the peak is
  the largest such sum, plus the activation reserve;
* seconds: per use, the compute, the part of the move-in the previous use's compute could
  not hide, and for layerwise offload a simulation of the layer copies against the layer
  computes (one link, the prefetch window of the strategy, several forwards per use).

The decision space per component: resident, component-offload, snapshot-offload (predicted
like component-offload; ties go to component-offload, which keeps changes made during a use),
and layerwise offload with prefetch in {1, 2, 4} and resident layers in a few counts.
Latency is a sum over components, the peak a maximum over uses: the search is an exact
branch-and-bound (options dominated in every byte count and in seconds are dropped first,
which cannot change the optimum), returning the best layout and the runners-up.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from strategies import ComponentResidencyError, LayerwiseTuning, ResidencyConfig, ResidencyMode
from strategies.protocol import Shape, TensorStore, check_block_lists

from ._errors import LifecycleError, UnknownComponent
from ._units import format_bytes, gbps, parse_size

__all__ = [
    "ComponentDecision",
    "ComponentSizes",
    "InfeasibleBudget",
    "Measurements",
    "Option",
    "ResidencyPlan",
    "Use",
    "declared_uses",
    "make_plan",
    "options_for",
    "parse_budget",
    "predict",
    "search",
]

_MODE_ORDER = {ResidencyMode.RESIDENT: 0, ResidencyMode.RESIDENT_STABLE: 0,
               ResidencyMode.LAYERWISE_OFFLOAD: 1, ResidencyMode.COMPONENT_OFFLOAD: 2,
               ResidencyMode.SNAPSHOT_OFFLOAD: 3}
PREFETCH_CHOICES = (1, 2, 4)
RUNNERS_UP = 3


class InfeasibleBudget(LifecycleError):
    """No layout fits the budgets. ``budget``: the one that does not fit (``"device"`` or
    ``"host"``: host bytes held while awake, the mirrors of what is offloaded);
    ``minimum_bytes`` is the smallest such budget that fits (with the other budget kept; the
    device's reserve included); the message says which layout would run there."""

    def __init__(self, budget_bytes: int, minimum_bytes: int, layout: str,
                 reserve: int = 0, *, budget: str = "device",
                 device_budget_bytes: int | None = None) -> None:
        if budget == "host":
            message = (f"no residency fits a host budget of {format_bytes(budget_bytes)} "
                       f"within a device budget of {format_bytes(device_budget_bytes or 0)}: "
                       f"the layouts that fit the device hold at least "
                       f"{format_bytes(minimum_bytes)} ({minimum_bytes} bytes) on the host "
                       f"while awake, running {layout}")
        else:
            message = (f"no residency fits a device budget of {format_bytes(budget_bytes)}"
                       + (f" (activation reserve {format_bytes(reserve)} included)"
                          if reserve else "")
                       + f"; the smallest feasible budget is {format_bytes(minimum_bytes)} "
                       f"({minimum_bytes} bytes), running {layout}")
        super().__init__(message)
        self.budget = budget
        self.budget_bytes = budget_bytes
        self.minimum_bytes = minimum_bytes
        self.layout = layout


def parse_budget(budget: int | float | str, *, free_bytes: int | None, pipeline_bytes: int,
                 what: str = "device budget") -> int:
    """Bytes of a budget given as bytes, a size string (``"20GiB"``, ``"300MB"``) or a
    percentage (``"90%"``) of the device's free memory (``free_bytes``; where that is
    unknown, as on the CPU, of the pipeline's size). ``what``: its name in errors."""
    if isinstance(budget, bool) or not isinstance(budget, int | float | str):
        raise TypeError(f"{what} must be bytes, a size string or a percentage, "
                        f"got {type(budget).__name__}")
    if isinstance(budget, int | float):
        if not math.isfinite(budget) or budget < 0:
            raise ValueError(f"{what} must be a non-negative number of bytes, got {budget}")
        return int(budget)
    text = budget.strip()
    if text.endswith("%"):
        try:
            share = float(text[:-1])
        except ValueError:
            raise ValueError(f"invalid {what} {budget!r}; a percentage looks like "
                             "'90%'") from None
        if not math.isfinite(share) or not 0 < share <= 100:
            raise ValueError(f"{what} {budget!r}: the percentage must be in (0, 100]")
        whole = free_bytes if free_bytes is not None else pipeline_bytes
        return int(whole * share / 100)
    return parse_size(text)


# -- inputs ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Use:
    """One use of a component in a request: root forwards, compute seconds, and whether
    the request prefetch may bring it in while the previous use runs (``hidden_by``: that
    use's compute seconds)."""

    name: str
    forwards: int = 1
    seconds: float = 0.0
    prefetched: bool = False
    hidden_by: float = 0.0


@dataclass(frozen=True)
class ComponentSizes:
    """Exact device bytes of one component under each grouping."""

    name: str
    resident: int  # every storage its own unit (+ derived attributes)
    whole: int  # one unit (+ derived)
    nonlayer: int = 0  # layerwise: bytes outside the block lists (+ derived)
    layers: tuple[int, ...] = ()  # layerwise: bytes per layer, definition order (+ derived)
    lists: tuple[str, ...] = ()  # the block lists streamed
    fsdp: bool = False  # FSDP owns its placement: resident only

    @classmethod
    def of(cls, name: str, module: nn.Module, layout: TensorStore, fsdp: bool = False
           ) -> ComponentSizes:
        """Sizes from the stores each mode would build over ``layout``'s storages (inventory
        only: nothing is moved or allocated)."""
        layer = layout.layer

        def held(store: TensorStore, units: Sequence[Any]) -> int:
            return sum(u.nbytes + store.derived_nbytes(u) for u in units)

        resident = Shape(ResidencyMode.RESIDENT).store(name, module, layer, layout)
        whole = Shape(ResidencyMode.COMPONENT_OFFLOAD).store(name, module, layer, layout)
        sizes = cls(name, held(resident, resident.units), held(whole, whole.units), fsdp=fsdp)
        try:
            lists = check_block_lists(module, None)
        except ValueError:
            return sizes
        shape = Shape(ResidencyMode.LAYERWISE_OFFLOAD, lists, LayerwiseTuning())
        lw = shape.store(name, module, layer, layout)
        by_key = lw.by_key
        layer_units = [by_key[k] for k in lw.layer_keys if k in by_key]
        keys = set(lw.layer_keys)
        return dataclasses.replace(
            sizes, nonlayer=held(lw, [u for u in lw.units if u.key not in keys]),
            layers=tuple(held(lw, [u]) for u in layer_units), lists=lists)


@dataclass(frozen=True)
class Measurements:
    """What the planner knows about a pipeline: sizes, the request, the link."""

    sizes: tuple[ComponentSizes, ...]
    uses: tuple[Use, ...]
    bandwidth: float  # host-to-device bytes per second
    other_seconds: float = 0.0  # request time outside any use (the caller's own code)
    activation_reserve: int = 0
    source: str = "sizes"  # "warm-up" or "declared" or "sizes"
    copy_latency: float = 0.0  # seconds per copy besides its bytes (start, wait, allocation)
    overlap: bool = True  # copies run beside compute (CUDA); on the CPU they take its cores

    @property
    def pipeline_bytes(self) -> int:
        return sum(s.resident for s in self.sizes)


def declared_uses(uses: Sequence[str | tuple[str, float] | tuple[str, float, int]],
                  components: Mapping[str, object]) -> tuple[Use, ...]:
    """:class:`Use` records from a declared request: names, or ``(name, seconds)``, or
    ``(name, seconds, forwards)``; unknown names are refused with the valid ones."""
    out = []
    for item in uses:
        name, seconds, forwards = (item, 0.0, 1) if isinstance(item, str) else \
            (item[0], float(item[1]), int(item[2]) if len(item) > 2 else 1)
        if name not in components:
            raise UnknownComponent(name, list(components))
        if seconds < 0 or forwards < 1:
            raise ValueError(f"declared use {item!r}: seconds must be >= 0, forwards >= 1")
        out.append(Use(name, forwards, seconds))
    return tuple(out)


# -- options ------------------------------------------------------------------------------
@dataclass(frozen=True, order=True)
class Option:
    """One decision for one component, with what it costs."""

    seconds: float  # per request, all its uses
    moved: int  # bytes copied per request
    idle: int  # device bytes between uses (awake)
    working: int  # more device bytes during its use
    fetch: int  # more device bytes while a request prefetch brings it in
    mode: ResidencyMode = field(compare=False)
    prefetch: int = field(default=0, compare=False)
    resident_layers: int = field(default=0, compare=False)
    host: int = field(default=0, compare=False)  # host bytes held while awake (its mirrors)

    def label(self) -> str:
        if self.mode is ResidencyMode.LAYERWISE_OFFLOAD:
            return f"{self.mode.value}(prefetch={self.prefetch}, resident_layers=" \
                   f"{self.resident_layers})"
        return str(self.mode.value)

    def footprint(self) -> tuple[int, int, int]:
        return self.idle, self.working, self.fetch


def _simulate_layers(layers: Sequence[int], resident: int, prefetch: int, forwards: int,
                     seconds: float, bandwidth: float, latency: float = 0.0
                     ) -> tuple[float, int]:
    """Seconds and bytes of one layerwise use: ``forwards`` passes over ``layers`` (bytes
    each) whose first ``resident`` stay in; the strategy's window of ``prefetch`` streamed
    layers is copied ahead over one link while layers compute (compute split by bytes). The
    resident layers and the first window came in before (the use's preparation)."""
    total = sum(layers) or 1
    n = len(layers)
    streamed = [i for i in range(n) if i >= resident]
    if not streamed or forwards == 0:
        return seconds, 0
    seq = [i for _ in range(forwards) for i in range(n)]
    stream_pos = [pos for pos, i in enumerate(seq) if i >= resident]
    ready: dict[int, float] = {}
    wrapped: set[int] = set()  # next-pass layers prefetched after the last pass
    for pos in stream_pos[:prefetch]:
        ready[pos] = 0.0  # the preparation brought the first window in
    link = now = 0.0
    moved = 0
    compute = [seconds / forwards * b / total for b in layers]
    k = 0  # index into stream_pos of the next streamed position not yet passed
    for pos, i in enumerate(seq):
        if i >= resident:
            if pos not in ready:
                link = max(now, link) + latency + layers[i] / bandwidth
                ready[pos] = link
                moved += layers[i]
            now = max(now, ready[pos])
            k += 1
        # The window: the next `prefetch` streamed layers (wrapping into a next pass).
        for j in range(k, k + prefetch):
            q = stream_pos[j] if j < len(stream_pos) else None
            if q is None:
                # Past the last pass: the strategy still prefetches the next pass's first
                # layers; finish_use waits for them.
                extra = j - len(stream_pos)
                if extra < len(streamed) and extra not in wrapped:
                    b = layers[streamed[extra]]
                    link = max(now, link) + latency + b / bandwidth
                    wrapped.add(extra)
                    moved += b
                continue
            if q not in ready:
                link = max(now, link) + latency + layers[seq[q]] / bandwidth
                ready[q] = link
                moved += layers[seq[q]]
        now += compute[i]
    return max(now, link), moved


def _copies(layers: Sequence[int], resident: int, copied: int) -> int:
    """How many layer copies ``copied`` bytes of streamed layers are (about)."""
    streamed = layers[resident:]
    return round(copied / (sum(streamed) / len(streamed))) if streamed else 0


def _resident_counts(n: int) -> list[int]:
    return sorted(c for c in {0, 1, n // 4, n // 2, (3 * n) // 4, n - 1} if 0 <= c < n)


def options_for(size: ComponentSizes, uses: Sequence[Use], bandwidth: float,
                latency: float = 0.0, overlap: bool = True) -> list[Option]:
    """Every decision for one component with its bytes and seconds under ``uses`` (the
    component's own uses in the request)."""
    bw = max(bandwidth, 1.0)
    compute = sum(u.seconds for u in uses)
    out = [Option(compute, 0, size.resident, 0, 0, ResidencyMode.RESIDENT)]
    if size.fsdp:
        return out

    def stall(u: Use, nbytes: int, copies: int = 1) -> float:
        cost = copies * latency + nbytes / bw if nbytes else 0.0
        return max(0.0, cost - (u.hidden_by if u.prefetched and overlap else 0.0))

    prefetched = any(u.prefetched for u in uses)
    offload_s = sum(stall(u, size.whole) + u.seconds for u in uses)
    for mode in (ResidencyMode.COMPONENT_OFFLOAD, ResidencyMode.SNAPSHOT_OFFLOAD):
        out.append(Option(offload_s, size.whole * len(uses), 0, size.whole,
                          size.whole if prefetched else 0, mode, host=size.whole))
    n = len(size.layers)
    if n < 2:
        return out
    largest = max(size.layers)
    for resident in _resident_counts(n):
        streamed = n - resident
        for p in PREFETCH_CHOICES:
            if p > streamed:
                continue
            prep = sum(size.layers[:resident]) + sum(size.layers[resident:resident + p])
            seconds = 0.0
            moved = 0
            for u in uses:
                body, copied = _simulate_layers(size.layers, resident, p, u.forwards,
                                                u.seconds, bw, latency)
                if not overlap:  # every copy takes time from the compute
                    body = u.seconds + copied / bw + latency * _copies(size.layers, resident,
                                                                     copied)
                seconds += stall(u, prep, resident + p) + body
                moved += prep + copied
            out.append(Option(seconds, moved, size.nonlayer, (resident + p + 1) * largest,
                              (resident + p) * largest if prefetched else 0,
                              ResidencyMode.LAYERWISE_OFFLOAD, p, resident,
                              host=sum(size.layers[resident:])))
    return out


def prune(options: Sequence[Option]) -> list[Option]:
    """Drop options another one beats or ties in seconds and in every byte count (the
    earlier one in mode order is kept on a full tie): the optimum is never among them."""
    ordered = sorted(options, key=lambda o: (o.seconds, o.moved, _MODE_ORDER[o.mode],
                                             o.footprint()))
    kept: list[Option] = []
    for o in ordered:
        if not any(k.seconds <= o.seconds and k.moved <= o.moved and k.host <= o.host
                   and all(a <= b for a, b in zip(k.footprint(), o.footprint(), strict=True))
                   for k in kept):
            kept.append(o)
    return kept


# -- the model --------------------------------------------------------------------------
def predict(layout: Mapping[str, Option], uses: Sequence[Use], reserve: int = 0) -> int:
    """Predicted peak device bytes of a layout over the request ``uses``."""
    base = sum(o.idle for o in layout.values())
    top = 0
    for k, u in enumerate(uses):
        nxt = uses[k + 1] if k + 1 < len(uses) else None
        extra = layout[u.name].working
        if nxt is not None and nxt.prefetched and nxt.name != u.name:
            extra += layout[nxt.name].fetch
        top = max(top, extra)
    return base + top + reserve


@dataclass(frozen=True)
class _Candidate:
    seconds: float
    moved: int
    peak: int
    choice: tuple[int, ...]  # option index per component


def search(names: Sequence[str], options: Sequence[Sequence[Option]], uses: Sequence[Use],
           budget: int, reserve: int = 0, keep: int = 1 + RUNNERS_UP,
           host_budget: int | None = None) -> list[_Candidate]:
    """The ``keep`` fastest layouts with a predicted peak within ``budget`` (and host bytes
    within ``host_budget``), best first (ties: fewer bytes moved, then a lower peak): an
    exact branch-and-bound."""
    n = len(names)
    rest_seconds = [0.0] * (n + 1)
    rest_idle = [0] * (n + 1)
    rest_host = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        rest_seconds[i] = rest_seconds[i + 1] + min(o.seconds for o in options[i])
        rest_idle[i] = rest_idle[i + 1] + min(o.idle for o in options[i])
        rest_host[i] = rest_host[i + 1] + min(o.host for o in options[i])
    min_work = {names[i]: min(o.working for o in options[i]) for i in range(n)}
    min_fetch = {names[i]: min(o.fetch for o in options[i]) for i in range(n)}
    best: list[tuple[float, int, int, tuple[int, ...]]] = []  # a max-heap by negation
    chosen: list[int] = []
    layout: dict[str, Option] = {}

    def bound_peak(depth: int) -> int:
        base = sum(o.idle for o in layout.values()) + rest_idle[depth]
        top = 0
        for k, u in enumerate(uses):
            w = layout[u.name].working if u.name in layout else min_work[u.name]
            nxt = uses[k + 1] if k + 1 < len(uses) else None
            if nxt is not None and nxt.prefetched and nxt.name != u.name:
                w += layout[nxt.name].fetch if nxt.name in layout else min_fetch[nxt.name]
            top = max(top, w)
        return base + top + reserve

    def worst() -> float:
        return -best[0][0] if len(best) >= keep else math.inf

    def walk(depth: int, seconds: float, moved: int) -> None:
        if seconds + rest_seconds[depth] > worst():
            return
        if bound_peak(depth) > budget:
            return
        if host_budget is not None and \
                sum(o.host for o in layout.values()) + rest_host[depth] > host_budget:
            return
        if depth == n:
            peak = predict(layout, uses, reserve)
            item = (-seconds, -moved, -peak, tuple(chosen))
            if len(best) < keep:
                heapq.heappush(best, item)
            elif item > best[0]:
                heapq.heapreplace(best, item)
            return
        for idx, o in enumerate(options[depth]):
            layout[names[depth]] = o
            chosen.append(idx)
            walk(depth + 1, seconds + o.seconds, moved + o.moved)
            chosen.pop()
            del layout[names[depth]]

    walk(0, 0.0, 0)
    found = sorted(best, key=lambda t: (-t[0], -t[1], -t[2], t[3]))
    return [_Candidate(-s, -m, -p, c) for s, m, p, c in found]


def minimum_peak(names: Sequence[str], options: Sequence[Sequence[Option]], uses: Sequence[Use],
                 reserve: int = 0) -> tuple[int, tuple[int, ...]]:
    """The smallest predicted peak of any layout (and one layout with it): over the options
    not dominated in bytes (a dominated one never lowers the peak)."""
    fronts: list[list[int]] = []
    for opts in options:
        front = [i for i, o in enumerate(opts)
                 if not any(all(a <= b for a, b in zip(q.footprint(), o.footprint(), strict=True))
                            and q.footprint() != o.footprint() for q in opts)]
        seen: dict[tuple[int, int, int], int] = {}
        for i in front:
            seen.setdefault(opts[i].footprint(), i)
        fronts.append(list(seen.values()))
    best: tuple[int, tuple[int, ...]] | None = None
    for combo in itertools.product(*fronts):
        layout = {names[i]: options[i][j] for i, j in enumerate(combo)}
        peak = predict(layout, uses, reserve)
        if best is None or peak < best[0]:
            best = (peak, tuple(combo))
    assert best is not None
    return best


# -- the plan -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ComponentDecision:
    """One row of a plan: what a component gets and why."""

    name: str
    nbytes: int
    option: Option
    why: str

    @property
    def mode(self) -> ResidencyMode:
        return self.option.mode


@dataclass(frozen=True)
class RunnerUp:
    """A feasible layout the plan beat, and by how much."""

    layout: tuple[tuple[str, str], ...]  # (component, option label)
    predicted_seconds: float
    predicted_peak_bytes: int
    worse_by: float  # fraction slower than the plan (0.05: 5% slower)


@dataclass(frozen=True)
class ResidencyPlan:
    """The fastest predicted layout under a device budget (see :mod:`lifecycle._planner`).

    Apply it with ``await ctl.set_residency(plan)``; :meth:`explain` tells why."""

    config: ResidencyConfig
    budget_bytes: int
    predicted_peak_bytes: int
    moved_bytes_per_request: int
    predicted_seconds: float
    decisions: tuple[ComponentDecision, ...]
    runners_up: tuple[RunnerUp, ...]
    activation_reserve: int
    bandwidth: float
    measured_from: str
    planner_seconds: float
    # The warm-up the plan was measured with: set_residency(plan) validates with it.
    warmup: Callable[[], Awaitable[object]] | None = field(default=None, compare=False,
                                                          repr=False)
    # The host budget planned for (None: none) and the host bytes the layout holds while
    # awake (the mirrors of what it offloads; a sleep keeps more unless file-backed).
    host_budget_bytes: int | None = None
    predicted_host_bytes: int = 0
    # The device peak of applying it from the layout held when it was made (old and new
    # placements held together during the hand-off: lifecycle._handoff); None: made while
    # (partly) asleep.
    # set_residency(plan) predicts it again from the layout held then and refuses a plan
    # whose hand-off would pass budget_bytes.
    transient_peak_bytes: int | None = None

    def explain(self) -> str:
        """A table per component (bytes, mode, tuning, moved per request, why), the totals,
        and the runner-up layouts with how much slower each is predicted to be."""
        rows = [("component", "bytes", "mode", "tuning", "moved/request", "why")]
        for d in self.decisions:
            o = d.option
            tuning = f"prefetch={o.prefetch}, resident_layers={o.resident_layers}" \
                if o.mode is ResidencyMode.LAYERWISE_OFFLOAD else "-"
            rows.append((d.name, format_bytes(d.nbytes), o.mode.value, tuning, format_bytes(o.moved), d.why))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"residency plan for a device budget of {format_bytes(self.budget_bytes)} "
                 f"(measured from {self.measured_from}; link {gbps(self.bandwidth, 1.0):.2f} GB/s"
                 + (f"; activation reserve {format_bytes(self.activation_reserve)}"
                    if self.activation_reserve else "") + ")"]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                  for r in rows]
        lines.append(f"predicted: peak {format_bytes(self.predicted_peak_bytes)}, host "
                     f"{format_bytes(self.predicted_host_bytes)} while awake"
                     + (f" (host budget {format_bytes(self.host_budget_bytes)})"
                        if self.host_budget_bytes is not None else "") + ", "
                     f"{self.predicted_seconds * 1e3:.2f} ms per request, "
                     f"{format_bytes(self.moved_bytes_per_request)} moved per request "
                     f"(planned in {self.planner_seconds * 1e3:.1f} ms)")
        if self.transient_peak_bytes is not None:
            lines.append(f"applying it from the layout held now peaks at "
                         f"{format_bytes(self.transient_peak_bytes)} on the device (old and "
                         "new placements held together during the hand-off)")
        if self.runners_up:
            lines.append("runners-up:")
            for r in self.runners_up:
                layout = ", ".join(f"{n}={label}" for n, label in r.layout)
                lines.append(f"  +{r.worse_by * 100:.1f}% ({r.predicted_seconds * 1e3:.2f} ms, "
                             f"peak {format_bytes(r.predicted_peak_bytes)}): {layout}")
        else:
            lines.append("runners-up: none (no other feasible layout)")
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "config": self.config.to_string(),
            "prefetch": dict(self.config.prefetch),
            "resident_layers": dict(self.config.resident_layers),
            "budget_bytes": self.budget_bytes,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "predicted_host_bytes": self.predicted_host_bytes,
            "transient_peak_bytes": self.transient_peak_bytes,
            "moved_bytes_per_request": self.moved_bytes_per_request,
            "predicted_seconds": self.predicted_seconds,
            "activation_reserve": self.activation_reserve,
            "bandwidth": self.bandwidth,
            "measured_from": self.measured_from,
            "planner_seconds": self.planner_seconds,
            "components": [{"name": d.name, "bytes": d.nbytes, "mode": d.mode.value,
                            "prefetch": d.option.prefetch,
                            "resident_layers": d.option.resident_layers,
                            "moved_per_request": d.option.moved,
                            "seconds": d.option.seconds, "why": d.why}
                           for d in self.decisions],
            "runners_up": [{"layout": dict(r.layout), "predicted_seconds": r.predicted_seconds,
                            "predicted_peak_bytes": r.predicted_peak_bytes,
                            "worse_by": r.worse_by} for r in self.runners_up],
        }


def _config_of(layout: Mapping[str, Option], sizes: Mapping[str, ComponentSizes]
               ) -> ResidencyConfig:
    modes = {n: o.mode for n, o in layout.items()}
    layerwise = {n: o for n, o in layout.items() if o.mode is ResidencyMode.LAYERWISE_OFFLOAD}
    return ResidencyConfig.parse(
        modes,
        prefetch={n: float(o.prefetch) for n, o in layerwise.items()},
        resident_layers={n: float(o.resident_layers) for n, o in layerwise.items()},
        layers={n: list(sizes[n].lists) for n in layerwise})


def _why(name: str, chosen: Option, options: Sequence[Option], layout: Mapping[str, Option],
         uses: Sequence[Use], budget: int, reserve: int) -> str:
    faster = [o for o in options if o.seconds < chosen.seconds]
    if not faster:
        return "fastest option for it" if chosen.mode is ResidencyMode.RESIDENT or \
            len(options) == 1 else "fastest option for it (moves hide behind compute)"
    # The fastest alternative, everything else kept: how far over the budget it would go.
    alt = min(faster, key=lambda o: o.seconds)
    peak = predict({**layout, name: alt}, uses, reserve)
    return f"{alt.label()} would save {(chosen.seconds - alt.seconds) * 1e3:.2f} ms but " \
           f"peak at {format_bytes(peak)}, over the budget by {format_bytes(max(0, peak - budget))}"


def _keep_fixed(all_options: list[list[Option]], sizes: Sequence[ComponentSizes],
                fixed: Mapping[str, ResidencyMode]) -> None:
    """Leave each fixed component only the options of its fixed mode (a layerwise one keeps
    the choice of prefetch and resident layers); refuse a mode it cannot have."""
    for i, size in enumerate(sizes):
        mode = fixed.get(size.name)
        if mode is None:
            continue
        kept = [o for o in all_options[i] if o.mode is mode]
        if not kept and mode is ResidencyMode.RESIDENT_STABLE and not size.fsdp:
            # Its bytes and costs are resident's (held on the device while awake, one mirror
            # while asleep); the planner never picks it itself: only a user knows that a
            # component's forward is captured in a graph.
            kept = [dataclasses.replace(o, mode=mode) for o in all_options[i]
                    if o.mode is ResidencyMode.RESIDENT]
        if not kept:
            why = "it is FSDP-managed" if size.fsdp else "it has no block list to stream"
            raise ComponentResidencyError(
                f"Component {size.name!r} is fixed to {mode.value} in residency='auto,...', "
                f"but {why}; modes it can have: "
                f"{sorted({o.mode.value for o in all_options[i]})}")
        all_options[i] = kept


def make_plan(measurements: Measurements, budget: int, *, planner_started: float,
              fixed: Mapping[str, ResidencyMode] | None = None,
              host_budget: int | None = None) -> ResidencyPlan:
    """The plan for ``budget`` device bytes and ``host_budget`` host bytes held while awake
    (raises :class:`InfeasibleBudget` naming the budget that does not fit); ``fixed``: the
    components whose mode the user chose (``residency="auto,transformer=..."``), planned
    around."""
    m = measurements
    names = [s.name for s in m.sizes]
    sizes = {s.name: s for s in m.sizes}
    all_options = [options_for(s, [u for u in m.uses if u.name == s.name], m.bandwidth,
                               m.copy_latency, m.overlap) for s in m.sizes]
    _keep_fixed(all_options, m.sizes, fixed or {})
    options = [prune(o) for o in all_options]
    found = search(names, options, m.uses, budget, m.activation_reserve,
                   host_budget=host_budget)
    if not found and host_budget is not None:
        # The layout with the fewest host bytes that fits the device: the same exact search
        # with host bytes as the cost (pruning kept it: a pruned option holds no fewer).
        by_host = [[dataclasses.replace(o, seconds=float(o.host)) for o in opts]
                   for opts in options]
        device_only = search(names, by_host, m.uses, budget, m.activation_reserve, keep=1)
        if device_only:  # the device fits: the host does not
            least = device_only[0]
            layout = ", ".join(f"{n}={options[i][j].label()}"
                               for i, (n, j) in enumerate(zip(names, least.choice, strict=True)))
            raise InfeasibleBudget(host_budget, _host_of(options, least), layout,
                                   budget="host", device_budget_bytes=budget)
    if not found:
        peak, combo = minimum_peak(names, all_options, m.uses, m.activation_reserve)
        layout = ", ".join(f"{n}={all_options[i][j].label()}"
                           for i, (n, j) in enumerate(zip(names, combo, strict=True)))
        raise InfeasibleBudget(budget, peak, layout, m.activation_reserve)
    best = found[0]
    chosen = {n: options[i][j] for i, (n, j) in enumerate(zip(names, best.choice, strict=True))}
    decisions = tuple(ComponentDecision(
        n, sizes[n].resident, chosen[n],
        ("mode fixed by the residency; " if fixed and n in fixed else "")
        + _why(n, chosen[n], options[i], chosen, m.uses, budget, m.activation_reserve))
        for i, n in enumerate(names))
    runners = tuple(RunnerUp(
        tuple((n, options[i][j].label()) for i, (n, j) in enumerate(zip(names, c.choice,
                                                                       strict=True))),
        c.seconds + m.other_seconds, c.peak,
        (c.seconds - best.seconds) / max(best.seconds + m.other_seconds, 1e-12))
        for c in found[1:])
    return ResidencyPlan(
        _config_of(chosen, sizes), budget, best.peak, best.moved,
        best.seconds + m.other_seconds, decisions, runners, m.activation_reserve, m.bandwidth,
        m.source, time.perf_counter() - planner_started, host_budget_bytes=host_budget,
        predicted_host_bytes=_host_of(options, best))


def _host_of(options: Sequence[Sequence[Option]], c: _Candidate) -> int:
    """Host bytes a layout holds while awake."""
    return sum(options[i][j].host for i, j in enumerate(c.choice))
