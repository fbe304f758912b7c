"""Host mirrors as anonymous mappings: shared (what the CUDA layer used) against private with
transparent huge pages asked for (what it uses now), for the host side of a sleep: the first
write into fresh pages (page faults) and a rewrite of faulted pages, in GB/s.

    residency bench mirrors [--size 256MiB] [--repeats 5] [--json]

Median over ``--repeats`` mappings of ``--size`` bytes each. Registration with the driver
(``cudaHostRegister``) is not timed here: it needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from lifecycle._units import gbps, parse_size

__all__ = ["add_arguments", "run"]

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``residency bench mirrors`` besides the common ones."""
    parser.add_argument("--size", default="256MiB", help="bytes of each mapping")


def mapping(nbytes: int, private: bool) -> mmap.mmap:
    if not private:
        return mmap.mmap(-1, nbytes)
    arena = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        arena.madvise(mmap.MADV_HUGEPAGE)
    return arena


def once(nbytes: int, private: bool, source: torch.Tensor) -> tuple[float, float]:
    arena = mapping(nbytes, private)
    view = torch.frombuffer(arena, dtype=torch.uint8)
    t0 = time.perf_counter()
    view.copy_(source)  # fresh pages: faults
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    view.copy_(source)  # faulted pages
    again = time.perf_counter() - t0
    del view
    arena.close()
    return gbps(nbytes, first), gbps(nbytes, again)


def run(args: argparse.Namespace) -> int:
    """``residency bench mirrors``: see the module docstring."""
    if args.repeats < 1:
        print("residency bench mirrors: --repeats must be at least 1", file=sys.stderr)
        return 2
    nbytes = parse_size(args.size)
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    out: dict[str, Any] = {"bytes": nbytes,
                           "thp": THP.read_text().strip() if THP.exists() else None}
    for name, private in (("shared", False), ("private_hugepage", True)):
        runs = [once(nbytes, private, source) for _ in range(args.repeats)]
        out[name] = {"first_write_gbps": statistics.median(r[0] for r in runs),
                     "rewrite_gbps": statistics.median(r[1] for r in runs)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{args.size}, transparent huge pages: {out['thp']}")
        for name in ("shared", "private_hugepage"):
            r = out[name]
            print(f"{name:18} first write {r['first_write_gbps']:6.2f} GB/s   "
                  f"rewrite {r['rewrite_gbps']:6.2f} GB/s")
    return 0
