"""Regrouping a store into another shape (strategies._regroup), no controller: a new store
over the old one's storages, placed by a move that copies only what must move, undone without
a trace at any failure; and restoring, at detach, the storages the module came with."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch import nn

from lifecycle.testing import FaultInjection, InjectedFault
from strategies import DeviceLayer, StoreError
from strategies.protocol import (
    TensorStore,
    Unit,
    forget_locals,
    needs_restore,
    prepare_discard,
    prepare_regroup,
    prepare_restore,
    prepare_undiscard,
)
from tests.helpers import TiedLM
from tests.strategies.device_modules import device_store

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

LAYERS = ["blocks.0", "blocks.1", "blocks.2"]


def values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in module.state_dict(keep_vars=True).items()}


def same(module: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = values(module)
    return now.keys() == before.keys() and all(torch.equal(now[n], before[n]) for n in now)


def shape(store: TensorStore) -> list[tuple[str, str]]:
    return [(u.key, u.where) for u in store.units]


# Shapes a store can take (as the residency modes make them): every storage its own unit, the
# whole component one unit, one unit per layer.
SHAPES: dict[str, Callable[[TensorStore], TensorStore]] = {
    "per storage": lambda old: TensorStore(old.name, old.module, old.layer, layout=old),
    "whole": lambda old: TensorStore(old.name, old.module, old.layer, whole=True, layout=old),
    "layers": lambda old: TensorStore(old.name, old.module, old.layer, LAYERS, layout=old),
}


async def regrouped(old: TensorStore, into: str, on_device: Callable[[TensorStore], Sequence[Unit]]
                    ) -> TensorStore:
    new = SHAPES[into](old)
    (await prepare_regroup(old, new, on_device(new))).commit()
    return new


def everything(store: TensorStore) -> list[Unit]:
    return list(store.units)


def nothing(store: TensorStore) -> list[Unit]:
    return []


def not_layers(store: TensorStore) -> list[Unit]:
    return [u for u in store.units if u.key not in LAYERS]


@pytest.mark.parametrize("into", list(SHAPES))
async def test_a_regroup_keeps_every_value_and_places_each_new_unit(
        layer: DeviceLayer, into: str) -> None:
    """From per-storage units on the device into each shape, half on the host, and back: the
    same tensor objects and values, each unit where it was asked to be."""
    lm = TiedLM()
    before, params = values(lm), list(lm.parameters())
    store = device_store("lm", lm, layer)
    store = await regrouped(store, into, not_layers)
    assert all(u.where == ("host" if u.key in LAYERS else "device") for u in store.units)
    assert same(lm, before) and list(lm.parameters()) == params
    store = await regrouped(store, "per storage", everything)
    assert all(u.where == "device" for u in store.units)
    assert same(lm, before) and lm.head.weight is lm.embed.weight


async def test_the_new_store_sees_the_storages_the_module_came_with(layer: DeviceLayer) -> None:
    """After a whole-component placement every tensor views one flat buffer; a store regrouped
    from it still has the module's own storages (the view with its weight) as units."""
    lm = TiedLM()
    whole = await regrouped(device_store("lm", lm, layer), "whole", nothing)
    assert [u.key for u in whole.units] == ["(component)"]
    again = await regrouped(whole, "per storage", everything)
    assert [u.key for u in again.units] == [u.key for u in device_store("x", TiedLM(), layer).units]
    assert [s.names for s in again.slot_named("first_row")[1].slot_list] == [
        ["first_row"], ["embed.weight", "head.weight"]]


async def test_units_that_keep_their_storages_and_tier_are_carried_over_without_a_copy(
        layer: DeviceLayer) -> None:
    """Regrouped into layers with the layers on the device, the storages outside them keep
    their units and buffers: only the layers' storages are copied into their new buffers;
    regrouped into the same shape again, nothing is copied."""
    lm = TiedLM()
    store = device_store("lm", lm, layer)
    new = SHAPES["layers"](store)
    move = await prepare_regroup(store, new, everything(new))
    move.commit()
    assert move.bytes_copied == sum(st.nbytes for k in LAYERS for st in new.by_key[k].storages) \
        == 3 * (64 + 64 + 1024 + 64)
    again = SHAPES["layers"](new)
    move = await prepare_regroup(new, again, everything(again))
    move.commit()
    assert move.bytes_copied == 0


