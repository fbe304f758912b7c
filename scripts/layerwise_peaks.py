"""Layerwise offload on the real models of the test zoo: device bytes at peak, against the
bound and the whole model, streaming every block list versus only the largest one (what
layerwise offload did before it streamed every list), and forward time against resident.

    .venv/bin/python scripts/layerwise_peaks.py [--repeats 5] [--depth 8] [--json]

Needs the test extras (diffusers, transformers): ``scripts/test`` installs them. Peak bytes
are counted exactly: every device buffer the layer allocates, at every allocation (copies in
flight included), plus the non-layer weights. Outputs are checked bit-identical to the plain
model (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import anyio
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lifecycle import LifecycleController
from strategies import ResidencyConfig, detect_block_lists
from tests.models.zoo import CASES, DEEP, ModelCase, build_deep
from tests.modes.strategy_suite import TrackingDevice


def largest_list(module: nn.Module) -> str:
    lists = detect_block_lists(module)
    return max(lists, key=lambda n: sum(p.nbytes for p in module.get_submodule(n).parameters()))


def build(case: ModelCase, depth: int) -> nn.Module:
    return build_deep(case.name, depth) if case.name in DEEP else case.build(0)


async def measure(case: ModelCase, prefetch: int, lists: str, repeats: int,
                  depth: int) -> dict[str, object]:
    model = build(case, depth)
    expected = case.run(build(case, depth))
    names = ",".join(detect_block_lists(model)) if lists == "every" else largest_list(model)
    config = ResidencyConfig.parse("m=layerwise-offload", prefetch={"m": prefetch},
                                   layers={"m": names.split(",")})
    layer = TrackingDevice()
    ctl = LifecycleController(device_layer=layer, residency=config)
    await ctl.attach({"m": model})
    idle = ctl.report().device_bytes
    times = []
    async with ctl.use("m"):
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = case.run(model)
            times.append(time.perf_counter() - t0)
            if not torch.equal(out, expected):
                raise SystemExit(f"{case.name}: output differs from the plain model's")
    strategy = ctl.strategy("m")
    bound = strategy.peak_bound()  # type: ignore[attr-defined]
    total = strategy.store.nbytes  # (recomputed weight_norm/spectral_norm weights included)
    plain = build(case, depth)
    base = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        case.run(plain)
        base.append(time.perf_counter() - t0)
    return {"model": case.name, "lists": lists, "streamed": names, "prefetch": prefetch,
            "depth": depth if case.name in DEEP else None, "total": total,
            "peak": idle + layer.peak, "bound": bound,
            "within": idle + layer.peak <= bound,
            "time_x": statistics.median(times) / statistics.median(base)}


async def run(repeats: int, depth: int) -> list[dict[str, object]]:
    rows = []
    for case in CASES.values():
        for prefetch in (1, 2):
            for lists in ("largest", "every"):
                rows.append(await measure(case, prefetch, lists, repeats, depth))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--depth", type=int, default=8,
                        help="blocks per list of the transformer models (Flux, HunyuanVideo: "
                             "depth double and 2 x depth single blocks)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = anyio.run(run, args.repeats, args.depth)
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| model | prefetch | lists streamed | peak bytes | bound | whole model | peak / whole "
          "| forward x resident |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        total, peak = int(r["total"]), int(r["peak"])  # type: ignore[call-overload]
        mark = "" if r["within"] else " (over)"
        print(f"| {r['model']} | {r['prefetch']} | {r['streamed']} | {peak:,}{mark} "
              f"| {int(r['bound']):,} | {total:,} | {peak / total:.2f} "  # type: ignore[call-overload]
              f"| {float(r['time_x']):.2f} |")  # type: ignore[arg-type]
    if not all(r["within"] for r in rows if r["lists"] == "every"):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
