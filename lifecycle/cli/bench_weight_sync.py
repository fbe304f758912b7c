"""Weight sync over a process group (gloo on 127.0.0.1): ``update_weights_from_distributed``
against a plain ``broadcast`` loop of the same tensors, and staging memory against the bucket.

    residency bench weight-sync [--size 256MiB] [--tensors 64] [--repeats 5]
        [--buckets 16MiB,64MiB,256MiB] [--pause 0] [--json]

A trainer process (fork-started) joins two groups as rank 0 the way RL trainers do (its store,
a PrefixStore of the group's name, torch's group helper) and broadcasts the same tensors, one
``broadcast`` each, into either:

* ``plain``: a receiver that joined the same way and runs ``dist.broadcast`` into fresh tensors
  (what a receiver costs at least: no validation, no write, no rollback);
* ``update``: a :class:`~lifecycle.LifecycleController` serving a resident component of those
  tensors (slept and woken first, so its host mirrors are current, as in an RL loop), through
  ``update_weights_from_distributed``: validated, staged, written all-or-nothing.

Each round times both on the receiving side (median over ``--repeats``); the ratio is
update / plain throughput (the target is >= 0.8). Then one update per bucket size reports the
staging the library held at its peak (``peak_staging_bytes``) and the resident memory the
process grew by during the update (sampled every millisecond), against the bucket.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import anyio
import torch
import torch.distributed as dist
from torch import nn

from lifecycle import LifecycleController
from lifecycle._units import gbps, parse_size
from strategies.protocol import to_thread

__all__ = ["add_arguments", "run"]

MiB = 2**20
TIMEOUT = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``residency bench weight-sync`` besides the common ones."""
    parser.add_argument("--size", default="256MiB", help="bytes broadcast per update")
    parser.add_argument("--tensors", type=int, default=64, help="weight tensors (+ a bias each)")
    parser.add_argument("--buckets", default="16MiB,64MiB,256MiB",
                        help="bucket sizes for the staging measurement")
    parser.add_argument("--pause", type=float, default=0.0,
                        help="seconds between updates (lets the background mirror refresh of "
                             "the last update finish first)")


def _store(port: int, world_size: int, master: bool) -> Any:
    store_class: Any = dist.TCPStore  # type: ignore[attr-defined]
    return store_class("127.0.0.1", port, world_size, master, timedelta(seconds=TIMEOUT),
                       wait_for_workers=False, multi_tenant=master)


def _group(store: Any, rank: int, name: str) -> Any:
    """init_custom_process_group's recipe: PrefixStore(name), then torch's group helper."""
    from torch.distributed.distributed_c10d import (
        Backend,
        GroupName,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )
    group, _ = _new_process_group_helper(2, rank, [], Backend("gloo"), PrefixStore(name, store),
                                         group_name=GroupName(name),
                                         timeout=timedelta(seconds=TIMEOUT), group_desc=name)
    _world.pg_group_ranks[group] = {0: 0, 1: 1}
    return group


def tensors_of(size: int, count: int) -> dict[str, torch.Tensor]:
    """``count`` float32 tensors of about ``size`` bytes in all, plus a bias per tensor."""
    side = max(1, int((size / count / 4) ** 0.5))
    gen = torch.Generator().manual_seed(0)
    out = {}
    for i in range(count):
        out[f"w{i}.weight"] = torch.randn(side, side, generator=gen)
        out[f"w{i}.bias"] = torch.randn(side, generator=gen)
    return out


def _trainer(commands: Any, results: Any, named: dict[str, torch.Tensor]) -> None:
    torch.set_num_threads(1)
    groups: dict[str, Any] = {}
    stores: dict[str, Any] = {}
    while True:
        command, name = commands.get()
        if command == "init":
            stores[name] = _store(0, 2, True)
            results.put(stores[name].port)
            groups[name] = _group(stores[name], 0, name)
            results.put("joined")
        elif command == "broadcast":
            for t in named.values():
                dist.broadcast(t, src=0, group=groups[name])
            results.put("sent")
        else:
            break
    results.close()
    results.join_thread()
    os._exit(0)


