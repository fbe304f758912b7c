"""Residency strategies on a DiT-like stack: forward latency, peak device bytes, bytes moved.

    python scripts/bench_residency.py [--layers 24] [--width 1024] [--tokens 256]
        [--device cpu|cuda] [--repeats 5] [--json]

Sizes default to 24 x 1024 x 256 on CUDA and to 8 x 256 x 128 on the CPU. One controller per
mode (detached afterwards) over a fresh copy of the same random weights; every mode runs under
``torch.inference_mode`` and must give outputs bit-identical to resident (exit 1 otherwise).

* fwd ms: median forward time inside one open ``ctl.use("transformer")``, after a warm-up;
* use ms: median of a whole use (move in, forward, move out), the cost per request;
* peak MiB: CPU: the largest ``ctl.report()`` device bytes seen by a pre-hook on every block;
  CUDA: ``torch.cuda.max_memory_allocated`` (weights and activations);
* moved/use: bytes the device layer copied per use, both directions.

"reference" emulates the reference's component offload: each use moves the module in, runs
it and copies every weight back to fresh host memory (CUDA: ``module.to``; CPU: a fresh
``empty_like`` copy per tensor, which is what ``.to`` would do across devices).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import structlog
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lifecycle import LifecycleController  # noqa: E402
from strategies import ResidencyConfig  # noqa: E402

MiB = 2**20
MODES: dict[str, tuple[str, dict[str, str]]] = {  # name -> (mode, layerwise tuning)
    "resident": ("resident", {}),
    "component-offload": ("component-offload", {}),
    "snapshot-offload": ("snapshot-offload", {}),
    "layerwise p1": ("layerwise-offload", {"prefetch": "1", "resident_layers": "0"}),
    "layerwise p2": ("layerwise-offload", {"prefetch": "2", "resident_layers": "0"}),
    "layerwise r.25 leading": ("layerwise-offload", {"resident_layers": "0.25", "policy": "leading"}),
    "layerwise r.25 strided": ("layerwise-offload", {"resident_layers": "0.25", "policy": "strided"}),
}


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, w))
        return x + self.mlp(self.norm2(x))  # type: ignore[no-any-return]


class DiT(nn.Module):
    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(width, width), nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width, max(1, width // 64)) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)  # type: ignore[no-any-return]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def count_bytes(ctl: LifecycleController) -> list[int]:
    """Bytes of every copy the controller's device layer makes (wraps its copy hook)."""
    layer, moved = ctl.device_layer, []
    original = layer._copy_one

    def counted(dst: torch.Tensor, src: torch.Tensor) -> None:
        moved.append(src.nbytes)
        original(dst, src)

    layer._copy_one = counted  # type: ignore[method-assign]
    return moved


async def bench_mode(mode: str, tuning: dict[str, str], base: DiT, x: torch.Tensor,
                     device: torch.device, repeats: int) -> tuple[dict[str, float], torch.Tensor]:
    model = copy.deepcopy(base)
    spec = {k: f"transformer={v}" for k, v in tuning.items()}
    ctl = LifecycleController(device, residency=ResidencyConfig.parse(f"transformer={mode}", **spec))
    await ctl.attach({"transformer": model})
    samples: list[int] = []
    if device.type == "cpu":
        for block in model.blocks:
            block.register_forward_pre_hook(
                lambda *_: samples.append(ctl.report().components["transformer"].device_bytes))
    moved = count_bytes(ctl)
    with torch.inference_mode():
        async with ctl.use("transformer"):
            out = model(x).clone()  # warm-up
            fwd = [timed(lambda: model(x), device) for _ in range(repeats)]
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        moved.clear()
        uses = []
        for _ in range(repeats):
            sync(device)
            t0 = time.perf_counter()
            async with ctl.use("transformer"):
                model(x)
                sync(device)
            uses.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else max(samples)
    await ctl.detach()
    return {"fwd_ms": 1e3 * statistics.median(fwd), "use_ms": 1e3 * statistics.median(uses),
            "peak_mib": peak / MiB, "moved_mib": sum(moved) / repeats / MiB}, out


def bench_reference(base: DiT, x: torch.Tensor, device: torch.device,
                    repeats: int) -> tuple[dict[str, float], torch.Tensor]:
    """The reference's component offload: in, forward, full copy of every weight back."""
    model = copy.deepcopy(base)
    tensors = [*model.parameters(), *model.buffers()]
    nbytes = sum(t.nbytes for t in tensors)

    def move(to: torch.device) -> None:
        if device.type == "cuda":
            model.to(to)
        else:  # .to() is a no-op on the CPU: copy into fresh memory as a cross-device move would
            for t in tensors:
                t.data = torch.empty_like(t).copy_(t)

    def use() -> torch.Tensor:
        move(device)
        out = model(x)
        move(torch.device("cpu"))
        return out

    with torch.inference_mode():
        out = use().clone()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        uses = [timed(use, device) for _ in range(repeats)]
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else nbytes
    median = 1e3 * statistics.median(uses)
    return {"fwd_ms": float("nan"), "use_ms": median, "peak_mib": peak / MiB,
            "moved_mib": 2 * nbytes / MiB}, out


