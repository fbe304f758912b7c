"""Every check and benchmark that needs a GPU, in one run (dry-runs on CPU).

    python scripts/gpu_check.py [--size 4GiB] [--device cuda] [--out DIR]

Checks, each PASS/FAIL with numbers:
1. sleep releases the weights' bytes from torch.cuda.memory_allocated and empties the cache;
   wake restores bit-identical outputs into the same Parameter objects;
2. a dirty sleep and a wake run at >= 80% of the pinned copy bandwidth (``residency bench``);
3. layerwise offload keeps max_memory_allocated within non-layer + (resident + prefetch + 1)
   x largest layer during a forward, with outputs identical to resident;
4. an update from tensors and from disk is atomic under an injected fault (checksums equal
   before/after) and correct when it succeeds;
5. the residency benchmark (latency per mode) and the update benchmark;
6. four threads forwarding one layerwise component at once: exact outputs, no buffer in flight
   or left allocated after the use.

Results go to stdout and, as JSON, to ``--out`` (``$OUT`` on the device machine).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import torch

from lifecycle import LifecycleController, TransitionFailed, configure_logging
from lifecycle.demo import DemoPipeline, parse_size
from lifecycle.testing import faulty_device_layer

RESULTS: dict[str, Any] = {}


def check(name: str, ok: bool, **numbers: Any) -> None:
    RESULTS[name] = {"pass": bool(ok), **numbers}
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {numbers}", flush=True)


def allocated(device: torch.device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


async def sleep_wake(size: int, device: torch.device) -> None:
    pipe = DemoPipeline.build(size)
    ctl = LifecycleController(device)
    await ctl.attach(pipe)
    expected = await pipe.generate(ctl=ctl)
    ids = [id(p) for m in pipe.modules.values() for p in m.parameters()]
    before = allocated(device)
    slept = await ctl.sleep()
    after = allocated(device)
    reserved = int(torch.cuda.memory_reserved(device)) if device.type == "cuda" else 0
    woke = await ctl.wake()
    same = torch.equal(await pipe.generate(ctl=ctl), expected)
    same_ids = ids == [id(p) for m in pipe.modules.values() for p in m.parameters()]
    released = before - after
    check("sleep releases the weights and wake restores them", same and same_ids and
          (device.type != "cuda" or released >= pipe.nbytes * 0.99),
          weights=pipe.nbytes, released_allocated=released, reserved_after_sleep=reserved,
          sleep_s=round(slept.seconds, 4), wake_s=round(woke.seconds, 4),
          wake_gbps=round(woke.gbps, 2), outputs_identical=same, identity_kept=same_ids)
    await ctl.detach()


async def layerwise(size: int, device: torch.device) -> None:
    ref = DemoPipeline.build(size)
    pipe = DemoPipeline.build(size)
    resident = LifecycleController(device)
    await resident.attach(ref)
    expected = await ref.generate(ctl=resident)
    await resident.detach()
    del ref
    for tuning in ({"prefetch": "transformer=1"}, {"prefetch": "transformer=2",
                                                   "resident_layers": "transformer=0.25",
                                                   "policy": "transformer=strided"}):
        from strategies import ResidencyConfig

        cfg = ResidencyConfig.parse("transformer=layerwise-offload", **tuning)
        ctl = LifecycleController(device, residency=cfg)
        await ctl.attach(pipe)
        bound = ctl.strategy("transformer").peak_bound()  # type: ignore[attr-defined]
        others = sum(r.device_bytes for n, r in ctl.report().components.items()
                     if n != "transformer")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        base = allocated(device)
        out = await pipe.generate(ctl=ctl)
        peak = int(torch.cuda.max_memory_allocated(device)) - base if device.type == "cuda" else 0
        check(f"layerwise {tuning}", torch.equal(out, expected) and
              (device.type != "cuda" or peak <= bound + others + 512 * 2**20),
              bound=bound, peak_over_base=peak, activations_slack=512 * 2**20,
              fetched=ctl.strategy("transformer").fetched)  # type: ignore[attr-defined]
        await ctl.detach()


async def updates(size: int, device: torch.device, tmp: Path) -> None:
    from safetensors.torch import save_file

    pipe = DemoPipeline.build(size)
    layer = faulty_device_layer(device)
    ctl = LifecycleController(device_layer=layer)
    await ctl.attach(pipe)
    before = ctl.weights_checksum()
    state = {k: v.detach().to("cpu") + 0.01 for k, v in pipe.modules["transformer"]
             .state_dict().items() if v.is_floating_point()}
    layer.arm(copy_at=max(2, len(state) // 2))
    failed = await ctl.update_weights_from_tensors(state)
    check("update rolled back under an injected fault", not failed.success and
          ctl.weights_checksum() == before, message=failed.message[:120])
    t0 = time.perf_counter()
    ok = await ctl.update_weights_from_tensors(state)
    check("update from tensors", ok.success, seconds=round(time.perf_counter() - t0, 4),
          gbps=round(ok.bytes_written / ok.seconds / 1e9, 2) if ok.seconds else None)
    (tmp / "transformer").mkdir(parents=True, exist_ok=True)
    on_disk = {k: v * 0.5 for k, v in state.items()}
    save_file(on_disk, str(tmp / "transformer" / "w.safetensors"))
    ok = await ctl.update_weights_from_disk(tmp)
    live = pipe.modules["transformer"].state_dict()
    same = all(torch.equal(live[k].to("cpu"), v) for k, v in on_disk.items())
    check("update from disk writes exactly the file's values", ok.success and same,
          seconds=round(ok.seconds, 4))
    try:
        await ctl.sleep()
        await ctl.wake()
        check("sleep/wake after updates", True)
    except TransitionFailed as exc:
        check("sleep/wake after updates", False, error=str(exc))
    await ctl.detach()


async def concurrent_layerwise(size: int, device: torch.device) -> None:
    """Four threads forwarding one layerwise component inside one use (the diffusers adapter
    runs pipelines in worker threads): outputs exact, nothing in flight or left allocated
    after the use, and a sleep releases every byte."""
    import anyio.to_thread

    pipe = DemoPipeline.build(size)
    ctl = LifecycleController(device, residency="transformer=layerwise-offload",
                              prefetch_components=False)
    await ctl.attach(pipe)
    expected = pipe.forward_sync()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    base = allocated(device)
    outs: list[torch.Tensor] = []

    async def one() -> None:
        outs.append(await anyio.to_thread.run_sync(pipe.forward_sync))

    async with ctl.use("transformer"):
        for _ in range(5):
            async with anyio.create_task_group() as tg:
                for _ in range(4):
                    tg.start_soon(one)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    after_use = allocated(device)
    pending = ctl.strategy("transformer").store.pending_bytes
    await ctl.sleep()
    asleep = allocated(device)
    await ctl.wake()
    check("layerwise concurrent forwards", all(torch.equal(o, expected) for o in outs)
          and pending == 0 and (device.type != "cuda" or (after_use <= base and asleep < base)),
          forwards=len(outs), base=base, after_use=after_use, asleep=asleep, pending=pending)
    await ctl.detach()


def run_bench(which: str, args: list[str], timeout: int) -> None:
    """``residency bench <which> ... --json`` in a subprocess; its JSON joins the results."""
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "lifecycle", "bench", which, *args, "--json"],
                          capture_output=True, text=True, timeout=timeout)
    try:
        RESULTS[f"bench {which}"] = json.loads(done.stdout)
    except json.JSONDecodeError:
        RESULTS[f"bench {which}"] = {"stdout": done.stdout[-2000:], "stderr": done.stderr[-2000:]}
    print(f"{'PASS' if done.returncode == 0 else 'FAIL'}  residency bench {which} "
          f"{' '.join(args)} ({time.perf_counter() - t0:.0f} s)", flush=True)
    print(done.stdout[-4000:], flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="4GiB")
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args()
    configure_logging(json=True, level="warning")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    size = parse_size(args.size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    RESULTS["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    anyio.run(sleep_wake, size, device)
    anyio.run(layerwise, min(size, parse_size("2GiB")), device)
    anyio.run(concurrent_layerwise, min(size, parse_size("256MiB")), device)
    anyio.run(updates, min(size, parse_size("1GiB")), device, out / "ckpt")
    if not args.skip_bench:
        dev = ["--device", device.type]
        run_bench("sleep-wake", ["--size", args.size, "--repeats", "3", *dev], 300)
        run_bench("update", ["--size", "1GiB", "--repeats", "3", *dev], 300)
        run_bench("residency", ["--repeats", "5", *dev], 300)
    (out / "gpu_check.json").write_text(json.dumps(RESULTS, indent=2, default=str))
    failed = [k for k, v in RESULTS.items() if isinstance(v, dict) and v.get("pass") is False]
    print(f"{len(failed)} failed: {failed}" if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
