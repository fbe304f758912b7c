"""A/B of the store's chunked copies: one chunk in flight (each chunk waited for before the next
is handed over, as before) against two (``strategies._store.IN_FLIGHT``), alternated in one
process on the same pipeline, so that both see the same machine load.

    residency bench chunks [--size 1GiB] [--dtype float32|bfloat16] [--device cpu|cuda]
        [--repeats 3] [--malloc keep|release|default] [--json]

Per round and variant: a dirty sleep (every parameter bumped in place first) and a wake of the
whole pipeline, timed from an idle device to an idle device; medians in GB/s, and their ratio.
On the CPU the copies are memcpy in a worker thread (what two in flight saves there is the
host's turn-around between chunks); on a GPU it is the link idling while the host learns of a
landing and queues the next chunk. A pipeline whose largest component is under one chunk
(256 MiB) copies it in one chunk either way.

This benchmark swaps the store's own copy loop, so it reaches into two private modules of
``strategies`` (the one exception to the import rule, see ``tests/test_public_api.py``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel
import torch

import strategies._store as store_module
from lifecycle import LifecycleController
from lifecycle._units import gbps, parse_size
from lifecycle.demo import DemoPipeline
from strategies._chunks import chunked

from ._benchkit import DTYPES, bench_setup, sync

__all__ = ["run"]


async def one_in_flight(self: store_module.TensorStore, pairs: Sequence[Any], to: Any,
                        progress: store_module.Progress | None = None) -> None:
    """The copy loop before two chunks in flight: each chunk waited for, then the next."""
    for i, chunk in enumerate(chunked(pairs, lambda pair: int(pair[0].nbytes), store_module.CHUNK)):
        if i:
            await anyio.lowlevel.checkpoint_if_cancelled()
        await self.layer.copy(chunk, to)
        if progress:
            progress(sum(int(dst.nbytes) for dst, _ in chunk))


async def measure(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    pipe = DemoPipeline.build(parse_size(args.size), dtype=DTYPES[args.dtype])
    two = store_module.TensorStore.copy_pairs
    variants = {"one in flight": one_in_flight, "two in flight": two}
    times: dict[str, dict[str, list[float]]] = {v: {"sleep": [], "wake": []} for v in variants}
    try:
        async with LifecycleController(device) as ctl:
            await ctl.attach(pipe)
            await ctl.sleep()  # mirrors made
            await ctl.wake()
            nbytes = ctl.report().device_bytes
            for r in range(args.repeats + 1):  # round 0 is a warm-up
                for name, fn in (variants.items() if r % 2 else reversed(variants.items())):
                    store_module.TensorStore.copy_pairs = fn  # type: ignore[method-assign]
                    with torch.no_grad():
                        for m in pipe.modules.values():
                            for p in m.parameters():
                                p.add_(0)
                    for what, op in (("sleep", ctl.sleep), ("wake", ctl.wake)):
                        sync(device)
                        t0 = time.perf_counter()
                        result = await op()
                        sync(device)
                        if not result.success:
                            raise RuntimeError(f"{what}: {result.message}")
                        if r:
                            times[name][what].append(time.perf_counter() - t0)
    finally:
        store_module.TensorStore.copy_pairs = two  # type: ignore[method-assign]
    rates = {n: {w: gbps(nbytes, statistics.median(t)) for w, t in v.items()}
             for n, v in times.items()}
    a, b = rates["one in flight"], rates["two in flight"]
    return {"bytes": nbytes, "device": str(device), "chunk_bytes": store_module.CHUNK,
            "rounds": args.repeats, "gbps": rates,
            "ratio": {w: b[w] / a[w] for w in ("sleep", "wake")}}


def run(args: argparse.Namespace) -> int:
    """``residency bench chunks``: see the module docstring."""
    if args.repeats < 1:
        print("residency bench chunks: --repeats must be at least 1", file=sys.stderr)
        return 2
    device = bench_setup(args)
    if device.type == "cpu":  # as `residency bench sleep-wake`
        torch.set_num_threads(1)
    out = anyio.run(measure, args, device)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{out['bytes'] / 2**30:.2f} GiB on {device}, chunks of {out['chunk_bytes'] >> 20} MiB, "
          f"median of {out['rounds']} alternated rounds")
    for name, rate in out["gbps"].items():
        print(f"{name:<16} dirty sleep {rate['sleep']:7.2f} GB/s   wake {rate['wake']:7.2f} GB/s")
    ratio = out["ratio"]
    print(f"two / one        dirty sleep {ratio['sleep']:7.3f}x       "
          f"wake {ratio['wake']:7.3f}x")
    return 0
