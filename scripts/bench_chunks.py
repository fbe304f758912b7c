"""A/B of the store's chunked copies: one chunk in flight (each chunk waited for before the next
is handed over, as before) against two (``strategies._store.IN_FLIGHT``), alternated in one
process on the same pipeline, so that both see the same machine load.

    python scripts/bench_chunks.py [--size 1GiB] [--rounds 5] [--device cpu|cuda]

Per round and variant: a dirty sleep (every parameter bumped in place first) and a wake of the
whole pipeline, timed from an idle device to an idle device; medians in GB/s, and their ratio.
On the CPU the copies are memcpy in a worker thread (what two in flight saves there is the
host's turn-around between chunks); on a GPU it is the link idling while the host learns of a
landing and queues the next chunk.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import anyio
import anyio.lowlevel
import torch

import strategies._store as store_module
from lifecycle import LifecycleController
from lifecycle._units import gbps, parse_size
from lifecycle.cli.bench import set_malloc
from lifecycle.demo import DemoPipeline
from strategies._chunks import chunked
from strategies.devices import CopyPair, Tier


async def one_in_flight(self: store_module.TensorStore, pairs: Sequence[CopyPair], to: Tier,
                        progress: store_module.Progress | None = None) -> None:
    """The copy loop before two chunks in flight: each chunk waited for, then the next."""
    for i, chunk in enumerate(chunked(pairs, lambda pair: int(pair[0].nbytes), store_module.CHUNK)):
        if i:
            await anyio.lowlevel.checkpoint_if_cancelled()
        await self.layer.copy(chunk, to)
        if progress:
            progress(sum(int(dst.nbytes) for dst, _ in chunk))


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


async def main(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    if device.type == "cpu":  # as `residency bench sleep-wake` (lifecycle/cli/bench.py)
        torch.set_num_threads(1)
        set_malloc("keep")
    pipe = DemoPipeline.build(parse_size(args.size))
    two = store_module.TensorStore.copy_pairs
    variants = {"one in flight": one_in_flight, "two in flight": two}
    times: dict[str, dict[str, list[float]]] = {v: {"sleep": [], "wake": []} for v in variants}
    async with LifecycleController(device) as ctl:
        await ctl.attach(pipe)
        await ctl.sleep()  # mirrors made
        await ctl.wake()
        nbytes = ctl.report().device_bytes
        for r in range(args.rounds + 1):  # round 0 is a warm-up
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
                    assert result.success, result.message
                    if r:
                        times[name][what].append(time.perf_counter() - t0)
        store_module.TensorStore.copy_pairs = two  # type: ignore[method-assign]
    print(f"{nbytes / 2**30:.2f} GiB on {device}, chunks of {store_module.CHUNK >> 20} MiB, "
          f"median of {args.rounds} alternated rounds")
    rates = {n: {w: gbps(nbytes, statistics.median(t)) for w, t in v.items()} for n, v in times.items()}
    for name, rate in rates.items():
        print(f"{name:<16} dirty sleep {rate['sleep']:7.2f} GB/s   wake {rate['wake']:7.2f} GB/s")
    a, b = rates["one in flight"], rates["two in flight"]
    print(f"two / one        dirty sleep {b['sleep'] / a['sleep']:7.3f}x       "
          f"wake {b['wake'] / a['wake']:7.3f}x")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    anyio.run(main, ap.parse_args())
