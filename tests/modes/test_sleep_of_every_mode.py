"""Sleep and wake of every strategy: released, restored to each awake placement, reported."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lifecycle import LifecycleController
from tests.helpers import faulty_device
from tests.modes.strategy_suite import (
    LAYER_BYTES,
    NONLAYER_BYTES,
    OFFLOADED_MLP_BYTES,
    DiT,
    _one_intra_op_thread,  # noqa: F401 (an autouse fixture)
    mlp,
    x_in,
)

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


MIXED = ("image_encoder=resident,text_encoder=component-offload,vae=snapshot-offload,"
         "transformer=layerwise-offload")
AWAKE = {"image_encoder": 2176, "text_encoder": 0, "vae": 0, "transformer": NONLAYER_BYTES}


def mixed_pipeline() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    return {"image_encoder": mlp(), "text_encoder": mlp(), "vae": mlp(), "transformer": DiT()}


async def test_sleep_releases_every_strategy_and_wake_restores_each_awake_placement() -> None:
    """Sleep leaves no device byte in any mode (layerwise non-layer weights included); wake
    restores each mode's placement and the outputs are bit-identical."""
    pipe = mixed_pipeline()
    reference = copy.deepcopy(pipe)
    ctl = LifecycleController(device_layer=faulty_device(), residency=MIXED)
    await ctl.attach(pipe)

    def device() -> dict[str, int]:
        return {n: c.device_bytes for n, c in ctl.report().components.items()}

    assert device() == AWAKE
    for _ in range(2):
        assert (await ctl.sleep()).success
        assert device() == {"image_encoder": 0, "text_encoder": 0, "vae": 0, "transformer": 0}
        assert ctl.report().host_bytes == 2176 + 2 * OFFLOADED_MLP_BYTES + NONLAYER_BYTES + \
            6 * LAYER_BYTES
        assert (await ctl.wake()).success
        assert device() == AWAKE
        with torch.no_grad():
            for name in pipe:
                async with ctl.use(name) as module:
                    assert torch.equal(module(x_in()), reference[name](x_in()))
        assert device() == AWAKE


async def test_report_shows_the_mode_of_every_component_and_no_pinned_bytes_on_cpu() -> None:
    """The report names each component's mode; on the CPU layers no host byte is pinned
    (on the CUDA one, every host byte is)."""
    layer = faulty_device()
    ctl = LifecycleController(device_layer=layer, residency=MIXED)
    await ctl.attach(mixed_pipeline())
    report = ctl.report()
    assert {n: c.mode for n, c in report.components.items()} == {
        "image_encoder": "resident", "text_encoder": "component-offload",
        "vae": "snapshot-offload", "transformer": "layerwise-offload"}
    assert {n: c.total_bytes for n, c in report.components.items()} == {
        "image_encoder": 2176, "text_encoder": OFFLOADED_MLP_BYTES, "vae": OFFLOADED_MLP_BYTES,
        "transformer": NONLAYER_BYTES + 6 * LAYER_BYTES}
    if not layer.pinned:
        assert report.pinned_bytes == 0
        assert all(c.pageable_bytes == c.host_bytes for c in report.components.values())
    else:
        assert all(c.pinned_bytes >= c.host_bytes for c in report.components.values())
