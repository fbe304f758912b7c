"""Partial release: the transformer alone against the whole pipeline.

    residency bench partial [--size 1GiB] [--dtype float32|bfloat16] [--device cpu|cuda]
        [--repeats 5] [--malloc keep|release|default] [--json]

Builds a :class:`~lifecycle.demo.DemoPipeline` of ``--size`` bytes and, for each scope (the
whole pipeline; ``components=["transformer"]``, what verl-omni's level-1 sleep keeps the
text encoder and VAE awake for), runs ``--repeats`` release/resume cycles after one warm-up,
the released weights changed before each release (as a trainer's update changes them: every
byte is copied), median per step: seconds and bytes moved and released. The weights after the
last resume must be those before it, and the image the same (exit 1 otherwise).
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

from lifecycle import LifecycleController
from lifecycle._units import format_bytes, parse_size
from lifecycle.demo import DemoPipeline

from ._benchkit import DTYPES, bench_setup

__all__ = ["run"]

SCOPES: dict[str, list[str] | None] = {"whole": None, "transformer": ["transformer"]}


async def cycles(args: argparse.Namespace, device: torch.device, scope: str) -> dict[str, Any]:
    pipe = DemoPipeline.build(parse_size(args.size), dtype=DTYPES[args.dtype])
    ctl = LifecycleController(device)
    await ctl.attach(pipe)
    expected = await pipe.generate(ctl=ctl, steps=2)
    names = SCOPES[scope] or list(pipe.modules)
    times: dict[str, list[float]] = {"release": [], "resume": []}
    moved: dict[str, int] = {}
    try:
        for i in range(args.repeats + 1):
            with torch.no_grad():  # a trainer's update changed them: every byte is dirty
                for name in names:
                    for p in pipe.modules[name].parameters():
                        p.add_(0)
            sums = ctl.weights_checksum()
            t0 = time.perf_counter()
            released = await ctl.release_memory_occupation(components=SCOPES[scope])
            t1 = time.perf_counter()
            resumed = await ctl.resume_memory_occupation(components=SCOPES[scope])
            t2 = time.perf_counter()
            if not (released.success and resumed.success) or ctl.weights_checksum() != sums:
                raise RuntimeError(f"{released.message}; {resumed.message}")
            moved = {"release_copied": released.bytes_moved,
                     "release_freed": released.bytes_released,
                     "resume_copied": resumed.bytes_moved}
            if i:  # the first cycle warms up (allocates the host mirrors)
                times["release"].append(t1 - t0)
                times["resume"].append(t2 - t1)
        same = torch.equal(await pipe.generate(ctl=ctl, steps=2), expected)
    finally:
        await ctl.aclose()
    return {"seconds": {s: statistics.median(v) for s, v in times.items()}, "bytes": moved,
            "components": names, "image_equal": same, "pipeline_bytes": pipe.nbytes}


def run(args: argparse.Namespace) -> int:
    """``residency bench partial``: see the module docstring."""
    if args.repeats < 1:
        print("residency bench partial: --repeats must be at least 1", file=sys.stderr)
        return 2
    device = bench_setup(args)
    out = {scope: anyio.run(cycles, args, device, scope) for scope in SCOPES}
    correct = all(r["image_equal"] for r in out.values())
    n = out["whole"]["pipeline_bytes"]
    if args.json:
        print(json.dumps({
            "config": {"size": args.size, "nbytes": n, "dtype": args.dtype, "device": str(device),
                       "repeats": args.repeats, "malloc": args.malloc},
            "scopes": out, "correct": correct}, indent=2))
    else:
        print(f"release/resume on a {format_bytes(n)} pipeline ({args.dtype}) on {device}, "
              f"released weights changed before each release; median of {args.repeats}")
        print(f"{'scope':<12}{'release s':>11}{'resume s':>11}{'copied out':>16}{'freed':>16}"
              f"{'copied in':>16}")
        for scope, r in out.items():
            b = r["bytes"]
            print(f"{scope:<12}{r['seconds']['release']:>11.4f}{r['seconds']['resume']:>11.4f}"
                  f"{b['release_copied']:>16,}{b['release_freed']:>16,}{b['resume_copied']:>16,}")
        print(f"{'PASS' if correct else 'FAIL'}  weights and image unchanged by every cycle")
    return 0 if correct else 1
