"""Soak: thousands of use/sleep/wake/update cycles with integrity checks and memory growth.

    python scripts/soak.py [--cycles 10000] [--size 16MB] [--device cpu|cuda]
        [--residency "transformer=layerwise-offload,vae=component-offload"] [--fault-every 0]
        [--seed 0] [--malloc keep|release|default] [--no-growth-check] [--trace] [--json]

Prepares versions A and B of a few transformer tensors of a DemoPipeline, with reference outputs
and checksums. Each cycle: ``generate(ctl=ctl, steps=1)`` (every component through ``ctl.use``),
sleep, wake, and every 10th cycle an update to the other version. ``--fault-every M``: every M-th
cycle first fails an operation at a random copy, alternately a sleep (after ``mark_dirty``, so
that it copies) and an update, and checks the rollback: typed failure; phase, report, version,
checksums unchanged (or, for an update faulted after its commit point, the whole new version).
The device layer is always ``lifecycle.testing``'s fault-injecting one (unarmed, it only counts).

Exit 1 on any integrity failure: an output not bit-identical to the current version's, a wrong
phase, device bytes while asleep (report; CUDA: also the allocator), a lease held between cycles,
a wrong checksum (every 100 cycles), a fault not raised or not rolled back. Reports cycles/s, median
ms per phase, current RSS (/proc/self/statm, every 100 cycles), host/pinned bytes, Python objects.
RSS growth (end over end of warm-up: 5% of the cycles, at least 50) fails the run at >= 2% only
from 1000 cycles on (shorter runs are allocator noise) and never with ``--no-growth-check``.
"""

from __future__ import annotations

import argparse
import array
import collections
import gc
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from lifecycle import LifecycleController, Phase, TransitionFailed, configure_logging
from lifecycle._units import parse_size
from lifecycle.cli._benchkit import set_malloc
from lifecycle.demo import DemoPipeline
from lifecycle.testing import InjectedFault, faulty_device_layer

UPDATE_EVERY, CHECK_EVERY, GROWTH_TARGET_PCT, GROWTH_MIN_CYCLES = 10, 100, 2.0, 1000
UPDATED = ("out_proj.weight", "out_proj.bias", "final_ada.bias", "blocks.0.mlp.fc2.weight")
OTHER, PHASES = {"A": "B", "B": "A"}, ("generate", "sleep", "wake", "update")


def rss() -> int:  # current resident set size, bytes
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def object_types() -> collections.Counter[str]:
    gc.collect()
    return collections.Counter(type(o).__name__ for o in gc.get_objects())