class _RssPeak:
    """The highest resident set size seen while it runs (sampled every millisecond)."""

    def __init__(self) -> None:
        self.peak = self.start = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> _RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Component(nn.Module):
    def __init__(self, named: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name in {n.split(".")[0] for n in named}:
            layer = nn.Module()
            layer.weight = nn.Parameter(torch.zeros_like(named[f"{name}.weight"]))
            layer.bias = nn.Parameter(torch.zeros_like(named[f"{name}.bias"]))
            self.add_module(name, layer)


async def measure(size: int, count: int, rounds: int, buckets: list[int], pause: float
              ) -> dict[str, Any]:
    named = tensors_of(size, count)
    nbytes = sum(t.nbytes for t in named.values())
    ctx = multiprocessing.get_context("fork")
    commands, results = ctx.Queue(), ctx.Queue()
    trainer = ctx.Process(target=_trainer, args=(commands, results, named), daemon=True)
    trainer.start()
    names = list(named)
    dtypes = [str(t.dtype) for t in named.values()]
    shapes = [list(t.shape) for t in named.values()]
    module = _Component(named)
    out: dict[str, Any] = {"bytes": nbytes, "tensors": len(named), "rounds": rounds}
    try:
        async with LifecycleController("cpu") as ctl:
            await ctl.attach({"transformer": module})
            await ctl.sleep()
            await ctl.wake()  # host mirrors current, as after a release/resume in an RL loop
            commands.put(("init", "plain"))
            plain_port = results.get(timeout=TIMEOUT)
            plain = await to_thread(
                lambda: _group(_store(plain_port, 2, False), 1, "plain"))
            assert results.get(timeout=TIMEOUT) == "joined"
            commands.put(("init", "sync"))
            sync_port = results.get(timeout=TIMEOUT)
            joined = await ctl.init_weights_update_group("127.0.0.1", sync_port, 1, 2, "sync",
                                                         backend="gloo", timeout=TIMEOUT)
            assert joined.success, joined.message
            assert results.get(timeout=TIMEOUT) == "joined"

            def receive_plain() -> float:
                bufs = [torch.empty_like(t) for t in named.values()]
                t0 = time.perf_counter()
                for b in bufs:
                    dist.broadcast(b, src=0, group=plain)
                return time.perf_counter() - t0

            plain_s: list[float] = []
            update_s: list[float] = []
            for _ in range(rounds + 1):  # the first round warms both up
                await anyio.sleep(pause)
                commands.put(("broadcast", "plain"))
                plain_s.append(await to_thread(receive_plain))
                assert results.get(timeout=TIMEOUT) == "sent"
                await anyio.sleep(pause)
                commands.put(("broadcast", "sync"))
                t0 = time.perf_counter()
                result = await ctl.update_weights_from_distributed(
                    names, dtypes, shapes, group_name="sync", timeout=TIMEOUT)
                update_s.append(time.perf_counter() - t0)
                assert result.success, result.message
                assert results.get(timeout=TIMEOUT) == "sent"
            exact = all(torch.equal(p, named[n]) for n, p in module.named_parameters())
            plain_med, update_med = statistics.median(plain_s[1:]), statistics.median(update_s[1:])
            out |= {"plain_gbps": gbps(nbytes, plain_med), "update_gbps": gbps(nbytes, update_med),
                    "ratio": plain_med / update_med, "exact": exact,
                    "plain_seconds": plain_s[1:], "update_seconds": update_s[1:]}
            staging = []
            await ctl.destroy_weights_update_group("sync")
            for bucket in buckets:
                name = f"sync{bucket}"
                commands.put(("init", name))
                port = results.get(timeout=TIMEOUT)
                joined = await ctl.init_weights_update_group(
                    "127.0.0.1", port, 1, 2, name, backend="gloo", timeout=TIMEOUT,
                    bucket_bytes=bucket)
                assert joined.success and results.get(timeout=TIMEOUT) == "joined"
                commands.put(("broadcast", name))
                with _RssPeak() as rss:
                    t0 = time.perf_counter()
                    result = await ctl.update_weights_from_distributed(
                        names, dtypes, shapes, group_name=name, timeout=TIMEOUT)
                    seconds = time.perf_counter() - t0
                assert result.success and results.get(timeout=TIMEOUT) == "sent"
                state = ctl.weight_update_groups[name]
                staging.append({"bucket_bytes": bucket,
                                "peak_staging_bytes": state.peak_staging_bytes,
                                "rss_growth_bytes": rss.peak - rss.start,
                                "gbps": gbps(nbytes, seconds)})
                await ctl.destroy_weights_update_group(name)
            out["staging"] = staging
            plain = None
    finally:
        commands.put(("exit", ""))
        trainer.join(10)
        if trainer.is_alive():
            trainer.kill()
    return out


def run(args: argparse.Namespace) -> int:
    """``residency bench weight-sync``: see the module docstring."""
    if args.repeats < 1:
        print("residency bench weight-sync: --repeats must be at least 1", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    buckets = [parse_size(b) for b in args.buckets.split(",")]
    out = anyio.run(measure, parse_size(args.size), args.tensors, args.repeats, buckets,
                    args.pause)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(f"{out['tensors']} tensors, {out['bytes'] / MiB:.0f} MiB per update, gloo on "
              f"127.0.0.1, median of {out['rounds']} rounds (receiving side)")
        print(f"  plain broadcast loop          {out['plain_gbps']:6.2f} GB/s")
        print(f"  update_weights_from_distributed {out['update_gbps']:4.2f} GB/s  "
              f"({out['ratio']:.2f}x the plain loop; exact: {out['exact']})")
        print("  bucket        peak staging   RSS growth   GB/s")
        for row in out["staging"]:
            print(f"  {row['bucket_bytes'] / MiB:6.0f} MiB   {row['peak_staging_bytes'] / MiB:8.1f} MiB"
                  f"   {row['rss_growth_bytes'] / MiB:8.1f} MiB   {row['gbps']:.2f}")
    return 0 if out["exact"] else 1
