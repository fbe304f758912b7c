"""One colocated RL cycle, with releases that keep a host copy and with discarding ones.

    residency bench discard [--size 1GiB] [--dtype float32|bfloat16] [--device cpu|cuda]
        [--repeats 5] [--malloc keep|release|default] [--json]

Builds a :class:`~lifecycle.demo.DemoPipeline` of ``--size`` bytes and runs, for each mode,
``--repeats`` cycles after one warm-up, median per step:

* release (``release_memory_occupation``: plain, or ``discard=["transformer"]``), after
  which the host and pinned bytes the pipeline holds are read from the report;
* resume (``resume_memory_occupation``);
* the full update of the transformer from host tensors (the trainer's new weights:
  alternately two states, precomputed outside the timed region);
* one generation.

Each cycle's image must equal the other mode's for the same weights, and the discarding mode
must refuse to generate between its resume and its update (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import anyio
import torch

from lifecycle import LifecycleController, WeightsDiscarded
from lifecycle._units import format_bytes, parse_size
from lifecycle.demo import DemoPipeline

from ._benchkit import DTYPES, bench_setup

__all__ = ["run"]

STEPS = ("release", "resume", "update", "generate")
MODES = {"keep": None, "discard": ["transformer"]}


async def cycles(args: argparse.Namespace, device: torch.device, mode: str,
                 states: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    pipe = DemoPipeline.build(parse_size(args.size), dtype=DTYPES[args.dtype])
    ctl = LifecycleController(device)
    await ctl.attach(pipe)
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    held: dict[str, int] = {}
    images: list[torch.Tensor] = []
    refused = True
    try:
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            released = await ctl.release_memory_occupation(discard=MODES[mode] or False)
            t1 = time.perf_counter()
            report = ctl.report()
            held = {"host_bytes": report.host_bytes, "pinned_bytes": report.pinned_bytes}
            await ctl.resume_memory_occupation()
            t2 = time.perf_counter()
            if mode == "discard":
                try:
                    await pipe.generate(ctl=ctl, steps=1)
                    refused = False
                except WeightsDiscarded:
                    pass
            t2b = time.perf_counter()
            result = await ctl.update_weights_from_tensors(states[i % 2], "transformer")
            t3 = time.perf_counter()
            images.append(await pipe.generate(ctl=ctl, steps=2))
            t4 = time.perf_counter()
            if not (released.success and result.success):
                raise RuntimeError(f"{released.message}; {result.message}")
            if i:  # the first cycle warms up
                for step, seconds in zip(STEPS, (t1 - t0, t2 - t1, t3 - t2b, t4 - t3),
                                         strict=True):
                    times[step].append(seconds)
    finally:
        await ctl.aclose()
    return {"seconds": {s: statistics.median(v) for s, v in times.items()},
            "cycle_seconds": sum(statistics.median(v) for v in times.values()),
            "held_after_release": held, "images": images, "refused_while_stale": refused,
            "pipeline_bytes": pipe.nbytes}


def run(args: argparse.Namespace) -> int:
    """``residency bench discard``: see the module docstring."""
    if args.repeats < 1:
        print("residency bench discard: --repeats must be at least 1", file=sys.stderr)
        return 2
    device = bench_setup(args)
    base = DemoPipeline.build(parse_size(args.size), dtype=DTYPES[args.dtype])
    state = base.modules["transformer"].state_dict()
    states = [{k: (v + delta if v.is_floating_point() else v).contiguous() for k, v in state.items()}
              for delta in (1e-3, -1e-3)]
    del base, state
    out = {mode: anyio.run(cycles, args, device, mode, states) for mode in MODES}
    correct = all(torch.equal(a, b) for a, b in zip(out["keep"]["images"],
                                                    out["discard"]["images"], strict=True)) \
        and out["discard"]["refused_while_stale"]
    speedup = out["keep"]["cycle_seconds"] / out["discard"]["cycle_seconds"]
    n = out["keep"]["pipeline_bytes"]
    if args.json:
        print(json.dumps({
            "config": {"size": args.size, "nbytes": n, "dtype": args.dtype, "device": str(device),
                       "repeats": args.repeats, "malloc": args.malloc},
            "modes": {m: {k: v for k, v in r.items() if k != "images"} for m, r in out.items()},
            "cycle_speedup": speedup, "correct": correct}, indent=2))
    else:
        print(f"RL cycle on a {format_bytes(n)} pipeline ({args.dtype}) on {device}: release, "
              f"resume, full transformer update, generate; median of {args.repeats}")
        print(f"{'mode':<9}" + "".join(f"{s:>11}" for s in STEPS) +
              f"{'cycle':>10}{'host after':>16}{'pinned':>15}")
        for mode, r in out.items():
            held = r["held_after_release"]
            print(f"{mode:<9}" + "".join(f"{r['seconds'][s]:>11.4f}" for s in STEPS) +
                  f"{r['cycle_seconds']:>10.4f}{held['host_bytes']:>16,}{held['pinned_bytes']:>15,}")
        print(f"discarding cycle: {speedup:.2f}x the keeping one")
        print(f"{'PASS' if correct else 'FAIL'}  images equal in both modes for the same weights; "
              f"generation refused while stale: {out['discard']['refused_while_stale']}")
    return 0 if correct else 1