def make_versions(pipe: DemoPipeline, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """Two versions of a few transformer tensors (one in a block: a layer unit if layerwise)."""
    state = pipe.modules["transformer"].state_dict()
    g = torch.Generator().manual_seed(seed)
    return {v: {n: state[n] + 0.05 * torch.randn(state[n].shape, generator=g).to(state[n].dtype)
                for n in UPDATED} for v in ("A", "B")}


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.checks = dict.fromkeys(("outputs", "phases", "device_bytes", "checksums", "in_flight",
                                     "faults", "versions_distinct"), True)
        self.failures: list[str] = []
        # Preallocated: growing lists (and rich's progress samples: every 10th cycle) add to RSS.
        self.ms = {k: array.array("d", bytes(8 * args.cycles)) for k in PHASES}
        self.n = dict.fromkeys(PHASES, 0)
        self.faults, self.rng = collections.Counter[str](), random.Random(args.seed)

    def check(self, kind: str, ok: bool, what: str) -> None:
        if not ok:
            self.checks[kind] = False
            self.failures.append(what)

    async def timed(self, phase: str, fn: Callable[..., Awaitable[Any]], *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        result = await fn(*a, **kw)
        self.ctl.device_layer.synchronize()
        self.ms[phase][self.n[phase]] = 1e3 * (time.perf_counter() - t0)
        self.n[phase] += 1
        return result

    async def inject(self, i: int, kind: str, points: int, current: str) -> str:
        """Fail ``kind`` at a random one of its ``points`` copies; check all or nothing landed (an
        update absorbs a fault after its commit point, the mirror refresh). Returns the version."""
        ctl, layer, landed = self.ctl, self.layer, False
        phase, version, report, fired = ctl.phase, ctl.weights_version, ctl.report(), layer.faults
        layer.arm(copy_at=self.rng.randint(1, points))
        try:  # a faulted sleep raises, a faulted update returns a failure
            if kind == "sleep":
                ctl.mark_dirty()  # a clean sleep copies nothing, so nothing could fail
                await ctl.sleep()
            else:
                landed = (await ctl.update_weights_from_tensors(self.versions[OTHER[current]])).success
            ok = kind == "update"
        except TransitionFailed as exc:
            ok = kind == "sleep" and isinstance(exc.cause, InjectedFault)
        layer.arm()  # disarm, had it not fired
        self.faults[kind + " (absorbed)" * landed] += 1
        now = OTHER[current] if landed else current
        self.check("faults", ok and layer.faults == fired + 1, f"cycle {i}: {kind} fault not raised")
        self.check("faults", (ctl.phase, ctl.weights_version) == (phase, version + landed)
                   and (landed or ctl.report() == report), f"cycle {i}: {kind} fault left a wrong state")
        self.check("checksums", ctl.weights_checksum(algorithm="full") == self.sums[now],
                   f"cycle {i}: weights after a faulted {kind} are not version {now}")
        return now

    async def run(self, advance: Callable[[int], object]) -> dict[str, Any]:
        args = self.args
        pipe = DemoPipeline.build(parse_size(args.size), seed=args.seed)
        self.versions = make_versions(pipe, args.seed)
        self.layer = layer = faulty_device_layer(args.device)  # unarmed, it only counts
        self.ctl = ctl = LifecycleController(args.device, residency=args.residency, device_layer=layer)
        await ctl.attach(pipe)
        refs: dict[str, torch.Tensor] = {}
        self.sums: dict[str, dict[str, str]] = {}
        for v in ("B", "A"):  # ends on A, the version the cycles start from
            self.check("phases", (await ctl.update_weights_from_tensors(self.versions[v])).success,
                       f"update to {v} failed")
            refs[v] = await pipe.generate(ctl=ctl, steps=1, seed=args.seed)
            self.sums[v] = ctl.weights_checksum(algorithm="full")
        self.check("versions_distinct", not torch.equal(refs["A"], refs["B"])
                   and self.sums["A"] != self.sums["B"], "versions A and B are indistinguishable")
        c0 = layer.copies  # the copies of a dirty sleep and of an update: where a fault can hit
        ctl.mark_dirty()
        await ctl.sleep()  # floor: CUDA's allocated bytes while asleep, plus 1 MiB of slack
        c1, floor = layer.copies, (ctl.report().device_allocated or 0) + 2**20
        await ctl.wake()
        c2 = layer.copies
        await ctl.update_weights_from_tensors(self.versions["A"])
        kinds = [(k, n) for k, n in [("sleep", c1 - c0), ("update", layer.copies - c2)] if n]
        warm = min(args.cycles, max(50, args.cycles // 20))
        current, samples, t0 = "A", [(0, rss())], time.perf_counter()
        for i in range(1, args.cycles + 1):
            out = await self.timed("generate", pipe.generate, ctl=ctl, steps=1, seed=args.seed)
            self.check("outputs", torch.equal(out, refs[current]), f"cycle {i}: output != {current}")
            self.check("phases", ctl.phase is Phase.AWAKE, f"cycle {i}: {ctl.phase} after generate")
            if args.fault_every and i % args.fault_every == 0 and kinds:
                current = await self.inject(i, *kinds[sum(self.faults.values()) % len(kinds)], current)
            r = await self.timed("sleep", ctl.sleep)
            self.check("phases", r.success and ctl.phase is Phase.SLEEPING, f"cycle {i}: sleep {r}")
            rep = ctl.report()
            self.check("device_bytes", rep.device_bytes == 0 and (rep.device_allocated or 0) <= floor,
                       f"cycle {i}: {rep.device_bytes} device bytes ({rep.device_allocated}) asleep")
            r = await self.timed("wake", ctl.wake)
            self.check("phases", r.success and ctl.phase is Phase.AWAKE, f"cycle {i}: wake {r}")
            if i % UPDATE_EVERY == 0:
                u = await self.timed("update", ctl.update_weights_from_tensors,
                                     self.versions[OTHER[current]])
                self.check("phases", u.success and ctl.phase is Phase.AWAKE, f"cycle {i}: update {u}")
                current = OTHER[current] if u.success else current
            if i % CHECK_EVERY == 0 or i == args.cycles:
                self.check("checksums", ctl.weights_checksum(algorithm="full") == self.sums[current],
                           f"cycle {i}: checksum != version {current}")
            self.check("in_flight", ctl.in_flight == 0, f"cycle {i}: {ctl.in_flight} leases held")
            if i % CHECK_EVERY == 0 or i in (warm, args.cycles):
                samples.append((i, rss()))
            if i == warm:
                warm_rss, warm_types = samples[-1][1], object_types()
                if args.trace:
                    tracemalloc.start()
                    warm_trace = tracemalloc.take_snapshot()
            advance(i)
        seconds, end_rss, end_types, report = time.perf_counter() - t0, rss(), object_types(), ctl.report()
        growth = 100.0 * (end_rss - warm_rss) / warm_rss
        late = [(c, b) for c, b in samples if c >= warm]  # least-squares slope after warm-up
        slope = statistics.linear_regression(*zip(*late, strict=True)).slope if len(late) > 2 else 0.0
        checked = args.cycles >= GROWTH_MIN_CYCLES and not args.no_growth_check
        top = [f"{s.size_diff / 1024:+.1f} KiB {s.count_diff:+d} blocks at {s.traceback}" for s in
               tracemalloc.take_snapshot().compare_to(warm_trace, "lineno")[:10]] if args.trace else []
        await ctl.detach()
        return {
            "config": {**{k: getattr(args, k) for k in ("cycles", "size", "residency", "fault_every",
                                                        "seed", "malloc")}, "nbytes": pipe.nbytes,
                       "device": str(ctl.device), "threads": torch.get_num_threads()},
            "integrity": self.checks, "failures": self.failures[:20], "faults": dict(self.faults),
            "seconds": seconds, "cycles_per_second": args.cycles / seconds,
            "phase_ms": {k: statistics.median(v[:self.n[k]]) if self.n[k] else None
                         for k, v in self.ms.items()},
            "rss": {"warmup_cycle": warm, "warmup": warm_rss, "end": end_rss, "growth_pct": growth,
                    "bytes_per_cycle": slope, "samples": samples},
            "growth_check": ("PASS" if growth < GROWTH_TARGET_PCT else "FAIL") if checked else "skipped",
            **{f"{k}_bytes": getattr(report, f"{k}_bytes") for k in ("host", "pinned", "device")},
            "objects": {"warmup": warm_types.total(), "end": end_types.total(),
                        "grown": dict((end_types - warm_types).most_common(8))},
            "tracemalloc_top": top,
            "ok": all(self.checks.values()) and not (checked and growth >= GROWTH_TARGET_PCT),
        }


def print_summary(res: dict[str, Any]) -> None:
    cfg, r, o, mib = res["config"], res["rss"], res["objects"], 2**20
    t = Table(title=f"soak: {cfg['cycles']} cycles, {cfg['nbytes'] / 1e6:.1f} MB on {cfg['device']}, "
              f"residency {cfg['residency']}, fault every {cfg['fault_every']}", show_header=False)
    t.add_row("cycles/s", f"{res['cycles_per_second']:.1f} ({res['seconds']:.1f} s)")
    for k, v in res["phase_ms"].items():
        t.add_row(f"{k} median", "-" if v is None else f"{v:.3f} ms")
    t.add_row("RSS warm-up / end", f"{r['warmup'] / mib:.1f} MiB (cycle {r['warmup_cycle']}) / "
              f"{r['end'] / mib:.1f} MiB: {r['growth_pct']:+.2f}% (< {GROWTH_TARGET_PCT}%) "
              f"{res['growth_check']}; slope {r['bytes_per_cycle']:+.1f} B/cycle")
    t.add_row("host / pinned bytes", f"{res['host_bytes']:,} / {res['pinned_bytes']:,}")
    t.add_row("Python objects", f"{o['warmup']:,} -> {o['end']:,}  grown: {o['grown'] or '-'}")
    t.add_row("integrity", ", ".join(f"{k} {'ok' if ok else 'FAIL'}" for k, ok in res["integrity"].items())
              + f"; faults injected: {res['faults'] or '-'}")
    Console().print(t)
    print("\n".join([*res["failures"], *res["tracemalloc_top"], "PASS" if res["ok"] else "FAIL"]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cycles", type=int, default=10_000)
    ap.add_argument("--size", default="16MB", help="pipeline weight bytes, e.g. 4MB, 1GiB")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if any")
    ap.add_argument("--residency", default=None, help='e.g. "transformer=layerwise-offload"')
    ap.add_argument("--fault-every", type=int, default=0, metavar="M",
                    help="inject a copy fault into every M-th cycle's sleep or update (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--malloc", choices=["keep", "release", "default"], default="keep", help="glibc policy")
    ap.add_argument("--no-growth-check", action="store_true", help="report RSS growth, never fail on it")
    ap.add_argument("--trace", action="store_true", help="tracemalloc's top growth after warm-up (slow)")
    ap.add_argument("--json", action="store_true", help="print one JSON document")
    args = ap.parse_args(argv)
    if args.cycles < 1 or args.fault_every < 0:
        ap.error("--cycles must be >= 1 and --fault-every >= 0")
    set_malloc(args.malloc)
    configure_logging(json=True, level="error")  # rolled-back faults log warnings by design
    with Progress(transient=True, disable=args.json) as progress:
        task = progress.add_task("soak", total=args.cycles)

        def tick(cycle: int) -> None:
            if cycle % 10 == 0 and not args.json:
                progress.update(task, completed=cycle)

        res = anyio.run(Soak(args).run, tick)
    print(json.dumps(res, indent=2)) if args.json else print_summary(res)
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
