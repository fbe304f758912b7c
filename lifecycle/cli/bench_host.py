"""Host memory: what a sleep holds, file-backed wakes, and ``residency serve`` under a budget.

    residency bench host [--size 1GiB] [--dtype float32|bfloat16] [--device cpu|cuda]
        [--repeats 3] [--malloc keep|release|default] [--no-serve] [--json]

Builds a :class:`~lifecycle.demo.DemoPipeline` of ``--size`` bytes, saves it as safetensors
(flushed to disk) and measures:

* host bytes held while asleep (every host byte the device layer holds, by kind) after
  today's sleep (host mirrors of everything) and after the RL cycle's: the text encoder and
  the VAE file-backed (``attach(checkpoint=...)``) and the transformer discarded;
* wake seconds (median of ``--repeats``) from host mirrors against file-backed wakes with
  the page cache warm (read just before) and cold (``posix_fadvise(DONTNEED)`` on every file
  before each wake; dirty pages are not dropped, so the files are flushed first);
* unless ``--no-serve``: the peak RSS (``VmHWM``) of ``residency serve`` with a host budget
  of half the pipeline, the checkpoint and ``--discard-on-release transformer``, over a
  generation, a refused update of the transformer (507: its rollback backups would pass the
  budget), a release (the transformer discarded, the rest file-backed), a resume, the
  transformer's update from disk (stale: no backups; it makes it file-backed again), a
  generation, a plain release (everything file-backed) and a resume.

Exit 1 when a wake is not bit-exact, the RL cycle holds more than 1% of the pipeline while
asleep, or the server misbehaves.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from lifecycle import LifecycleController
from lifecycle._units import format_bytes, parse_size
from lifecycle.demo import DemoPipeline
from lifecycle.demo._checkpoint import write_checkpoint
from strategies.protocol import to_thread

from ._benchkit import DTYPES, bench_setup

__all__ = ["run"]


def _drop_cache(root: Path) -> None:
    """Evict the checkpoint's pages from the page cache (clean pages only: flushed first)."""
    for path in sorted(root.rglob("*.safetensors")):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _warm_cache(root: Path) -> None:
    for path in sorted(root.rglob("*.safetensors")):
        with open(path, "rb") as f:
            while f.read(64 * 2**20):
                pass


def _held(ctl: LifecycleController) -> dict[str, int]:
    r = ctl.report()
    return {"host_held_bytes": r.host_held_bytes, "pinned_bytes": r.host_held_pinned,
            "pageable_bytes": r.host_held_pageable, "file_backed_bytes": r.file_backed_bytes}


async def _asleep(args: argparse.Namespace, device: torch.device, root: Path | None,
                  discard: list[str]) -> dict[str, Any]:
    pipe = DemoPipeline.build(parse_size(args.size), dtype=DTYPES[args.dtype])
    async with LifecycleController(device) as ctl:
        await ctl.attach(pipe, checkpoint=root)
        await ctl.sleep(discard=discard)
        held = _held(ctl)
        await ctl.wake()
        if discard:  # the trainer's weights (here: the same) make them whole again
            await ctl.update_weights_from_disk(root or "", discard)
    return {**held, "share": held["host_held_bytes"] / pipe.nbytes}


async def _wakes(args: argparse.Namespace, device: torch.device, root: Path,
                 cache: str | None) -> tuple[float, bool]:
    """Median wake seconds from mirrors (``cache`` None) or from files (warm / cold), and
    whether every wake gave back the same image."""
    pipe = DemoPipeline.build(parse_size(args.size), dtype=DTYPES[args.dtype])
    seconds: list[float] = []
    exact = True
    async with LifecycleController(device) as ctl:
        await ctl.attach(pipe, checkpoint=None if cache is None else root)
        expected = (await pipe.generate(ctl=ctl, steps=1)).cpu()
        for _ in range(args.repeats):
            await ctl.sleep()
            if cache == "cold":
                _drop_cache(root)
            elif cache == "warm":
                _warm_cache(root)
            t0 = time.perf_counter()
            await ctl.wake()
            seconds.append(time.perf_counter() - t0)
            exact &= torch.equal((await pipe.generate(ctl=ctl, steps=1)).cpu(), expected)
    return statistics.median(seconds), exact


