"""Detach gives the module back as it was found (its storages, their sizes, which tensors
share one), and attach copes with a module whose tensors were packed into one flat buffer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lifecycle import LifecycleController
from lifecycle.demo import DemoPipeline
from tests.models.zoo import CASES, build_deep

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


def _layout(module: nn.Module) -> list[tuple[str, int, int, int]]:
    """(name, storage index, storage bytes, byte offset) per tensor; storages numbered in
    order of first appearance, so equal layouts compare equal whatever the addresses."""
    index: dict[int, int] = {}
    out = []
    for name, t in [*module.named_parameters(remove_duplicate=False),
                    *module.named_buffers(remove_duplicate=False)]:
        st = t.untyped_storage()
        i = index.setdefault(st.data_ptr(), len(index))
        out.append((name, i, st.nbytes(), int(t.storage_offset()) * t.element_size()))
    return out


def _pack(module: nn.Module) -> torch.Tensor:
    """Put every parameter and buffer of ``module`` into one flat buffer (views into it), as
    flat-buffer offloading tools leave a module."""
    tensors = list({id(t): t for t in [*module.parameters(), *module.buffers()]}.values())
    sizes = [(t.nbytes + 255) // 256 * 256 for t in tensors]
    flat = torch.empty(sum(sizes), dtype=torch.uint8)
    offset = 0
    for t, size in zip(tensors, sizes, strict=True):
        view = flat[offset:offset + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        t.data = view
        offset += size
    return flat


@pytest.mark.parametrize("mode", ["component-offload", "layerwise-offload", "resident"])
async def test_detach_restores_the_storages_the_module_came_with(mode: str) -> None:
    """After detach every tensor views a storage of its own size again (tied weights still
    share one), not a flat mirror, and the module computes what it computed before."""
    pipe = DemoPipeline.build(2 * 2**20)
    before = {n: _layout(m) for n, m in pipe.modules.items()}
    expected = pipe.forward_sync(steps=3)
    ctl = LifecycleController("cpu", residency=f"transformer={mode},text_encoder={mode}")
    await ctl.attach(pipe)
    await pipe.generate(ctl=ctl)
    await ctl.sleep()
    await ctl.wake()
    await ctl.detach()
    assert {n: _layout(m) for n, m in pipe.modules.items()} == before
    assert torch.equal(pipe.forward_sync(steps=3), expected)


async def test_a_layerwise_controller_after_an_offload_one_streams_per_layer() -> None:
    """A Flux transformer detached by a component-offload controller is streamed layer by
    layer by the next, layerwise, controller (its idle device bytes are the non-layer ones,
    not the whole model)."""
    flux = CASES["flux"]
    module = build_deep("flux", 3)
    expected = flux.run(module)
    total = sum(t.nbytes for t in module.state_dict().values())
    first = LifecycleController("cpu", residency="transformer=component-offload")
    await first.attach({"transformer": module})
    async with first.use("transformer") as m:
        flux.run(m)
    await first.detach()
    second = LifecycleController("cpu", residency="transformer=layerwise-offload")
    await second.attach({"transformer": module})
    idle = second.report().device_bytes
    assert idle < total / 2
    second.reset_peak()
    async with second.use("transformer") as m:
        assert torch.equal(flux.run(m), expected)
    assert second.report().peak_device_bytes < total
    await second.detach()


async def test_a_module_packed_into_one_flat_buffer_streams_and_comes_back_flat() -> None:
    """A module whose tensors all view one flat buffer attaches per region (layerwise streams
    per layer), computes exactly, and detach gives one flat buffer back, laid out as before."""
    flux = CASES["flux"]
    module = build_deep("flux", 3)
    expected = flux.run(module)
    _pack(module)
    packed = _layout(module)
    assert len({i for _, i, _, _ in packed}) == 1
    total = packed[0][2]
    ctl = LifecycleController("cpu", residency="transformer=layerwise-offload")
    await ctl.attach({"transformer": module})
    assert ctl.report().device_bytes < total / 2  # layers went to the host, one by one
    async with ctl.use("transformer") as m:
        assert torch.equal(flux.run(m), expected)
    await ctl.sleep()
    await ctl.wake()
    await ctl.detach()
    assert _layout(module) == packed
    assert torch.equal(flux.run(module), expected)