@pytest.mark.parametrize("into", ["whole", "layers"])
async def test_a_regroup_failing_at_any_copy_or_allocation_leaves_the_old_store_as_it_was(
        faulty: Callable[..., FaultInjection], into: str) -> None:
    """Whichever copy or allocation of a regroup fails, the old store and the module are as
    before (placement, values, report, nothing pending) and, the failure's frames forgotten,
    no new device buffer is alive."""
    for kind in ("copy", "alloc"):
        k = 0
        while True:
            k += 1
            layer = faulty()
            lm = TiedLM()
            before = values(lm)
            old = await regrouped(device_store("lm", lm, layer), "per storage", not_layers)
            report, placement, live = old.report(), shape(old), layer.live_device_bytes
            new = SHAPES[into](old)
            layer.arm(**{f"{kind}_at": k})
            try:
                move = await prepare_regroup(old, new, not_layers(new))
            except InjectedFault as exc:
                forget_locals(exc)
            else:
                move.commit()
                break
            assert (old.report(), shape(old), old.pending_bytes) == (report, placement, 0)
            assert same(lm, before) and layer.live_device_bytes == live
        assert k > 1 and same(lm, before)


async def test_stale_tensors_stay_stale_in_the_regrouped_store(layer: DeviceLayer) -> None:
    """Tensors a discarding sleep dropped (stale after the wake) are stale in a store
    regrouped from it too."""
    store = device_store("lm", TiedLM(), layer)
    move = await prepare_discard(store, everything=False)
    assert move is None
    move = await prepare_discard(store, everything=True)
    assert move is not None
    move.commit()
    (await prepare_undiscard(store, everything(store))).commit()
    stale = store.stale_names()
    new = await regrouped(store, "whole", everything)
    assert new.stale_names() == stale and new.stale_count == len(stale) == 15


async def test_a_module_changed_since_attach_cannot_be_regrouped(layer: DeviceLayer) -> None:
    """A tensor replaced behind the store: a new store over the old layout is refused."""
    lm = TiedLM()
    store = device_store("lm", lm, layer)
    linear = lm.get_submodule("blocks.0.1")
    assert isinstance(linear, nn.Linear)
    linear.bias = nn.Parameter(torch.zeros(16))
    with pytest.raises(StoreError, match="component 'lm' changed structure since it was attached"):
        SHAPES["whole"](store)


async def test_a_restore_gives_the_module_its_own_storages_back(layer: DeviceLayer) -> None:
    """After a whole-component placement on the host, detaching gives every tensor a storage
    of its own size again (the view sharing its weight's), pageable, with its values."""
    lm = TiedLM()
    before = values(lm)
    sizes = {n: t.untyped_storage().nbytes() for n, t in lm.state_dict(keep_vars=True).items()}
    store = await regrouped(device_store("lm", lm, layer), "whole", nothing)
    assert needs_restore(store)
    assert lm.scale.untyped_storage().nbytes() == store.units[0].nbytes
    (await prepare_restore(store)).commit()
    assert {n: t.untyped_storage().nbytes() for n, t in lm.state_dict(keep_vars=True).items()} == sizes
    assert lm.first_row.untyped_storage().data_ptr() == lm.embed.weight.untyped_storage().data_ptr()
    assert not lm.scale.is_pinned() and same(lm, before)


async def test_a_per_storage_store_on_its_own_storages_needs_no_restore(layer: DeviceLayer) -> None:
    """A store whose units are the module's own storages (on pageable memory) leaves the
    module as it is at detach."""
    store = device_store("lm", TiedLM(), layer)
    assert needs_restore(store) == layer.pinned
