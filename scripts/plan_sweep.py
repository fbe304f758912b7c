"""The planner on the demo pipeline at several budgets: chosen layout, predicted vs measured
peak and latency, the planner's own time.

    python scripts/plan_sweep.py [--size 256MB] [--device cpu] [--repeats 5] [--json]

Budgets: 100/75/50/25/10% of the pipeline's size, and the smallest feasible one (a budget
below it is reported as infeasible). Each plan is measured once from a warm-up request,
applied with ``set_residency`` (validated: its measured peak must fit), then ``--repeats``
requests are timed (median) with the library's peak tracking reset before them. Exit 1 when
a measured peak passes its budget or an output differs from the resident one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import anyio
import torch

from lifecycle import InfeasibleBudget, LifecycleController
from lifecycle._units import parse_size
from lifecycle.demo import DemoPipeline


async def sweep(size: int, device: str | None, repeats: int) -> list[dict[str, Any]]:
    pipe = DemoPipeline.build(size)
    expected = pipe.forward_sync(steps=3)
    rows: list[dict[str, Any]] = []
    async with LifecycleController(device, residency="all=component-offload") as ctl:
        await ctl.attach(pipe)

        async def warmup() -> torch.Tensor:
            return await pipe.generate(ctl=ctl)

        total = sum(c.total_bytes for c in ctl.report().components.values())
        try:
            await ctl.plan(0, warmup)
        except InfeasibleBudget as exc:
            smallest = exc.minimum_bytes
        shares = [(f"{p}%", total * p // 100) for p in (100, 75, 50, 25, 10)]
        for label, budget in [*shares, ("smallest", smallest)]:
            t0 = time.perf_counter()
            try:
                plan = await ctl.plan(budget, warmup)
            except InfeasibleBudget as exc:
                rows.append({"budget": label, "budget_bytes": budget, "feasible": False,
                             "minimum_bytes": exc.minimum_bytes})
                continue
            planned = time.perf_counter() - t0
            change = await ctl.set_residency(plan, latency_tolerance=float("inf"))
            seconds, peaks, exact = [], [], True
            for _ in range(repeats):
                ctl.reset_peak()
                r0 = time.perf_counter()
                out = await pipe.generate(ctl=ctl)
                seconds.append(time.perf_counter() - r0)
                peaks.append(ctl.report().peak_device_bytes)
                exact = exact and torch.equal(out.cpu(), expected.cpu())
            rows.append({
                "budget": label, "budget_bytes": budget, "feasible": True,
                "layout": plan.config.to_string(),
                "tuning": {"prefetch": dict(plan.config.prefetch),
                           "resident_layers": dict(plan.config.resident_layers)},
                "predicted_peak_bytes": plan.predicted_peak_bytes,
                "measured_peak_bytes": max(peaks),
                "predicted_ms": plan.predicted_seconds * 1e3,
                "measured_ms": statistics.median(seconds) * 1e3,
                "moved_bytes_per_request": plan.moved_bytes_per_request,
                "planner_ms": planned * 1e3, "change_ms": change.seconds * 1e3,
                "fits": max(peaks) <= budget and change.success, "exact": exact})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="256MB")
    ap.add_argument("--device", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = anyio.run(sweep, parse_size(args.size), args.device, args.repeats)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        mib = 2**20
        print(f"{'budget':>9} {'MiB':>8} {'pred MiB':>9} {'meas MiB':>9} {'pred ms':>8} "
              f"{'meas ms':>8} {'plan ms':>8}  layout")
        for r in rows:
            if not r["feasible"]:
                print(f"{r['budget']:>9} {r['budget_bytes'] / mib:8.2f}  infeasible (smallest "
                      f"{r['minimum_bytes'] / mib:.2f} MiB)")
                continue
            tuning = "".join(f" {k}={v}" for k, v in r["tuning"].items() if v)
            print(f"{r['budget']:>9} {r['budget_bytes'] / mib:8.2f} "
                  f"{r['predicted_peak_bytes'] / mib:9.2f} {r['measured_peak_bytes'] / mib:9.2f} "
                  f"{r['predicted_ms']:8.2f} {r['measured_ms']:8.2f} {r['planner_ms']:8.1f}  "
                  f"{r['layout']}{tuning}{'' if r['fits'] and r['exact'] else '  FAIL'}")
    ok = all(r["fits"] and r["exact"] for r in rows if r["feasible"])
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