def _serve_peak(args: argparse.Namespace, root: Path, nbytes: int) -> dict[str, Any]:
    """``residency serve`` with half the pipeline as host budget: its VmHWM after a cycle."""
    import httpx

    budget = nbytes // 2
    cmd = [sys.executable, "-m", "lifecycle", "serve", "--port", "0", "--size", args.size,
           "--host-budget", str(budget), "--checkpoint", str(root),
           "--discard-on-release", "transformer", "--drain-timeout", "30"]
    if args.device:
        cmd += ["--device", args.device]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        if found is None:
            return {"error": f"serve did not start: {line!r}"}
        with httpx.Client(base_url=f"http://127.0.0.1:{found.group(1)}", timeout=600) as c:
            post = c.post
            update = {"model_path": str(root), "target_modules": ["transformer"]}
            steps = {"generate": post("/generate", json={"seed": 1}).status_code,
                     "update, backups past the budget": post(
                         "/update_weights_from_disk", json=update).status_code,
                     "release": post("/release_memory_occupation", json={}).status_code}
            held = c.get("/state").json()["host"]
            steps["resume"] = post("/resume_memory_occupation", json={}).status_code
            steps["update, stale"] = post("/update_weights_from_disk",
                                          json=update).status_code
            steps["generate again"] = post("/generate", json={"seed": 1}).status_code
            steps["plain release, file-backed"] = post(
                "/release_memory_occupation", json={"discard": False}).status_code
            steps["resume again"] = post("/resume_memory_occupation", json={}).status_code
        status = Path(f"/proc/{proc.pid}/status").read_text()
        peak = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024  # type: ignore[union-attr]
        return {"host_budget": budget, "peak_rss_bytes": peak, "steps": steps,
                "host_held_asleep": held["held_pinned_bytes"] + held["held_pageable_bytes"]}
    finally:
        proc.terminate()
        proc.wait(60)


async def measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="residency-bench-host-") as tmp:
        pipe = DemoPipeline.build(parse_size(args.size), dtype=DTYPES[args.dtype])
        root = write_checkpoint({n: m.state_dict() for n, m in pipe.modules.items()},
                                Path(tmp), sync=True)
        nbytes = pipe.nbytes
        del pipe
        out: dict[str, Any] = {"pipeline_bytes": nbytes, "device": str(device)}
        out["asleep"] = {"today": await _asleep(args, device, None, []),
                         "rl_cycle": await _asleep(args, device, root, ["transformer"])}
        wakes = {}
        for name, cache in (("mirrors", None), ("files_warm", "warm"), ("files_cold", "cold")):
            wakes[name] = await _wakes(args, device, root, cache)
        out["wake_seconds"] = {n: s for n, (s, _) in wakes.items()}
        out["exact"] = all(ok for _, ok in wakes.values())
        if not args.no_serve:
            out["serve"] = await to_thread(_serve_peak, args, root, nbytes)
        return out


def _verdict(out: dict[str, Any]) -> list[str]:
    problems = []
    if not out["exact"]:
        problems.append("a wake did not give back the same image")
    if out["asleep"]["rl_cycle"]["share"] > 0.01:
        problems.append("the RL cycle holds more than 1% of the pipeline while asleep")
    serve = out.get("serve")
    if serve is not None and serve.get("steps") != {
            "generate": 200, "update, backups past the budget": 507, "release": 200,
            "resume": 200, "update, stale": 200, "generate again": 200,
            "plain release, file-backed": 200, "resume again": 200}:
        problems.append(f"serve: {serve}")
    return problems


def run(args: argparse.Namespace) -> int:
    """``residency bench host``: see the module docstring."""
    device = bench_setup(args)
    out = anyio.run(measure, args, device)
    problems = _verdict(out)
    out["problems"] = problems
    if args.json:
        print(json.dumps(out, indent=2))
        return 1 if problems else 0
    n = out["pipeline_bytes"]
    print(f"host memory, demo pipeline {format_bytes(n)} on {out['device']}")
    for name, held in out["asleep"].items():
        print(f"  asleep, {name:<9} host held {format_bytes(held['host_held_bytes']):>11} "
              f"({held['share'] * 100:.3f}% of the pipeline; pinned "
              f"{format_bytes(held['pinned_bytes'])}, file-backed "
              f"{format_bytes(held['file_backed_bytes'])})")
    for name, s in out["wake_seconds"].items():
        print(f"  wake from {name:<11} {s * 1e3:9.1f} ms  {n / s / 1e9:6.2f} GB/s")
    serve = out.get("serve")
    if serve is not None and "peak_rss_bytes" in serve:
        print(f"  serve under a host budget of {format_bytes(serve['host_budget'])}: peak RSS "
              f"{format_bytes(serve['peak_rss_bytes'])} ({serve['peak_rss_bytes'] / n:.2f}x "
              f"the pipeline), host held asleep {format_bytes(serve['host_held_asleep'])}, "
              f"steps {serve['steps']}")
    for p in problems:
        print(f"  FAIL: {p}")
    return 1 if problems else 0
