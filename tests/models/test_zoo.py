"""Smoke tests of the model zoo: every tiny real model builds, runs and is described as declared."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.models.zoo import CASES, ModelCase, flux_call_kwargs, plain_tensor_attributes, tiny_flux_pipeline

pytestmark = pytest.mark.moves

cases = pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))


def block_list(module: nn.Module, name: str) -> nn.ModuleList:
    blocks = module.get_submodule(name)
    assert isinstance(blocks, nn.ModuleList), f"{name} is a {type(blocks).__name__}"
    return blocks


@cases
def test_same_seed_builds_bit_identical_weights(case: ModelCase) -> None:
    """Two builds from one seed have equal state dicts, and another seed gives other weights."""
    first, second = case.build(0).state_dict(), case.build(0).state_dict()
    assert list(first) == list(second)
    assert all(torch.equal(first[k], second[k]) for k in first)
    other = case.build(1).state_dict()
    assert not all(torch.equal(first[k], other[k]) for k in first)


@cases
def test_forward_is_deterministic_and_finite(case: ModelCase) -> None:
    """A forward on the example inputs gives a finite tensor, the same one every time."""
    module = case.build(0)
    assert not module.training
    out = case.run(module)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    assert torch.equal(out, case.run(module))
    assert not torch.equal(out, case.run(module, seed=1))


@cases
def test_model_is_real_and_tiny(case: ModelCase) -> None:
    """The model is the library's own class and holds under 1 MiB of float32 parameters."""
    module = case.build(0)
    assert type(module).__module__.split(".")[0] == case.family
    params = list(module.parameters())
    assert all(p.dtype == torch.float32 for p in params)
    assert sum(p.numel() * p.element_size() for p in params) < 2**20


@cases
def test_declared_submodules_exist(case: ModelCase) -> None:
    """Each block list is a ModuleList of at least two blocks, the block is one of them and the leaf
    is a module without children that holds parameters."""
    module = case.build(0)
    lists = [block_list(module, name) for name in case.block_lists]
    assert all(len(blocks) >= 2 for blocks in lists)
    assert any(module.get_submodule(case.block) is blocks[0] for blocks in lists)
    leaf = module.get_submodule(case.leaf)
    assert not list(leaf.children())
    assert list(leaf.parameters(recurse=False))


@cases
def test_block_lists_run_in_declared_order(case: ModelCase) -> None:
    """A forward runs every block of every declared list once, the lists one after another in the
    declared order."""
    module = case.build(0)
    calls: list[tuple[int, int]] = []
    handles = [
        block.register_forward_pre_hook(lambda *_, key=(i, j): calls.append(key))
        for i, name in enumerate(case.block_lists)
        for j, block in enumerate(block_list(module, name))
    ]
    try:
        case.run(module)
    finally:
        for handle in handles:
            handle.remove()
    assert calls == sorted(calls)
    assert len(calls) == len(set(calls)) == len(handles)


@cases
def test_plain_tensor_attributes_are_as_declared(case: ModelCase) -> None:
    """Only Oobleck holds tensors outside its parameters and buffers: weight_norm's recomputed weights."""
    module = case.build(0)
    found = plain_tensor_attributes(module)
    assert len(found) == case.plain_tensors
    assert all(path.endswith(".weight") for path in found)
    case.run(module)
    assert len(plain_tensor_attributes(module)) == case.plain_tensors


def test_t5_encoder_keeps_its_tied_embedding() -> None:
    """T5's shared embedding and its encoder's token embedding are one parameter."""
    module = CASES["t5_encoder"].build(0)
    shared = module.get_parameter("shared.weight")
    assert module.get_parameter("encoder.embed_tokens.weight") is shared


def test_tiny_flux_pipeline_generates_deterministically() -> None:
    """The real FluxPipeline of tiny components generates the same finite 32x32 image for a seed."""
    pipe = tiny_flux_pipeline(0)
    image = pipe(**flux_call_kwargs(0)).images
    assert isinstance(image, torch.Tensor) and image.shape == (1, 3, 32, 32)
    assert torch.isfinite(image).all()
    assert torch.equal(image, pipe(**flux_call_kwargs(0)).images)
    assert torch.equal(image, tiny_flux_pipeline(0)(**flux_call_kwargs(0)).images)
    assert not torch.equal(image, pipe(**flux_call_kwargs(1)).images)
