"""Adjacent uses of one component within a request share one move (SGLang keeps a component
warm across adjacent stages: its component residency manager's finish-request hook): a
real CLIP text encoder used twice in a row before a real Flux transformer is moved in once
and out once, and gives the same outputs as when it moves every time."""

from __future__ import annotations

import pytest
import torch

from lifecycle import LifecycleController
from lifecycle.testing import FaultInjection
from tests.helpers import faulty_device
from tests.models.zoo import CASES

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

CLIP, FLUX = CASES["clip_text"], CASES["flux"]
# Layerwise offload streams its layers in every forward whatever the use (its resident
# layers are what stays): the whole-component modes are the ones whose move is shared.
MODES = ["component-offload", "snapshot-offload"]


async def served(mode: str, prefetch_components: bool = False
                 ) -> tuple[LifecycleController, FaultInjection]:
    layer = faulty_device()
    ctl = LifecycleController(device_layer=layer, prefetch_components=prefetch_components,
                              residency=f"text_encoder={mode},transformer=component-offload")
    await ctl.attach({"text_encoder": CLIP.build(0), "transformer": FLUX.build(0)})
    return ctl, layer


async def generate(ctl: LifecycleController, order: list[str]) -> list[torch.Tensor]:
    """One request: each named component used in turn, its output kept."""
    out = []
    async with ctl.request(order):
        for name in order:
            async with ctl.use(name) as module:
                out.append((CLIP if name == "text_encoder" else FLUX).run(module))
    return out


@pytest.mark.parametrize("mode", MODES)
async def test_two_adjacent_uses_copy_what_one_use_copies(mode: str) -> None:
    """["text_encoder", "text_encoder", "transformer"] makes exactly the copies of
    ["text_encoder", "transformer"] (the second use moves nothing), with the same outputs."""
    once, once_layer = await served(mode)
    twice, twice_layer = await served(mode)
    attached = once_layer.copies
    first = await generate(once, ["text_encoder", "transformer"])
    second = await generate(twice, ["text_encoder", "text_encoder", "transformer"])
    assert twice_layer.copies - attached == once_layer.copies - attached > 0
    assert torch.equal(second[0], first[0]) and torch.equal(second[1], first[0])
    assert torch.equal(second[2], first[1])
    for ctl in (once, twice):
        assert ctl.report().components["text_encoder"].device_bytes == 0
        assert ctl.in_flight == 0
        await ctl.aclose()


async def test_the_component_stays_placed_between_adjacent_uses_and_leaves_after() -> None:
    """Between the two uses the text encoder is whole on the device and holds a lease; after
    the second it goes back to the host like any use."""
    ctl, layer = await served("component-offload")
    size = ctl.report().components["text_encoder"].total_bytes
    async with ctl.request(["text_encoder", "text_encoder", "transformer"]):
        async with ctl.use("text_encoder"):
            pass
        assert ctl.report().components["text_encoder"].device_bytes == size
        assert ctl.in_flight == 2  # the request's lease and the kept component's
        copies = layer.copies
        async with ctl.use("text_encoder") as module:
            assert layer.copies == copies
            CLIP.run(module)
        assert ctl.report().components["text_encoder"].device_bytes == 0
    assert ctl.in_flight == 0
    await ctl.aclose()


async def test_a_request_that_ends_before_the_second_use_moves_the_kept_component_out() -> None:
    """A body that stops after the first of two adjacent uses (an error) leaves nothing on
    the device and no lease behind."""
    ctl, _ = await served("component-offload")
    with pytest.raises(LookupError, match="stopped"):
        async with ctl.request(["text_encoder", "text_encoder", "transformer"]):
            async with ctl.use("text_encoder"):
                pass
            raise LookupError("stopped")
    assert ctl.report().components["text_encoder"].device_bytes == 0
    assert ctl.in_flight == 0
    assert (await ctl.sleep()).success
    await ctl.aclose()


async def test_a_sleep_between_adjacent_uses_releases_the_kept_component() -> None:
    """A transition started between the two uses (by the request's own task) drains the
    kept component like a prefetch: the sleep releases every device byte."""
    ctl, _ = await served("component-offload", prefetch_components=True)
    async with ctl.request(["text_encoder", "text_encoder", "transformer"]):
        async with ctl.use("text_encoder"):
            pass
        assert (await ctl.sleep()).success
        assert ctl.report().device_bytes == 0
        assert (await ctl.wake()).success
        async with ctl.use("text_encoder") as module:
            assert torch.equal(CLIP.run(module), CLIP.run(CLIP.build(0)))
    assert ctl.in_flight == 0
    await ctl.aclose()
