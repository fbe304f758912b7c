"""Behaviours the peers' own tests expect (SGLang's diffusion memory managers, diffusers'
group offloading and hooks, vLLM's sleep mode), tried through our public API: each test
names the peer test whose scenario it plays."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from lifecycle import LifecycleController, WeightsDiscarded
from lifecycle.testing import FaultyDevice
from tests.models.zoo import _clip_config, _clip_inputs

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

MODES = ["resident", "component-offload", "snapshot-offload", "layerwise-offload"]


class ScalarBlock(nn.Module):
    """A block with a 0-d parameter and a 0-d integer buffer."""

    count: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.register_buffer("count", torch.tensor(3, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.lin(x) * self.gain + self.count
        return out


class EveryShape(nn.Module):
    """Tensors of every shape and of many dtypes: 0-d (float, bfloat16, int, bool), empty,
    complex, float8, beside ordinary weights, in two repeated blocks (layerwise streams them)."""

    half_scale: torch.Tensor
    flag: torch.Tensor
    nothing: torch.Tensor
    phase: torch.Tensor
    fp8: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([ScalarBlock(), ScalarBlock()])
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))
        self.register_buffer("half_scale", torch.tensor(0.5, dtype=torch.bfloat16))
        self.register_buffer("flag", torch.tensor(True))
        self.register_buffer("nothing", torch.empty(0, 4))
        self.register_buffer("phase", torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64))
        self.register_buffer("fp8", torch.tensor([0.5, -1.0], dtype=torch.float8_e4m3fn))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        extra = self.phase.real.sum() + self.fp8.float().sum() + self.nothing.sum()
        return x * self.logit_scale.exp() * self.half_scale.float() * self.flag + extra


def clip_model() -> transformers.CLIPModel:
    """transformers' CLIPModel (text and vision towers, 0-d ``logit_scale``), tiny, seeded."""
    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(hidden_size=16, intermediate_size=32, projection_dim=16,
                                           num_hidden_layers=2, num_attention_heads=2,
                                           image_size=8, patch_size=4)
    text = _clip_config()
    config = transformers.CLIPConfig(text_config=text.to_dict(),
                                     vision_config=vision.to_dict(), projection_dim=16)
    return transformers.CLIPModel(config).eval()


def clip_logits(model: nn.Module) -> torch.Tensor:
    pixels = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = model(input_ids=_clip_inputs(0)["input_ids"], pixel_values=pixels)
    return out.logits_per_image  # type: ignore[no-any-return]


# -- 1: a discarding sleep of 0-d tensors ---------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
async def test_a_discarding_sleep_takes_tensors_of_every_shape_and_dtype(mode: str) -> None:
    """vLLM's tests/basic_correctness/test_cumem.py::test_cumem_with_cudagraph (a sleep that
    discards what is tagged so): 0-d, empty, complex and float8 tensors are discarded, stale
    after the wake (forwards refused), and exact again once updated from the state dict."""
    model = EveryShape()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(x)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    async with LifecycleController(device_layer=FaultyDevice(), residency=f"m={mode}") as ctl:
        await ctl.attach({"m": model})
        result = await ctl.sleep(discard=True)
        assert result.success and result.discarded == ("m",)
        assert ctl.report().components["m"].device_bytes == 0
        assert model.logit_scale.shape == () and model.nothing.shape == (0, 4)
        await ctl.wake()
        assert ctl.stale == {"m": len(state)}
        with pytest.raises(WeightsDiscarded):
            async with ctl.use("m"):
                pass
        assert (await ctl.update_weights_from_tensors(state, "m")).success
        assert ctl.stale == {}
        async with ctl.use("m"):
            with torch.no_grad():
                assert torch.equal(model(x), expected)


@pytest.mark.parametrize("mode", ["resident", "component-offload"])
async def test_a_clip_model_with_its_scalar_logit_scale_sleeps_by_discarding(mode: str) -> None:
    """SGLang's post_training sleep/wake e2e (release with the weights dropped, then a refit):
    transformers' CLIPModel, whose ``logit_scale`` is a 0-d parameter, is discarded, woken
    stale and updated from its state dict: its logits are exact again."""
    model = clip_model()
    expected = clip_logits(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    async with LifecycleController(device_layer=FaultyDevice(), residency=f"clip={mode}") as ctl:
        await ctl.attach({"clip": model})
        assert (await ctl.sleep(discard=True)).success
        await ctl.wake()
        assert ctl.stale["clip"] == len(state)
        assert (await ctl.update_weights_from_tensors(state, "clip")).success
        async with ctl.use("clip"):
            assert torch.equal(clip_logits(model), expected)
