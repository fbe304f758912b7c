"""Regressions from real models: a state dict with tied names updates, two controllers in one
task keep their requests apart, and a weight_norm module's report adds up."""

from __future__ import annotations

import warnings

import anyio
import pytest
import torch
from torch import nn

from lifecycle import LifecycleController
from tests.helpers import fingerprints, small_pipeline

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


@pytest.mark.parametrize("mode", ["resident", "component-offload", "layerwise-offload"])
async def test_a_state_dict_listing_a_tied_tensor_under_both_names_updates(mode: str) -> None:
    """``update_weights_from_tensors(module.state_dict())`` works when the module has tied
    weights (T5's shared / embed_tokens pattern): both names carry the same value."""
    pipe = small_pipeline()
    async with LifecycleController("cpu", residency=f"text_encoder={mode}") as ctl, \
            LifecycleController("cpu") as reference:
        await ctl.attach(pipe)
        torch.manual_seed(1)
        source = small_pipeline(seed=1)["text_encoder"]
        state = source.state_dict()
        assert state["embed.weight"].data_ptr() == state["head.weight"].data_ptr()  # tied
        result = await ctl.update_weights_from_tensors(state, target_module="text_encoder")
        assert result.success, result.message
        await reference.attach({"text_encoder": source})
        assert ctl.weights_checksum(["text_encoder"]) == reference.weights_checksum()
        # Equal values given as separate tensors (a copy per name) are accepted too.
        copied = {k: v.clone() for k, v in state.items()}
        assert (await ctl.update_weights_from_tensors(copied, "text_encoder")).success


async def test_tied_names_with_different_values_are_refused_naming_both() -> None:
    """Two values for one tied tensor: refused, both names in the message, nothing written."""
    pipe = small_pipeline()
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(pipe)
        before = fingerprints(pipe)
        state = {k: v.clone() for k, v in pipe["text_encoder"].state_dict().items()}
        state["head.weight"] += 1
        result = await ctl.update_weights_from_tensors(state, target_module="text_encoder")
        assert not result.success
        assert result.message == (
            "text_encoder.embed.weight and text_encoder.head.weight are tied (one tensor) but "
            "are given different values; nothing was updated")
        assert fingerprints(pipe) == before and ctl.weights_version == 0


async def test_the_same_name_twice_is_still_refused() -> None:
    """A pair list naming one tensor twice under the same name is a mistake, not a tie."""
    pipe = small_pipeline()
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(pipe)
        w = pipe["transformer"].state_dict()["0.weight"]
        result = await ctl.update_weights_from_tensors([("0.weight", w), ("0.weight", w)])
        assert not result.success
        assert result.message == "tensor transformer.0.weight is given twice"


def two_controllers(same_names: bool) -> tuple[LifecycleController, dict[str, nn.Module],
                                               LifecycleController, dict[str, nn.Module]]:
    pa, pb = small_pipeline(0), small_pipeline(1)
    # Either every name equal, or only the first one (A's next component is not B's).
    names_b = ["text_encoder", "transformer", "vae"] if same_names else ["text_encoder", "dit", "dec"]
    pb = dict(zip(names_b, pb.values(), strict=True))
    a = LifecycleController("cpu", residency="all=component-offload")
    b = LifecycleController("cpu", residency="all=component-offload")
    return a, pa, b, pb


def prefetching(ctl: LifecycleController) -> list[str]:
    return [n for n, c in ctl._components.items() if c.prefetch is not None]


@pytest.mark.parametrize("same_names", [True, False], ids=["same-names", "other-names"])
@pytest.mark.parametrize("outer", ["a", "b"])
async def test_a_request_belongs_to_its_controller(same_names: bool, outer: str) -> None:
    """A use of controller B inside a request of controller A (and the other way round) runs
    normally: B never sees A's request, A's prefetch still works, nothing leaks."""
    a, pa, b, pb = two_controllers(same_names)
    await a.attach(pa)
    await b.attach(pb)
    if outer == "b":
        a, pa, b, pb = b, pb, a, pa
    order_a = list(pa)
    first_b = next(iter(pb))
    x = torch.arange(4).reshape(1, 4)
    async with a.request(order_a):
        # B's first component has the name of A's first: B must not act on A's request.
        async with b.use(first_b) as module:
            assert prefetching(b) == [] and prefetching(a) == []
            assert b.in_flight == 1 and a.in_flight == 1  # B's use; A's request
            assert module(x).shape[-1] == 32
        async with a.use(order_a[0]):
            # A's request prefetches its next component (lease held) while the first runs.
            with anyio.fail_after(5):
                while a.in_flight < 3:  # the request, the use, the prefetch
                    await anyio.sleep(0.001)
            async with b.use(first_b) as module:
                assert prefetching(b) == []  # B is in no request: no prefetch of its own
                assert b.in_flight == 1
                assert module(x).shape[-1] == 32
            async with b.request(list(pb)), b.use(first_b):
                pass  # B's own request inside A's: B's prefetch runs in B's request
        async with a.use(order_a[1]):
            pass
    assert a.in_flight == b.in_flight == 0
    assert prefetching(a) == prefetching(b) == []
    assert a.report().device_bytes == b.report().device_bytes == 0


def normed_vocoder() -> nn.Sequential:
    """weight_norm and spectral_norm layers (a vocoder's): their ``weight`` is recomputed from
    the parameters before every forward, so it is held on the device but stored nowhere."""
    torch.manual_seed(0)
    with warnings.catch_warnings():  # (torch deprecates this weight_norm for another one)
        warnings.simplefilter("ignore", FutureWarning)
        conv = nn.utils.weight_norm(nn.Conv1d(16, 16, 3, padding=1))
    return nn.Sequential(conv, nn.utils.spectral_norm(nn.Linear(16, 16)), nn.Linear(16, 8))


@pytest.mark.parametrize("mode", ["resident", "component-offload"])
async def test_a_placed_weight_norm_component_holds_its_total_and_asleep_its_stored_bytes(
        mode: str) -> None:
    """The recomputed weights count in the device bytes and in the total alike: a placed
    component (resident and idle, or in a use) holds exactly its total; asleep, the host holds
    the total less the recomputed weights (they are computed again, never copied)."""
    derived = 16 * 16 * 3 * 4 + 16 * 16 * 4  # the conv's and the linear's float32 weights
    async with LifecycleController("cpu", residency=f"vocoder={mode}") as ctl:
        await ctl.attach({"vocoder": normed_vocoder()})
        total = ctl.report().components["vocoder"].total_bytes
        async with ctl.use("vocoder"):
            assert ctl.report().components["vocoder"].device_bytes == total
        if mode == "resident":
            assert ctl.report().components["vocoder"].device_bytes == total
        await ctl.sleep()
        asleep = ctl.report().components["vocoder"]
        assert (asleep.device_bytes, asleep.host_bytes, asleep.total_bytes) == (
            0, total - derived, total)
