"""Reserved device memory under layerwise offload, on the simulated GPU: the caching
allocator's reserved peak during generations of the demo pipeline with the transformer
streamed, against the strategy's bound (non-layer + (resident + prefetch + 1) x largest
layer), with the compute stream lagging the host.

    .venv/bin/python scripts/layerwise_reserved.py [--size 64MB] [--lag-ms 5] [--steps 4]
        [--layers N] [--generations 3] [--before] [--json]

``--before`` measures what the CUDA layer did before it allocated device buffers on the compute
stream: buffers allocated on the copy stream and freed with ``record_stream(compute)``, so that
a freed layer's block comes back only once the lagging compute stream passed its free, and a
prefetch copy not ordered after compute. Rows: torch's segment rules (2/20 MiB segments) and
exact segments (every block its own: reserved = the blocks held). Outputs are checked
bit-identical to the pipeline run without the library (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import anyio
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lifecycle import LifecycleController
from lifecycle._units import parse_size
from lifecycle.demo import DemoPipeline
from lifecycle.testing import SimCuda
from strategies import CudaDevice, LayerwiseOffloadStrategy
from strategies.devices import CopyPair, Stream, Tier


@contextmanager
def allocation_before_the_fix() -> Iterator[None]:
    """CudaDevice as it was: device buffers on the copy stream, recorded on the compute stream
    when handed to it, copies into the device not ordered after compute."""
    alloc, for_compute, enqueue = CudaDevice._alloc, CudaDevice.for_compute, CudaDevice._enqueue

    def old_alloc(self: CudaDevice, nbytes: int, tier: Tier, pinned: bool) -> torch.Tensor:
        if tier != "device":
            return alloc(self, nbytes, tier, pinned)
        with self.runtime.use_device(), self.runtime.use_stream(self.streams["device"]):
            return self.runtime.empty(nbytes)

    def old_for_compute(self: CudaDevice, buf: torch.Tensor) -> None:
        self.runtime.record_stream(buf, self.runtime.default_stream())

    def old_enqueue(self: CudaDevice, pairs: list[CopyPair], to: Tier
                    ) -> tuple[Any, Stream, BaseException | None]:
        stream = self.streams[to]
        if to == "device":  # only the compute-stream wait differed
            with self.runtime.use_device(), self.runtime.use_stream(stream):
                error = None
                try:
                    for dst, src in pairs:
                        self._copy_one(dst, src)
                except Exception as exc:
                    error = exc
                event = self.runtime.event()
                event.record(stream)
            return event, stream, error
        return enqueue(self, pairs, to)

    CudaDevice._alloc = old_alloc  # type: ignore[method-assign]
    CudaDevice.for_compute = old_for_compute  # type: ignore[method-assign]
    CudaDevice._enqueue = old_enqueue  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        CudaDevice._alloc = alloc  # type: ignore[method-assign]
        CudaDevice.for_compute = for_compute  # type: ignore[method-assign]
        CudaDevice._enqueue = enqueue  # type: ignore[method-assign]


async def measure(size: int, layers: int | None, lag: float, steps: int, generations: int,
                  exact: bool) -> dict[str, Any]:
    pipe = DemoPipeline.build(size, num_layers=layers)
    expected = pipe.forward_sync(steps=steps)
    gpu = SimCuda(max_lag=lag, exact_segments=exact)
    ctl = LifecycleController(device_layer=CudaDevice(torch.device("cpu"), gpu),
                              residency="transformer=layerwise-offload")
    await ctl.attach(pipe)
    strategy = ctl.strategy("transformer")
    assert isinstance(strategy, LayerwiseOffloadStrategy)
    ctl.reset_peak()
    mallocs = gpu.mallocs
    exact_out = True
    for _ in range(generations):
        exact_out &= torch.equal(await pipe.generate(ctl=ctl, steps=steps), expected)
    report = ctl.report()
    others = sum(c.device_bytes for n, c in report.components.items() if n != "transformer")
    bound = others + strategy.peak_bound()
    out = {"segments": "exact" if exact else "torch", "bound_bytes": bound,
           "reserved_peak_bytes": report.reserved_peak_bytes,
           "allocated_peak_bytes": report.allocator_peak_bytes,
           "library_peak_bytes": report.peak_device_bytes,
           "new_segments": gpu.mallocs - mallocs, "transformer_bytes": strategy.store.nbytes,
           "layers": len(strategy.layers), "exact": exact_out}
    await ctl.aclose()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="64MB")
    parser.add_argument("--layers", type=int, default=None, help="transformer layers")
    parser.add_argument("--lag-ms", type=float, default=5.0)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--generations", type=int, default=3)
    parser.add_argument("--before", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    for exact in (False, True):
        with allocation_before_the_fix() if args.before else nullcontext():
            rows.append(anyio.run(measure, parse_size(args.size), args.layers, args.lag_ms / 1e3,
                                  args.steps, args.generations, exact))
    if args.json:
        print(json.dumps({"before_fix": args.before, "rows": rows}, indent=2))
    else:
        print(f"{'segments':8} {'reserved peak':>14} {'bound':>12} {'ratio':>6} "
              f"{'allocated peak':>15} {'new segments':>12} exact")
        for r in rows:
            print(f"{r['segments']:8} {r['reserved_peak_bytes']:>14,} {r['bound_bytes']:>12,} "
                  f"{r['reserved_peak_bytes'] / r['bound_bytes']:>6.2f} "
                  f"{r['allocated_peak_bytes']:>15,} {r['new_segments']:>12} {r['exact']}")
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
