"""What the benchmarks of ``residency bench`` share: the options every benchmark takes and
those of the benchmarks on the demo pipeline, their setup (glibc's malloc policy, logging, the
device), timing on a device, and the reference approach's sleep and wake (``module.to``) and
the flat-copy limit that several of them compare against."""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from lifecycle import configure_logging
from lifecycle.demo import DemoPipeline
from lifecycle.demo._checkpoint import unique_tensors

__all__ = ["DTYPES", "base_options", "bench_flat", "bench_setup", "pipe_tensors",
           "pipeline_options", "reference_sleep", "reference_wake", "set_malloc", "sync",
           "timed"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# glibc mallopt(M_MMAP_THRESHOLD, M_TRIM_THRESHOLD) per --malloc policy (see set_malloc)
MALLOC = {"keep": (32 * 2**20, 2**31 - 1), "release": (64 * 2**10, 128 * 2**10)}


def set_malloc(policy: str) -> None:
    """Pin glibc's otherwise adaptive policy, which makes CPU numbers bimodal from run to run.

    ``keep``: freed tensors (up to 32 MiB each) stay in the heap and are reused without page
    faults, like CUDA's caching allocator. ``release``: every freed tensor goes back to the
    OS (munmap) and every new one page-faults, like a real release of memory."""
    if policy == "default":
        return
    mmap_threshold, trim_threshold = MALLOC[policy]
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(-3, mmap_threshold) and libc.mallopt(-1, trim_threshold)
    except (OSError, AttributeError):
        ok = False
    if not ok:
        print(f"warning: no glibc mallopt here; --malloc {policy} ignored", file=sys.stderr)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def pipe_tensors(pipe: DemoPipeline) -> list[torch.Tensor]:
    """Every parameter and buffer of ``pipe``, each storage's bytes once."""
    return list(unique_tensors((f"{c}.{i}", t) for c, module in pipe.modules.items()
                               for i, t in enumerate([*module.parameters(),
                                                      *module.buffers()])).values())


def repoint_copies(pipe: DemoPipeline) -> None:
    """What ``.to(other_device)`` does, on one device: fresh memory, copy, re-point."""
    with torch.no_grad():
        for t in pipe_tensors(pipe):
            fresh = torch.empty_like(t)
            fresh.copy_(t)
            t.data = fresh


def reference_sleep(pipe: DemoPipeline, device: torch.device) -> None:
    """The reference's sleep: ``module.to("cpu")`` into fresh host memory (on a CPU device,
    where ``.to`` is a no-op, what it would do: :func:`repoint_copies`)."""
    if device.type != "cuda":
        repoint_copies(pipe)
        return
    for module in pipe.modules.values():
        module.to(torch.device("cpu"))
    torch.cuda.empty_cache()


def reference_wake(pipe: DemoPipeline, device: torch.device) -> None:
    """The reference's wake: ``module.to(device)`` (CPU: :func:`repoint_copies`)."""
    if device.type != "cuda":
        repoint_copies(pipe)
        return
    for module in pipe.modules.values():
        module.to(device)


def bench_flat(n: int, device: torch.device, repeats: int) -> dict[str, float]:
    def median_of(fn: Callable[[], Any]) -> float:
        return statistics.median([timed(fn, device) for _ in range(repeats + 1)][1:])

    if device.type != "cuda":
        src = torch.ones(n, dtype=torch.uint8)
        warm = torch.empty(n, dtype=torch.uint8)
        # fresh: page faults included, as a fresh allocation pays them; warm: a destination
        # already faulted in, the memory-bandwidth limit.
        return {"flat_copy": median_of(lambda: torch.empty(n, dtype=torch.uint8).copy_(src)),
                "flat_copy_warm": median_of(lambda: warm.copy_(src))}
    pinned = torch.ones(n, dtype=torch.uint8, pin_memory=True)
    pageable = torch.ones(n, dtype=torch.uint8)
    on_device = torch.ones(n, dtype=torch.uint8, device=device)

    def h2d(src: torch.Tensor) -> Callable[[], Any]:
        return lambda: torch.empty(n, dtype=torch.uint8, device=device).copy_(
            src, non_blocking=src.is_pinned())

    return {"flat_h2d_pinned": median_of(h2d(pinned)),
            "flat_d2h_pinned": median_of(lambda: pinned.copy_(on_device, non_blocking=True)),
            "flat_h2d_pageable": median_of(h2d(pageable)),
            "flat_d2h_pageable": median_of(
                lambda: torch.empty(n, dtype=torch.uint8).copy_(on_device))}


def base_options(*, device: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark takes (a parent parser): device (``device=False``: for a
    benchmark of the host alone), repeats, json."""
    ap = argparse.ArgumentParser(add_help=False)
    if device:
        ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda when available")
    ap.add_argument("--repeats", type=int, default=5, help="median of this many runs")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    return ap


def pipeline_options() -> argparse.ArgumentParser:
    """The options of the benchmarks on the demo pipeline (a parent parser)."""
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--size", default="1GiB", help="pipeline weight bytes, e.g. 256MB, 1GiB")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--malloc", choices=["keep", "release", "default"], default="keep",
                    help="glibc malloc policy (CPU host memory); see lifecycle.cli._benchkit.set_malloc")
    return ap


def bench_setup(args: argparse.Namespace) -> torch.device:
    """Apply the common options; returns the device to measure on."""
    set_malloc(args.malloc)
    configure_logging(json=True, level="warning")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return device
