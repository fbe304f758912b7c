"""Tensors that are neither parameters nor buffers (rotary tables, caches, weight_norm's
recomputed weight) are released on sleep and restored on wake like buffers, or refused by
name when they cannot be."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lifecycle import LifecycleController, Phase, TransitionRejected
from strategies import StoreError
from tests.helpers import device_tier_storages
from tests.strategies.device_modules import in_device_memory

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

D = 8
MODES = ["resident", "component-offload", "snapshot-offload"]


def weight_normed_conv() -> nn.Conv1d:
    with warnings.catch_warnings():  # older torch warns that weight_norm is deprecated
        warnings.simplefilter("ignore", FutureWarning)
        return torch.nn.utils.weight_norm(nn.Conv1d(D, D, 3, padding=1))


class Cached(nn.Module):
    """Weights, and tensors kept as plain attributes of every kind real models use."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.table = torch.randn(D)
        self._hidden = torch.randn(D)
        self.tables = [torch.randn(D), torch.randn(D)]
        self.cache = {"cos": torch.randn(D), "sin": torch.randn(D)}
        self.pair = (torch.randn(D), torch.randn(D))
        self.alias = self.lin.weight.detach()[0]  # a view of a parameter's storage
        self.conv = weight_normed_conv()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x) * self.table + self._hidden + self.tables[0] - self.tables[1]
        h = h * self.cache["cos"] + self.cache["sin"] * self.pair[0] + self.pair[1] + self.alias
        return self.conv(h.unsqueeze(-1).expand(-1, -1, 4)).sum(-1)  # type: ignore[no-any-return]


def built() -> tuple[dict[str, nn.Module], Cached]:
    """The model to attach, and an identical one (same seed) nobody touches."""
    torch.manual_seed(0)
    model = Cached().eval()
    torch.manual_seed(0)
    return {"dit": model}, Cached().eval()


def dit(pipe: dict[str, nn.Module]) -> Cached:
    """The pipeline's one component, typed as what ``built`` put there."""
    model = pipe["dit"]
    assert isinstance(model, Cached)
    return model


def x_in() -> torch.Tensor:
    return torch.linspace(-1, 1, 2 * D).reshape(2, D)


@pytest.mark.parametrize("mode", MODES)
async def test_attribute_tensors_are_released_on_sleep_and_restored_bit_identically(
        mode: str) -> None:
    """After sleep nothing the pipeline reaches holds device-tier bytes (by an independent
    scan), the report agrees, and wake gives back the very same attribute tensors with the
    same bytes; outputs equal the untouched copy's over several cycles."""
    pipe, reference = built()
    model = dit(pipe)
    ids = {"table": id(model.table), "hidden": id(model._hidden), "tables0": id(model.tables[0]),
           "cos": id(model.cache["cos"]), "pair1": id(model.pair[1])}
    values = {"table": model.table.clone(), "cos": model.cache["cos"].clone()}
    ctl = LifecycleController("cpu", residency=f"dit={mode}")
    await ctl.attach(pipe)
    with torch.no_grad():
        expected = reference(x_in())
    for _ in range(3):
        async with ctl.use("dit"):
            with torch.no_grad():
                assert torch.equal(model(x_in()), expected)
        assert (await ctl.sleep()).success
        assert device_tier_storages(pipe, ctl) == {}
        assert ctl.report().device_bytes == 0
        assert model.conv.weight.numel() == 0  # weight_norm's derived weight is released
        assert (await ctl.wake()).success
        assert {"table": id(model.table), "hidden": id(model._hidden),
                "tables0": id(model.tables[0]), "cos": id(model.cache["cos"]),
                "pair1": id(model.pair[1])} == ids
        assert torch.equal(model.table, values["table"])
        assert torch.equal(model.cache["cos"], values["cos"])
    async with ctl.use("dit"):
        with torch.no_grad():
            assert torch.equal(model(x_in()), expected)
        # While in use the report counts exactly what the scan finds on the device tier.
        assert ctl.report().device_bytes == sum(device_tier_storages(pipe, ctl).values())


async def test_the_recomputed_weight_norm_weight_is_back_after_wake_outside_forward() -> None:
    """A read of weight_norm's ``weight`` after wake (no forward yet) sees the right value."""
    pipe, reference = built()
    ctl = LifecycleController("cpu")
    await ctl.attach(pipe)
    await ctl.sleep()
    await ctl.wake()
    assert torch.equal(dit(pipe).conv.weight, reference.conv.weight)


async def test_an_attribute_recreated_while_offloaded_refuses_sleep_naming_it() -> None:
    """A cache a forward re-created on the device while the component is offloaded cannot be
    taken back safely: sleep is refused naming the attribute, and nothing moves."""
    pipe, _ = built()
    model = dit(pipe)
    ctl = LifecycleController("cpu", residency="dit=component-offload")
    await ctl.attach(pipe)
    async with ctl.use("dit"):
        model.table = model.table * 2  # a new tensor, behind the controller's back
    with pytest.raises(TransitionRejected, match=r"while offloaded: table: replaced;"):
        await ctl.sleep()
    assert ctl.phase is Phase.AWAKE


async def test_a_resident_component_whose_attribute_was_recreated_is_taken_inventory_of() -> None:
    """Resident: the re-created attribute is found at the next sleep and released too."""
    pipe, _ = built()
    model = dit(pipe)
    ctl = LifecycleController("cpu")
    await ctl.attach(pipe)
    # (Made by compute, in the device memory compute makes it in on a GPU.)
    model.cache["cos"] = in_device_memory(model.cache["cos"] + 1, ctl.device_layer)
    assert (await ctl.sleep()).success
    assert device_tier_storages(pipe, ctl) == {}


async def test_an_inference_tensor_attribute_is_refused_at_attach_by_name() -> None:
    """An attribute made under inference_mode cannot be re-pointed later: attach refuses it,
    naming the attribute, before anything moves."""
    pipe, _ = built()
    with torch.inference_mode():
        pipe["dit"]._rope = torch.ones(D)
    ctl = LifecycleController("cpu")
    with pytest.raises(StoreError, match=r"^tensor attribute \(neither parameter nor buffer\) "
                                         r"'_rope' of component 'dit' is an inference tensor"):
        await ctl.attach(pipe)
    assert ctl.phase is Phase.UNINITIALIZED


async def test_an_update_recomputes_the_weight_norm_weight_from_the_new_values() -> None:
    """After an update of weight_g / weight_v, ``weight`` read outside a forward is the one
    the new values give, not a stale one."""
    pipe, _ = built()
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(pipe)
        torch.manual_seed(1)
        other = Cached()
        result = await ctl.update_weights_from_tensors(other.state_dict(), target_module="dit")
        assert result.success, result.message
        assert torch.equal(dit(pipe).conv.weight, other.conv.weight)
