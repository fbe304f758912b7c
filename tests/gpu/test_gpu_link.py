"""The link between host and device: one flat copy each way from page-locked memory (the
library's own mirror; on a GPU also torch's pinned memory), and the library's
``measure_link``, which the planner uses."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from strategies import CudaDevice
from tests.gpu.helpers import GpuRun, Recorder, link, measure_link

pytestmark = [pytest.mark.cuda, pytest.mark.anyio]


async def test_flat_pinned_copies_and_measure_link_move_bytes_exactly(
        gpu: GpuRun, cuda_layer: Callable[..., CudaDevice], record: Recorder) -> None:
    """A flat copy from a page-locked mirror to the device and back lands every byte
    exactly; its bandwidth each way (and torch's pinned copy's, on a GPU) and the library's
    ``measure_link`` rate and per-copy latency are recorded."""
    layer = cuda_layer()
    copy = await link(layer, gpu.real, gpu.sizes.link, gpu.sizes.repeats)
    rate, latency = await measure_link(layer, min(gpu.sizes.link, 256 * 2**20), 5)
    record(h2d_pinned_gbps=copy["h2d_gbps"], d2h_pinned_gbps=copy["d2h_gbps"],
           library_measure_link_gbps=rate / 1e9, library_copy_latency_us=latency * 1e6, **{
               k: v for k, v in copy.items() if k not in ("h2d_gbps", "d2h_gbps")})
    assert copy["exact"]
    assert rate > 0 and latency > 0
