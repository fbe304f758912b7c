"""LoRA merges (``weight_update_mode="lora_merge"``): exact, without drift, transactional."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from lifecycle import InvalidRequest, LifecycleController, UpdateResult
from tests.helpers import faulty_device, small_pipeline

pytestmark = pytest.mark.anyio

PEFT = "base_model.model."


def adapter(target: str, rank: int, out: int, inp: int, seed: int, *,
            peft: bool = False) -> dict[str, torch.Tensor]:
    """A random LoRA pair for ``target``, named as PEFT names it (or plainly)."""
    gen = torch.Generator().manual_seed(seed)
    prefix, infix = (PEFT, ".default") if peft else ("", "")
    return {f"{prefix}{target}.lora_A{infix}.weight": torch.randn(rank, inp, generator=gen),
            f"{prefix}{target}.lora_B{infix}.weight": torch.randn(out, rank, generator=gen)}


def plain_merge(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float,
                rank: int) -> torch.Tensor:
    """The merge computed plainly in fp32, cast to the weight's dtype."""
    return (base.float() + (alpha / rank) * (b.float() @ a.float())).to(base.dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone()


async def merge(ctl: LifecycleController, named: dict[str, torch.Tensor], **kwargs: Any
                ) -> UpdateResult:
    return await ctl.update_weights_from_tensors(named, "transformer",
                                                 weight_update_mode="lora_merge", **kwargs)


def weight(module: nn.Module, index: int) -> torch.Tensor:
    assert isinstance(module, nn.Sequential)
    linear = module[index]
    assert isinstance(linear, nn.Linear)
    return linear.weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
async def test_a_merge_equals_the_plain_fp32_computation(dtype: torch.dtype) -> None:
    """Two linears merged from PEFT-named A/B (prefix, ``.default`` infix, or plain names)
    equal base + alpha/rank * B @ A computed in fp32 and cast; a missing lora_alpha means
    alpha = rank (scale 1)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(dtype)
    bases = [weight(module, 0).detach().clone(), weight(module, 2).detach().clone()]
    async with LifecycleController("cpu") as ctl:
        await ctl.attach({"transformer": module})
        named = adapter("0", 4, 32, 16, seed=1, peft=True) | adapter("2", 4, 16, 32, seed=2)
        result = await merge(ctl, named, lora_alpha=8.0, lora_rank=4, weight_version="step-1")
        assert (result.success, result.version, result.weight_version) == (True, 1, "step-1")
        a0, b0, a2, b2 = named.values()
        assert torch.equal(weight(module, 0), plain_merge(bases[0], a0, b0, 8.0, 4))
        assert torch.equal(weight(module, 2), plain_merge(bases[1], a2, b2, 8.0, 4))
        assert weight(module, 0).dtype == dtype
        assert (await merge(ctl, named)).success  # no lora_alpha, no lora_rank: scale 1
        assert torch.equal(weight(module, 0), plain_merge(bases[0], a0, b0, 4.0, 4))
        report = ctl.report()
        assert report.components["transformer"].lora_base_bytes == sum(b.nbytes for b in bases)
        assert report.lora_base_bytes == sum(b.nbytes for b in bases)


async def test_two_hundred_random_merges_then_a_zero_adapter_give_the_base_back_bit_for_bit(
        ) -> None:
    """Every merge starts from the kept base, so after 200 random merges a zero adapter
    gives the base back bit for bit, -0.0 included; a plain merge into the live weight
    would have drifted."""
    pipe = small_pipeline()
    with torch.no_grad():
        weight(pipe["transformer"], 0)[0, :3] = torch.tensor([-0.0, 0.0, 1e-30])
    base = bits(weight(pipe["transformer"], 0))
    async with LifecycleController("cpu", residency="transformer=component-offload") as ctl:
        await ctl.attach(pipe)
        drifting = weight(pipe["transformer"], 0).detach().clone()
        for step in range(200):
            named = adapter("0", 2, 32, 16, seed=step)
            named = {k: v * 1e-3 for k, v in named.items()}
            assert (await merge(ctl, named, lora_alpha=2.0, weight_version=str(step))).success
            a, b = named.values()
            drifting = plain_merge(drifting, a, b, 2.0, 2)
        zero = {"0.lora_A.weight": torch.zeros(2, 16), "0.lora_B.weight": torch.randn(32, 2)}
        assert (await merge(ctl, zero)).success
        assert torch.equal(bits(weight(pipe["transformer"], 0)), base)
        assert not torch.equal(bits(drifting), base)
        assert (ctl.weights_version, ctl.weight_version_label) == (201, "199")


async def test_a_full_update_replaces_the_base_and_the_next_merge_uses_it() -> None:
    """After a merge, a full-weight update of the same linear (tensors, then disk) makes the
    written weight the new base: a zero adapter gives it back, an adapter adds to it."""
    pipe = small_pipeline()
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(pipe)
        named = adapter("0", 4, 32, 16, seed=3)
        assert (await merge(ctl, named)).success
        new = torch.randn(32, 16)
        assert (await ctl.update_weights_from_tensors({"0.weight": new}, "transformer")).success
        assert torch.equal(weight(pipe["transformer"], 0), new)
        zero = {"0.lora_A.weight": torch.zeros(4, 16), "0.lora_B.weight": torch.ones(32, 4)}
        assert (await merge(ctl, zero)).success
        assert torch.equal(weight(pipe["transformer"], 0), new)
        assert (await merge(ctl, named)).success
        a, b = named.values()
        assert torch.equal(weight(pipe["transformer"], 0), plain_merge(new, a, b, 4.0, 4))


def refusals() -> list[tuple[dict[str, torch.Tensor], dict[str, Any], str]]:
    good = adapter("0", 4, 32, 16, seed=4)
    a, b = good.values()
    return [
        (good | {"2.weight": torch.zeros(16, 32)}, {},
         "weight_update_mode='lora_merge' takes only LoRA tensors named <linear>.lora_A.weight "
         "and <linear>.lora_B.weight (PEFT's 'base_model.model.' prefix and '.default' "
         "adapter accepted); 1 name(s) are not: ['2.weight']"),
        ({"0.lora_A.other.weight": a, "0.lora_B.other.weight": b}, {},
         "only PEFT's 'default' adapter can be merged, got adapter(s) ['other']"),
        (good | {f"{PEFT}0.lora_A.default.weight": a}, {},
         "LoRA tensor(s) given twice (with and without a prefix or adapter infix?): "
         "['base_model.model.0.lora_A.default.weight']"),
        ({"0.lora_A.weight": a}, {}, "LoRA A and B come in pairs: ['0 (lora_B missing)']"),
        (good | adapter("9", 4, 32, 16, seed=5), {},
         "1 LoRA target(s) match no linear weight of transformer (<target>.weight, 2-D): "
         "['9'] (1 other target(s) known: the payload is refused whole)"),
        ({"0.lora_A.weight": a, "0.lora_B.weight": torch.zeros(32, 3)}, {},
         "LoRA shapes do not fit: 0: A [4, 16] and B [32, 3] do not fit W [32, 16] "
         "(A must be [r, 16], B [32, r])"),
        ({"0.lora_A.weight": torch.zeros(4, 32), "0.lora_B.weight": b}, {},
         "LoRA shapes do not fit: 0: A [4, 32] and B [32, 4] do not fit W [32, 16]"),
        (good, {"lora_rank": 8},
         "LoRA shapes do not fit: 0: lora_rank=8 but the adapter has rank 4"),
        ({"0.lora_A.weight": a.to(torch.int32), "0.lora_B.weight": b}, {},
         "LoRA shapes do not fit: 0: A and B must be floating point"),
    ]


async def test_lora_refusals_name_the_fault_and_change_nothing() -> None:
    """Each faulty LoRA payload is refused whole before anything changes (weights, bases,
    version, label), with a message naming the fault and what is valid."""
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(small_pipeline())
        assert (await merge(ctl, adapter("2", 4, 16, 32, seed=6), weight_version="kept")).success
        sums = ctl.weights_checksum(algorithm="full")
        kept = ctl.report().lora_base_bytes
        for named, kwargs, message in refusals():
            result = await merge(ctl, named, **kwargs)
            assert (result.success, result.rolled_back) == (False, False)
            assert result.message.startswith(message), (result.message, message)
            assert result.message.endswith("nothing was updated")
            assert (ctl.weights_version, ctl.weight_version_label) == (1, "kept")
            assert result.weight_version == "kept"
            assert ctl.weights_checksum(algorithm="full") == sums
            assert ctl.report().lora_base_bytes == kept


async def test_malformed_lora_arguments_are_typed_errors() -> None:
    """A bad mode, rank, alpha or version label raises InvalidRequest naming the field."""
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(small_pipeline())
        named = adapter("0", 4, 32, 16, seed=7)
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"weight_update_mode": "merge"}, "weight_update_mode",
             "weight_update_mode must be one of ['full', 'lora_merge'], got 'merge'"),
            ({"weight_update_mode": "lora_merge", "lora_rank": 0}, "lora_rank",
             "lora_rank must be an integer >= 1, got 0"),
            ({"weight_update_mode": "lora_merge", "lora_alpha": math.nan}, "lora_alpha",
             "lora_alpha must be a finite number, got nan"),
            ({"weight_version": 3}, "weight_version", "weight_version must be a string, got int"),
        ]
        for kwargs, field, message in cases:
            with pytest.raises(InvalidRequest) as info:
                await ctl.update_weights_from_tensors(named, "transformer", **kwargs)
            assert (info.value.field, str(info.value)) == (field, message)
        assert ctl.weights_version == 0


@pytest.mark.parametrize("mode", ["resident", "component-offload"])
async def test_a_fault_at_every_copy_and_allocation_of_a_merge_rolls_back_weights_and_bases(
        mode: str) -> None:
    """For every k, failing the k-th copy or allocation of a merge leaves the weights and the
    kept bases as they were (a first merge keeps no base; a later one keeps the first's);
    a zero adapter afterwards still gives the pristine base back."""
    first, second = adapter("0", 4, 32, 16, seed=8), adapter("0", 4, 32, 16, seed=9)
    zero = {"0.lora_A.weight": torch.zeros(4, 16), "0.lora_B.weight": torch.ones(32, 4)}
    probe = faulty_device()
    async with LifecycleController(device_layer=probe, residency=f"transformer={mode}") as ctl:
        await ctl.attach(small_pipeline())
        copies, allocs = probe.copies, probe.allocations
        assert (await merge(ctl, first)).success
        points = {"copy": probe.copies - copies, "alloc": probe.allocations - allocs}
    assert points["copy"] >= 1 and points["alloc"] >= 1
    for kind, n in points.items():
        for k in range(1, n + 1):
            for earlier in ([], [first]):
                layer = faulty_device()
                async with LifecycleController(device_layer=layer,
                                               residency=f"transformer={mode}") as ctl:
                    pipe = small_pipeline()
                    base = bits(weight(pipe["transformer"], 0))
                    await ctl.attach(pipe)
                    for named in earlier:
                        assert (await merge(ctl, named)).success
                    sums = ctl.weights_checksum(algorithm="full")
                    kept = ctl.report().lora_base_bytes
                    layer.arm(**{f"{kind}_at": k})
                    result = await merge(ctl, second)
                    assert (result.success, result.rolled_back) == (False, True), (kind, k)
                    assert ctl.weights_checksum(algorithm="full") == sums, (kind, k)
                    assert ctl.report().lora_base_bytes == kept == (2048 if earlier else 0)
                    assert (await merge(ctl, zero)).success
                    assert torch.equal(bits(weight(pipe["transformer"], 0)), base), (kind, k)


async def test_bases_are_forgotten_at_detach() -> None:
    """Detach forgets the kept bases: the pipeline attached next starts from its own."""
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(small_pipeline())
        assert (await merge(ctl, adapter("0", 4, 32, 16, seed=10))).success
        assert ctl.report().lora_base_bytes == 32 * 16 * 4
        await ctl.detach()
        other = small_pipeline(seed=1)
        base = weight(other["transformer"], 0).detach().clone()
        await ctl.attach(other)
        assert ctl.report().lora_base_bytes == 0
        zero = {"0.lora_A.weight": torch.zeros(4, 16), "0.lora_B.weight": torch.ones(32, 4)}
        assert (await merge(ctl, zero)).success
        assert torch.equal(weight(other["transformer"], 0), base)
