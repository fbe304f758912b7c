"""The demo pipeline: sizes, determinism, shapes, and a sleep/wake round trip."""

from __future__ import annotations

import pytest
import torch

from lifecycle import LifecycleController
from lifecycle.demo import DemoPipeline, DiTBlock, TextEncoder, parse_size

MB = 2**20


@pytest.fixture(scope="module")
def small() -> DemoPipeline:
    return DemoPipeline.build(2 * MB, seed=3)


@pytest.mark.parametrize(("text", "expected"), [
    ("1000", 1000),
    ("0", 0),
    ("512k", 512_000),
    ("512KB", 512_000),
    ("4KiB", 4096),
    ("256MB", 256_000_000),
    ("256mb", 256_000_000),
    ("64MiB", 64 * 2**20),
    ("2GB", 2_000_000_000),
    ("1.5GiB", 3 * 2**29),
    ("1gib", 2**30),
    (" 3 MiB ", 3 * 2**20),
    ("100B", 100),
])
def test_parse_size_reads_decimal_and_binary_units(text: str, expected: int) -> None:
    """Decimal units are powers of 1000, binary ones powers of 1024, case-insensitively."""
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MB", "12 parsecs", "-1MB", "1..5GB", "1e6", "GiB2"])
def test_parse_size_rejects_malformed_sizes(text: str) -> None:
    """Anything but a number with an optional known unit is a ValueError naming the input."""
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


@pytest.mark.parametrize("size", [1 * MB, 16 * MB, 64 * MB])
def test_build_hits_the_byte_budget_within_a_quarter(size: int) -> None:
    """The weights take the requested bytes within 25%, most of them in the transformer."""
    pipe = DemoPipeline.build(size)
    assert 0.75 * size <= pipe.nbytes <= 1.25 * size
    transformer = sum(t.nbytes for t in pipe.modules["transformer"].parameters())
    assert transformer > 0.7 * pipe.nbytes


def test_build_has_components_blocks_buffers_and_a_tied_weight(small: DemoPipeline) -> None:
    """The pipeline carries the edge cases the library must handle."""
    assert sorted(small.modules) == ["text_encoder", "transformer", "vae"]
    text, dit = small.modules["text_encoder"], small.modules["transformer"]
    assert isinstance(text, TextEncoder)
    assert text.head.weight is text.embed.weight
    assert all(isinstance(b, DiTBlock) for b in dit.blocks)  # type: ignore[union-attr]
    buffers = dict(dit.named_buffers())
    assert {"pos_embed", "t_embed.freqs"} <= set(buffers)
    assert "pos_embed" in dit.state_dict() and "t_embed.freqs" not in dit.state_dict()


def test_build_honours_dtype_and_layer_count() -> None:
    """``dtype`` applies to the weights and ``num_layers`` fixes the block count."""
    pipe = DemoPipeline.build(MB, dtype=torch.bfloat16, num_layers=3)
    assert len(pipe.modules["transformer"].blocks) == 3  # type: ignore[arg-type]
    assert {p.dtype for m in pipe.modules.values() for p in m.parameters()} == {torch.bfloat16}


def test_same_seed_builds_identical_weights(small: DemoPipeline) -> None:
    """Two builds with the same size and seed have equal state dicts; another seed differs."""
    again = DemoPipeline.build(2 * MB, seed=3)
    other = DemoPipeline.build(2 * MB, seed=4)
    for name, module in small.modules.items():
        ours, theirs = module.state_dict(), again.modules[name].state_dict()
        assert list(ours) == list(theirs)
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    weight = "blocks.0.attn.qkv.weight"
    assert not torch.equal(small.modules["transformer"].state_dict()[weight],
                           other.modules["transformer"].state_dict()[weight])


@pytest.mark.anyio
async def test_generate_returns_a_finite_rgb_image(small: DemoPipeline) -> None:
    """The output is one 3 x 32 x 32 float32 image in [-1, 1]."""
    image = await small.generate(steps=2)
    assert image.shape == (1, 3, 32, 32)
    assert image.dtype == torch.float32
    assert bool(image.isfinite().all()) and float(image.abs().max()) <= 1.0


@pytest.mark.anyio
async def test_generate_is_deterministic_and_matches_forward_sync(small: DemoPipeline) -> None:
    """The same weights and seed give bit-identical images; another seed does not."""
    first = await small.generate(steps=2, seed=7)
    assert torch.equal(first, await small.generate(steps=2, seed=7))
    assert torch.equal(first, small.forward_sync(steps=2, seed=7))
    assert not torch.equal(first, await small.generate(steps=2, seed=8))


@pytest.mark.anyio
async def test_generate_is_bit_identical_across_sleep_and_wake() -> None:
    """A pipeline attached to a controller generates the same image after sleep and wake,
    including after its weights were marked dirty in place."""
    pipe = DemoPipeline.build(MB, seed=1)
    ctl = LifecycleController("cpu")
    await ctl.attach(pipe)
    before = await pipe.generate(ctl=ctl, steps=2)
    assert (await ctl.sleep()).sleeping
    assert not (await ctl.wake()).sleeping
    assert torch.equal(before, await pipe.generate(ctl=ctl, steps=2))
    with torch.no_grad():
        for p in pipe.modules["transformer"].parameters():
            p.add_(0)
    assert (await ctl.sleep()).bytes_moved > 0
    await ctl.wake()
    assert torch.equal(before, await pipe.generate(ctl=ctl, steps=2))
    await ctl.detach()
    assert torch.equal(before, await pipe.generate(steps=2))
