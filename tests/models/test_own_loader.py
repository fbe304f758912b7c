"""Updates through a component's own weight loader (SGLang's and vLLM's ``load_weights``
convention, vLLM's ``stacked_params_mapping``: a fused QKV filled from three checkpoint
tensors), or through a name mapping, on a real diffusers Flux transformer with its QKV
projections fused (``fuse_qkv_projections``) and a real transformers CLIP text encoder:
the same validation and rollback as any update, from tensors and from disk."""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

import diffusers
import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from lifecycle import LifecycleController
from lifecycle.testing import FaultInjection
from tests.helpers import faulty_device
from tests.models.zoo import CASES

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

FLUX, CLIP = CASES["flux"], CASES["clip_text"]
# (fused parameter, checkpoint part, shard): vLLM's stacked_params_mapping for Flux
STACKED = [("to_qkv", "to_q", 0), ("to_qkv", "to_k", 1), ("to_qkv", "to_v", 2),
           ("to_added_qkv", "add_q_proj", 0), ("to_added_qkv", "add_k_proj", 1),
           ("to_added_qkv", "add_v_proj", 2)]


class FusedFlux(diffusers.FluxTransformer2DModel):  # type: ignore[misc]
    """A Flux transformer whose attention runs fused QKV projections, loading unfused
    checkpoints through its own ``load_weights`` (what SGLang's and vLLM's models do)."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            for fused, part, shard in STACKED:
                if f".{part}." in name:
                    target = name.replace(f".{part}.", f".{fused}.")
                    param = params[target]
                    rows = param.shape[0] // 3
                    param.data[shard * rows:(shard + 1) * rows].copy_(tensor)
                    break
            else:
                target = name
                params[name].data.copy_(tensor)
            loaded.add(target)
        return loaded


def fused_flux(seed: int) -> nn.Module:
    model = FLUX.build(seed)
    model.fuse_qkv_projections()  # type: ignore[operator]
    model.__class__ = FusedFlux
    return model


def unfused(model: nn.Module) -> dict[str, torch.Tensor]:
    """A checkpoint of the unfused names (what a trainer holding the plain model sends)."""
    return {n: t.clone() for n, t in model.state_dict().items()
            if ".to_qkv." not in n and ".to_added_qkv." not in n}


def qkv_of_block_0(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t for n, t in unfused(model).items()
            if n.startswith("transformer_blocks.0.attn.") and
            any(f".{part}." in n for _, part, _ in STACKED)}


async def served(mode: str = "resident", layer: FaultInjection | None = None
                 ) -> tuple[LifecycleController, nn.Module]:
    model = fused_flux(0)
    ctl = LifecycleController(device_layer=layer or faulty_device(),
                              residency=f"transformer={mode}")
    await ctl.attach({"transformer": model})
    return ctl, model


async def output(ctl: LifecycleController) -> torch.Tensor:
    async with ctl.use("transformer") as module:
        return FLUX.run(module)


@pytest.mark.parametrize("mode", ["resident", "component-offload", "layerwise-offload"])
async def test_an_unfused_checkpoint_is_loaded_into_fused_qkv_through_the_models_loader(
        mode: str) -> None:
    """The trainer's unfused Flux tensors go through FusedFlux.load_weights: the fused
    projections get them (the output equals the unfused model's), the unused to_q/to_k/to_v
    stay as served, and the update is one new version."""
    ctl, model = await served(mode)
    trainer = FLUX.build(1)
    q_name = "transformer_blocks.0.attn.to_q.weight"
    kept_q = model.get_parameter(q_name).detach().clone()
    result = await ctl.update_weights_from_tensors(unfused(trainer), "transformer")
    assert result.success, result.message
    assert result.version == 1
    assert torch.equal(await output(ctl), FLUX.run(trainer))
    async with ctl.use("transformer"):
        assert torch.equal(model.get_parameter(q_name), kept_q)
    await ctl.aclose()


@pytest.mark.parametrize("mode", ["resident", "component-offload", "layerwise-offload"])
async def test_a_loader_writing_one_shard_keeps_the_served_values_of_the_others(mode: str) -> None:
    """A checkpoint of only block 0's to_q fills one third of the fused to_qkv; the loader
    starts from the served values wherever they live, so k and v stay."""
    ctl, model = await served(mode)
    new_q = torch.linspace(-1, 1, 16 * 16).reshape(16, 16)
    name = "transformer_blocks.0.attn.to_q.weight"
    assert model.get_parameter(name).shape == new_q.shape
    expected = copy.deepcopy(fused_flux(0))
    with torch.no_grad():
        expected.get_parameter("transformer_blocks.0.attn.to_qkv.weight")[:16].copy_(new_q)
    result = await ctl.update_weights_from_tensors({name: new_q}, "transformer")
    assert (result.success, result.message) == (
        True, "updated 1 tensor(s) of ['transformer'] to version 1")
    assert torch.equal(await output(ctl), FLUX.run(expected))
    await ctl.aclose()


def _raise_key(self: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    for name, _ in weights:
        raise KeyError(name)


def _wrong_shape(self: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    for _ in weights:
        pass
    self.get_parameter("transformer_blocks.0.attn.to_qkv.weight").data = torch.zeros(3, 3)


def _reads_one(self: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    next(iter(weights))


def _unknown_name(self: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
    list(weights)
    return {"no_such.weight"}


LOADER_FAULTS = {
    "raises": (_raise_key, "transformer.load_weights raised KeyError: "
                           "'transformer_blocks.0.attn.to_q.weight'; nothing was updated"),
    "wrong shape": (_wrong_shape, "Shape mismatch for transformer_blocks.0.attn.to_qkv.weight: "
                                  "model=(48, 16), loaded=(3, 3)"),
    "reads one": (_reads_one, "transformer.load_weights read 1 of the 12 tensors given; "
                              "nothing was updated"),
    "unknown name": (_unknown_name, "transformer.load_weights reports loading "
                                    "['no_such.weight'], which 'transformer' does not have; "
                                    "nothing was updated"),
}


@pytest.mark.parametrize("fault", list(LOADER_FAULTS))
async def test_a_loader_that_fails_or_misbehaves_refuses_the_update_and_changes_nothing(
        fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader that raises, reshapes a parameter, leaves tensors unread or reports a name
    the component lacks: the update is refused with the reason, the version, the checksum
    and the output stay."""
    ctl, _ = await served("component-offload")
    loader, message = LOADER_FAULTS[fault]
    monkeypatch.setattr(FusedFlux, "load_weights", loader)
    before = (ctl.weights_checksum(), await output(ctl))
    result = await ctl.update_weights_from_tensors(qkv_of_block_0(FLUX.build(1)), "transformer")
    assert (result.success, result.message, result.version) == (False, message, 0)
    after = (ctl.weights_checksum(), await output(ctl))
    assert after[0] == before[0] and torch.equal(after[1], before[1])
    await ctl.aclose()


async def test_a_fault_at_every_copy_and_allocation_of_the_loaders_write_rolls_it_back() -> None:
    """Failing the k-th copy (or allocation) of an update through the loader, for every k:
    rolled back, checksum and output as before; the retry applies it."""
    checkpoint = qkv_of_block_0(FLUX.build(1))
    probe = faulty_device()
    ctl, _ = await served("component-offload", probe)
    counts = probe.copies, probe.allocations
    assert (await ctl.update_weights_from_tensors(checkpoint, "transformer")).success
    points = {"copy": probe.copies - counts[0], "alloc": probe.allocations - counts[1]}
    expected = await output(ctl)
    await ctl.aclose()
    assert points["copy"] > 0
    for kind, n in points.items():
        for k in range(1, n + 1):
            layer = faulty_device()
            ctl, _ = await served("component-offload", layer)
            before = (ctl.weights_checksum(), await output(ctl))
            layer.arm(**{f"{kind}_at": k})
            result = await ctl.update_weights_from_tensors(checkpoint, "transformer")
            assert (result.success, result.rolled_back, layer.faults) == (False, True, 1)
            after = (ctl.weights_checksum(), await output(ctl))
            assert after[0] == before[0] and torch.equal(after[1], before[1])
            assert (await ctl.update_weights_from_tensors(checkpoint, "transformer")).success
            assert torch.equal(await output(ctl), expected)
            await ctl.aclose()


async def test_an_update_from_disk_goes_through_the_loader(tmp_path: Path) -> None:
    """<path>/transformer/*.safetensors of unfused names reach the fused projections."""
    ctl, _ = await served("layerwise-offload")
    trainer = FLUX.build(1)
    (tmp_path / "transformer").mkdir()
    save_file(unfused(trainer), str(tmp_path / "transformer" / "model.safetensors"))
    result = await ctl.update_weights_from_disk(tmp_path)
    assert result.success, result.message
    assert torch.equal(await output(ctl), FLUX.run(trainer))
    await ctl.aclose()


async def test_load_weights_false_writes_by_the_modules_own_names() -> None:
    """load_weights=False bypasses the loader: the unfused names then write to_q & co., not
    the fused projections the forward uses, so the output does not change."""
    ctl, model = await served()
    before = await output(ctl)
    checkpoint = qkv_of_block_0(FLUX.build(1))
    result = await ctl.update_weights_from_tensors(checkpoint, "transformer", load_weights=False)
    assert result.success
    assert torch.equal(await output(ctl), before)
    async with ctl.use("transformer"):
        name = "transformer_blocks.0.attn.to_q.weight"
        assert torch.equal(model.get_parameter(name), checkpoint[name])
    await ctl.aclose()


HF = "text_model."  # the prefix another checkpoint layout puts before every name


async def clip_served() -> tuple[LifecycleController, nn.Module]:
    model = CLIP.build(0)
    ctl = LifecycleController("cpu", residency="text_encoder=component-offload")
    await ctl.attach({"text_encoder": model})
    return ctl, model


@pytest.mark.parametrize("name_map", ["callable", "mapping"])
async def test_a_name_map_renames_a_checkpoint_into_the_modules_names(
        name_map: str, tmp_path: Path) -> None:
    """A checkpoint whose names differ (a prefix) loads with name_map, given as a callable
    or a mapping, from tensors and from disk; without it the names are refused."""
    trainer = CLIP.build(1)
    named = {f"{HF}{n}": t.clone() for n, t in trainer.state_dict().items()}
    mapping = {k: k.removeprefix(HF) for k in named}
    renames = (lambda n: n.removeprefix(HF)) if name_map == "callable" else mapping
    ctl, _ = await clip_served()
    refused = await ctl.update_weights_from_tensors(named, "text_encoder")
    assert not refused.success and "match no parameter or buffer" in refused.message
    result = await ctl.update_weights_from_tensors(named, "text_encoder", name_map=renames)
    assert result.success, result.message
    async with ctl.use("text_encoder") as module:
        assert torch.equal(CLIP.run(module), CLIP.run(trainer))
    await ctl.aclose()
    ctl, _ = await clip_served()
    (tmp_path / "text_encoder").mkdir()
    save_file(named, str(tmp_path / "text_encoder" / "model.safetensors"))
    assert (await ctl.update_weights_from_disk(tmp_path, name_map=renames)).success
    async with ctl.use("text_encoder") as module:
        assert torch.equal(CLIP.run(module), CLIP.run(trainer))
    await ctl.aclose()


async def test_asking_for_a_loader_a_module_lacks_or_a_clashing_map_is_refused() -> None:
    """load_weights=True on CLIP (which has none) and a name_map mapping two names onto one
    are refused with the reason, nothing written."""
    ctl, _ = await clip_served()
    sums = ctl.weights_checksum()
    named = dict(CLIP.build(1).state_dict())
    result = await ctl.update_weights_from_tensors(named, "text_encoder", load_weights=True)
    assert result.message == ("component 'text_encoder' (CLIPTextModel) defines no "
                              "load_weights(weights) to update it through")
    clash = await ctl.update_weights_from_tensors(named, "text_encoder",
                                                  name_map=lambda n: "final_layer_norm.weight")
    assert not clash.success
    assert clash.message.startswith("name_map maps both ")
    assert ctl.weights_checksum() == sums
    await ctl.aclose()
