"""A real ``diffusers.FluxPipeline`` (tiny components, tokenizers built locally) attached
through its ``.components`` and run through its own ``__call__`` under the controller."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch

from lifecycle import ComponentAsleep, ComponentNotPlaced, LifecycleController
from lifecycle.adapters import PipelineRunner
from strategies import layerwise_blocks
from tests.helpers import device_tier_storages
from tests.models.zoo import flux_call_kwargs, tiny_flux_pipeline

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

RESIDENCY = {
    "resident": "",
    "offloaded": "transformer=layerwise-offload,text_encoder=component-offload,"
                 "text_encoder_2=snapshot-offload,vae=component-offload",
    "all-layerwise": "all=layerwise-offload",
}


@functools.cache
def plain_image(seed: int) -> torch.Tensor:
    """The pipeline's output without a controller (weights from ``seed``)."""
    return tiny_flux_pipeline(seed)(**flux_call_kwargs()).images  # type: ignore[no-any-return]


def image(output: Any) -> torch.Tensor:
    return output.images  # type: ignore[no-any-return]


def modules_of(pipe: Any) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}


@pytest.mark.parametrize("residency", list(RESIDENCY))
async def test_flux_pipeline_generates_the_same_image_under_the_controller(residency: str) -> None:
    """Through the runner the pipeline's own __call__ gives the plain pipeline's image, before
    a sleep and after each wake; asleep, nothing reaches device bytes and a direct call is
    refused; the transformer streams both of its block lists."""
    pipe = tiny_flux_pipeline(0)
    ctl = LifecycleController("cpu", residency=RESIDENCY[residency])
    runner = await PipelineRunner.attach(pipe, ctl)
    assert set(ctl.components) == {"transformer", "vae", "text_encoder", "text_encoder_2"}
    if residency != "resident":
        assert layerwise_blocks(pipe.transformer) == ("transformer_blocks",
                                                      "single_transformer_blocks")
    assert torch.equal(image(await runner(**flux_call_kwargs())), plain_image(0))
    for _ in range(2):
        assert (await ctl.sleep()).success
        assert ctl.report().device_bytes == 0
        assert device_tier_storages(modules_of(pipe), ctl) == {}
        with pytest.raises(ComponentAsleep):
            pipe(**flux_call_kwargs())
        with pytest.raises(ComponentAsleep):
            await runner(**flux_call_kwargs())
        assert (await ctl.wake()).success
        assert torch.equal(image(await runner(**flux_call_kwargs())), plain_image(0))
    if residency == "offloaded":
        with pytest.raises(ComponentNotPlaced):
            pipe(**flux_call_kwargs())  # offloaded text encoders are not placed outside use()
    else:
        assert torch.equal(image(pipe(**flux_call_kwargs())), plain_image(0))


async def test_a_whole_saved_pipeline_folder_updates_every_component(tmp_path: Path) -> None:
    """``FluxPipeline.save_pretrained`` output (one folder per component, tokenizers and
    scheduler beside them) updates all four models to the saved pipeline, by image and by
    checksum; a folder missing one target refuses and changes nothing."""
    other = tiny_flux_pipeline(1)
    other.save_pretrained(tmp_path / "saved")
    pipe = tiny_flux_pipeline(0)
    ctl = LifecycleController("cpu", residency=RESIDENCY["offloaded"])
    runner = await PipelineRunner.attach(pipe, ctl)
    before = ctl.weights_checksum()
    refused = await ctl.update_weights_from_disk(tmp_path / "saved",
                                                 target_modules=["transformer", "tokenizer"])
    assert not refused.success and ctl.weights_checksum() == before
    result = await ctl.update_weights_from_disk(tmp_path / "saved")
    assert result.success, result.message
    assert set(result.updated) == {"transformer", "vae", "text_encoder", "text_encoder_2"}
    assert torch.equal(image(await runner(**flux_call_kwargs())), plain_image(1))
    reference = LifecycleController("cpu")
    await reference.attach(modules_of(other))
    assert ctl.weights_checksum() == reference.weights_checksum()
