"""``residency plan``: the residency the planner chooses under a device budget, and why.

    residency plan --budget 300MB [--host-budget 200MB] [--size 1GiB]
        [--pipeline demo|MODULE:FACTORY] [--device cpu|cuda|cuda:N] [--no-warmup] [--json]

The pipeline is attached with every component offloaded (so it fits any device), one
warm-up request measures it (the demo's generate, or the factory's generate callable), and
the plan is printed: a table per component, the prediction and the runners-up. Nothing is
applied. ``--host-budget``: the host bytes the layout may hold while awake (the mirrors of
what it offloads). Exit codes: 0 a plan, 1 no layout fits the budgets (the one that does not
fit and the smallest that would are printed), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio

from lifecycle import InfeasibleBudget, LifecycleController, ResidencyPlan

__all__ = ["add_arguments", "run"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of ``residency plan``."""
    ap.add_argument("--budget", required=True,
                    help="device bytes for weights: '300MB', '20GiB', a byte count, or '90%%' "
                         "of free device memory (on the CPU: of the pipeline size)")
    ap.add_argument("--host-budget",
                    help="host bytes the layout may hold while awake ('200MB', '80%%' or "
                         "'auto' of what the cgroup and the machine leave)")
    ap.add_argument("--pipeline", default="demo", help="'demo' or MODULE:FACTORY")
    ap.add_argument("--size", default="64MB", help="demo pipeline weight size")
    ap.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    ap.add_argument("--activation-reserve", type=int, default=None,
                    help="bytes kept free for activations (default: measured on CUDA, 0 on CPU)")
    ap.add_argument("--no-warmup", action="store_true",
                    help="plan from sizes alone (each component once per request)")
    ap.add_argument("--json", action="store_true", help="print the plan as JSON")


async def make(args: argparse.Namespace) -> ResidencyPlan:
    """Attach the pipeline offloaded, measure one request, plan under ``--budget``."""
    from .serve import load_pipeline

    pipe, generate, _ = load_pipeline(args.pipeline, args.size)
    async with LifecycleController(args.device, residency="all=component-offload") as ctl:
        await ctl.attach(pipe)
        warmup = None
        if generate is not None and not args.no_warmup:
            async def warmup() -> Any:
                return await generate(ctl, {})
        return await ctl.plan(args.budget, warmup,
                              activation_reserve=args.activation_reserve,
                              host_budget=args.host_budget)


def run(args: argparse.Namespace) -> int:
    try:
        plan = anyio.run(make, args)
    except InfeasibleBudget as exc:
        print(f"residency plan: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, KeyError, ImportError, AttributeError) as exc:
        print(f"residency plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan.explain())
    return 0
