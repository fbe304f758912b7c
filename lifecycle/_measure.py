"""Measuring a pipeline for the planner (``lifecycle._planner``), and checking a plan.

A plan is made from every component's sizes (its inventory, taken under the controller's
lock), the link's rate and per-copy latency, and which components a request uses, in what
order, how often and for how long: a warm-up request recorded through ``use()`` (with
forward pre-hooks counting each component's root forwards), uses declared by the caller,
or each component once in attach order. Measurements are taken once and reused, so plans for
different budgets are comparable. A plan applied after a warm-up is checked by one request
(:meth:`Measurer.validate`); ``residency="auto"`` plans from sizes alone at attach.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import anyio
from torch import nn

from strategies import ResidencyConfig, ResidencyMode, is_fsdp_managed
from strategies.protocol import TensorStore, to_thread

from . import _events as events
from ._errors import forget_locals
from ._planner import (
    ComponentSizes,
    Measurements,
    ResidencyPlan,
    Use,
    declared_uses,
    make_plan,
    parse_budget,
)
from ._results import ResidencyChange
from ._uses import Recording, Uses

__all__ = ["DeclaredUses", "Measurer", "Request", "fixed_modes", "is_auto"]

_SIZES_ONLY = "sizes (each component once, in attach order)"

#: One representative request through the controller, e.g. ``lambda: pipe.generate(ctl=ctl)``.
Request = Callable[[], Awaitable[object]]
#: A request's uses declared instead of measured: names, or ``(name, seconds[, forwards])``.
DeclaredUses = Sequence[str | tuple[str, float] | tuple[str, float, int]]


def _auto_entries(residency: object) -> list[str] | None:
    """The other entries of an ``"auto[,COMPONENT=MODE...]"`` residency (a string, or a list
    of such strings), None when it is not one."""
    pieces = [residency] if isinstance(residency, str) else \
        list(residency) if isinstance(residency, (list, tuple)) and \
        all(isinstance(p, str) for p in residency) else []
    entries = [e.strip() for p in pieces for e in str(p).split(",") if e.strip()]
    if not any(e.lower() == "auto" for e in entries):
        return None
    return [e for e in entries if e.lower() != "auto"]


def fixed_modes(residency: object) -> ResidencyConfig:
    """What ``"auto,transformer=layerwise-offload"`` fixes: the modes the planner plans the
    rest around (empty for a plain ``"auto"``; validated like any residency)."""
    return ResidencyConfig.parse(_auto_entries(residency) or None)


def is_auto(residency: object, device_budget: object) -> bool:
    """Whether ``residency`` is ``"auto"`` (alone, or with ``COMPONENT=MODE`` entries it keeps:
    ``"auto,transformer=layerwise-offload"``): plan at attach, from sizes alone, under
    ``device_budget`` (which only that takes, and which it needs)."""
    auto = _auto_entries(residency) is not None
    if auto and device_budget is None:
        raise ValueError("residency='auto' needs a device_budget (bytes, '20GiB' or '90%')")
    if device_budget is not None and not auto:
        raise ValueError("device_budget is used with residency='auto' (or pass it to "
                         "plan()); got residency=" + repr(residency))
    return auto


class Measurer:
    """The planner's measurements of one controller's pipeline, and the plans made from
    them. ``uses``: the controller's (the warm-up's uses are recorded there; its layer,
    components, worker threads, rank and id are the controller's); ``lock``: the
    controller's (no move while inventories are taken)."""

    def __init__(self, uses: Uses, lock: anyio.Lock) -> None:
        self._uses = uses
        self._lock = lock
        self._layer = uses.layer
        self._components = uses.components
        self._threads = uses.threads
        self._log = uses.owner.log  # (names the controller's rank and id in events)
        self.measurements: Measurements | None = None
        self.warmup: Request | None = None  # the last warm-up measured (validates its plans)

    async def plan(self, device_budget: int | float | str, warmup: Request | None,
                   uses: DeclaredUses | None, activation_reserve: int | None,
                   remeasure: bool, host_budget: int | None = None) -> ResidencyPlan:
        """See :meth:`LifecycleController.plan` (``activation_reserve``: None keeps the
        measured one)."""
        t0 = time.perf_counter()
        m = await self._measure(warmup, uses, remeasure)
        if activation_reserve is not None:
            m = dataclasses.replace(m, activation_reserve=int(activation_reserve))
        plan, _ = await self._make(m, device_budget, t0, host_budget=host_budget)
        return dataclasses.replace(plan, warmup=warmup)

    async def plan_at_attach(self, found: Mapping[str, nn.Module],
                             device_budget: int | float | str, activation_reserve: int,
                             fixed: ResidencyConfig | None = None,
                             host_budget: int | None = None) -> ResidencyPlan:
        """residency='auto': a plan from sizes alone (each component used once per request,
        in attach order), before anything is placed; ``fixed``: the modes it keeps."""
        t0 = time.perf_counter()
        sizes = tuple(ComponentSizes.of(n, m, TensorStore(n, m, self._layer),
                                        is_fsdp_managed(m)) for n, m in found.items())
        bandwidth, latency = await self._measure_link(sizes)
        m = Measurements(sizes, tuple(Use(n) for n in found), bandwidth, 0.0, activation_reserve,
                         _SIZES_ONLY, latency, self._layer.copies_overlap_compute)
        keep = {} if fixed is None else \
            {n: fixed.mode_for(n) for n in found if fixed.names_mode_of(n)}
        plan, budget = await self._make(m, device_budget, t0, keep, host_budget)
        self._log.info(events.PLAN_APPLIED, config=plan.config.to_string(), budget=budget,
                       predicted_peak=plan.predicted_peak_bytes)
        return plan

    async def _make(self, m: Measurements, device_budget: int | float | str, started: float,
                    fixed: Mapping[str, ResidencyMode] | None = None,
                    host_budget: int | None = None) -> tuple[ResidencyPlan, int]:
        """The plan for ``device_budget`` (resolved against the free device memory) and
        ``host_budget`` (host bytes held while awake), and the device budget in bytes."""
        budget = parse_budget(device_budget, free_bytes=self._free_bytes(),
                              pipeline_bytes=m.pipeline_bytes)
        # The search is pure Python (milliseconds to a fraction of a second): off the loop.
        plan = await to_thread(
            functools.partial(make_plan, m, budget, planner_started=started, fixed=fixed,
                              host_budget=host_budget),
            limiter=self._threads)
        return plan, budget

    def _free_bytes(self) -> int | None:
        """Device bytes a plan may use: free now plus what the library holds (it can move)."""
        free = self._layer.free_bytes()
        return None if free is None else free + self._layer.held_bytes

    async def _measure(self, warmup: Request | None, uses: DeclaredUses | None,
                       remeasure: bool) -> Measurements:
        cached = self.measurements
        source = "warm-up" if warmup is not None else "declared" if uses is not None else None
        if cached is not None and not remeasure and (source is None or source == cached.source) \
                and uses is None:
            return cached
        components = list(self._components.items())
        async with self._lock:  # no move while the inventories are taken (in a worker thread)
            sizes = await to_thread(lambda: tuple(
                ComponentSizes.of(n, c.module, c.strategy.store, c.fsdp) for n, c in components),
                limiter=self._threads)
        bandwidth, latency = await self._measure_link(sizes)
        reserve, other = 0, 0.0
        if warmup is not None:
            trace, other, reserve = await self._record(warmup)
            self.warmup = warmup
        elif uses is not None:
            trace = declared_uses(uses, self._components)
        else:
            trace = tuple(Use(n) for n in self._components)
        m = Measurements(sizes, trace, bandwidth, other, reserve, source or _SIZES_ONLY, latency,
                         self._layer.copies_overlap_compute)
        self.measurements = m
        return m

    async def _measure_link(self, sizes: Sequence[ComponentSizes]) -> tuple[float, float]:
        """The link's rate and per-copy seconds, measured with copies the size of the
        pipeline's typical move (its largest layer, else its largest component; 1 MiB to
        256 MiB): allocators behave differently at different sizes."""
        typical = max((max(s.layers) if s.layers else s.whole for s in sizes), default=2**20)
        nbytes = min(max(typical, 2**20), 256 * 2**20)
        return await to_thread(self._layer.measure_link, nbytes, limiter=self._threads)

    async def _record(self, warmup: Request) -> tuple[tuple[Use, ...], float, int]:
        """Run ``warmup`` once, recording every use; returns the uses, the seconds outside
        any use, and the activation bytes seen on the device (CUDA; 0 on the CPU)."""
        recording = Recording(forwards=dict.fromkeys(self._components, 0))
        counts = recording.forwards
        handles = []
        for name, c in self._components.items():

            def count(module: nn.Module, args: Any, name: str = name) -> None:
                counts[name] += 1
            handles.append(c.module.register_forward_pre_hook(count))
        self._layer.reset_peak()
        t0 = time.perf_counter()
        try:
            with self._uses.recording(recording):
                await warmup()
        finally:
            total = time.perf_counter() - t0
            for h in handles:
                h.remove()
        allocator = self._layer.allocator_peak()
        reserve = 0 if allocator is None else \
            max(0, allocator - self._layer.peak_bytes - self._kept_foreign())
        records = recording.uses
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

    def _kept_foreign(self) -> int:
        """Allocator bytes held after the warm-up that are not the library's: not a
        request's activations, whoever holds them. The first kernel of each fresh host thread
        takes a library workspace that is never given back (cuBLAS: 32 MiB a (thread, stream)
        handle on Hopper, until ``torch._C._cuda_clearCublasWorkspaces()``): a warm-up on
        threads that never ran a kernel takes them inside the measured peak, the next request
        on those threads takes none, and a percent budget, resolved against the free memory
        after the warm-up, has counted them already; so have the bytes the caller held
        before and still holds (its inputs, earlier outputs). Counted as activations they
        would inflate every plan's predicted peak by bytes no request adds (and, on the
        simulated GPU, make a model smaller than one workspace infeasible at any budget).
        A workspace a fresh thread takes after the request's peak is subtracted too: the
        reserve is then low by at most that workspace."""
        allocated = self._layer.memory_allocated()
        return 0 if allocated is None else max(0, allocated - self._layer.held_bytes)

    async def validate(self, plan: ResidencyPlan, change: ResidencyChange,
                       validate: Request | bool | None,
                       restore: Callable[[ResidencyConfig], Awaitable[object]],
                       previous: ResidencyConfig, tolerance: float) -> ResidencyChange:
        """Run one request under the applied plan (``validate``: that request; else the
        plan's warm-up, else the last one measured; ``False`` or none of them: ``change`` as
        it is); ``restore(previous)`` if its peak passed the budget or it ran more than
        ``tolerance`` slower than predicted, and when it raised (a cancellation is raised on
        after that)."""
        request = validate if callable(validate) else plan.warmup or self.warmup
        if validate is False or request is None:
            return change
        self._layer.reset_peak()
        t0 = time.perf_counter()
        try:
            await request()
        except BaseException as exc:
            # A request that fails (out of memory, a failed move) or is cancelled says the
            # plan is not good to serve: undo it (to its end, even when cancelled), as SGLang
            # does when its validation request fails. Its frames held the request's tensors.
            forget_locals(exc)
            with anyio.CancelScope(shield=True):
                await restore(previous)
            reason = f"the validation request raised {type(exc).__name__}: {exc}"
            self._log.warning(events.PLAN_ROLLED_BACK, reason=reason)
            if not isinstance(exc, Exception):
                raise
            return dataclasses.replace(change, success=False, rolled_back=True,
                                       message=f"plan undone, previous residency restored: "
                                               f"{reason}")
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
        await restore(previous)
        self._log.warning(events.PLAN_ROLLED_BACK, reason="; ".join(why))
        return dataclasses.replace(
            result, success=False, rolled_back=True,
            message="plan undone, previous residency restored: " + "; ".join(why))