def layer_copy_ms(base: DiT, device: torch.device, repeats: int) -> float:
    """Time of one layer's bytes host -> device in one copy (pinned on CUDA)."""
    nbytes = sum(t.nbytes for t in base.blocks[0].parameters())
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return 1e3 * statistics.median(
        timed(lambda: dst.copy_(src, non_blocking=True), device) for _ in range(repeats + 1))


async def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int)
    p.add_argument("--width", type=int)
    p.add_argument("--tokens", type=int)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    device = torch.device(args.device)
    big = device.type == "cuda"
    layers = args.layers or (24 if big else 8)
    width = args.width or (1024 if big else 256)
    tokens = args.tokens or (256 if big else 128)
    dtype = torch.bfloat16 if big else torch.float32
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    torch.manual_seed(0)
    base = DiT(layers, width).to(dtype).eval()
    x = torch.randn(2, tokens, width, dtype=dtype, device=device)
    results: dict[str, dict[str, float]] = {}
    outputs: dict[str, torch.Tensor] = {}
    for name, (mode, tuning) in MODES.items():
        results[name], outputs[name] = await bench_mode(mode, tuning, base, x, device, args.repeats)
    results["reference component-offload"], outputs["reference component-offload"] = \
        bench_reference(base, x, device, args.repeats)
    mismatched = [n for n, o in outputs.items() if not torch.equal(o, outputs["resident"])]
    res = results["resident"]
    layer_ms = res["fwd_ms"] / layers
    copy_ms = layer_copy_ms(base, device, args.repeats)
    ours, ref = results["component-offload"]["use_ms"], results["reference component-offload"]["use_ms"]
    worst = max(results[n]["fwd_ms"] for n in ("layerwise p1", "layerwise p2")) / res["fwd_ms"]
    applies = big and layer_ms >= copy_ms
    targets = {
        "layerwise_prefetch_fwd_ratio": worst,
        "layerwise_target_applies": applies,
        "layerwise_target_met": worst <= 1.15 if applies else None,
        "offload_use_ms": ours, "reference_use_ms": ref, "offload_faster": ours < ref,
    }
    if args.json:
        print(json.dumps({"device": str(device), "layers": layers, "width": width, "tokens": tokens,
                          "dtype": str(dtype), "layer_compute_ms": layer_ms, "layer_copy_ms": copy_ms,
                          "modes": results, "targets": targets, "mismatched": mismatched}, indent=2))
    else:
        print(f"device {device}, {layers} layers x width {width}, {tokens} tokens x 2, {dtype}, "
              f"weights {sum(t.nbytes for t in base.parameters()) / MiB:.1f} MiB, "
              f"median of {args.repeats}")
        print(f"{'mode':<28}{'fwd ms':>9}{'x res':>7}{'use ms':>9}{'x res':>7}"
              f"{'peak MiB':>10}{'moved/use MiB':>15}")
        for name, r in results.items():
            fwd = "-" if r["fwd_ms"] != r["fwd_ms"] else f"{r['fwd_ms']:.2f}"
            ratio = "-" if fwd == "-" else f"{r['fwd_ms'] / res['fwd_ms']:.2f}"
            print(f"{name:<28}{fwd:>9}{ratio:>7}{r['use_ms']:>9.2f}{r['use_ms'] / res['use_ms']:>7.2f}"
                  f"{r['peak_mib']:>10.1f}{r['moved_mib']:>15.1f}")
        print(f"layer compute {layer_ms:.3f} ms, layer copy {copy_ms:.3f} ms")
        verdict = ("PASS" if worst <= 1.15 else "FAIL") if applies else \
            "n/a (GPU only, and only when layer compute >= copy)"
        print(f"target: layerwise prefetch fwd <= 1.15x resident: {worst:.2f}x -> {verdict}")
        print(f"target: component-offload repeated use faster than the reference's: "
              f"{ours:.2f} ms vs {ref:.2f} ms -> {'PASS' if ours < ref else 'FAIL'}")
        print("outputs bit-identical to resident: " + ("yes" if not mismatched else f"NO: {mismatched}"))
    return 1 if mismatched else 0


if __name__ == "__main__":
    sys.exit(anyio.run(main))
