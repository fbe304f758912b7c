"""Discarding sleep at the store level (strategies._discard), no controller: what is dropped,
what is kept, what a wake places, and that a prepared move undone leaves no trace."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from strategies import make_device_layer
from strategies._discard import prepare_discard, prepare_undiscard
from strategies.protocol import WriteSource
from tests.strategies.device_modules import device_store

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


class WithExtras(nn.Module):
    """Parameters, a persistent buffer, a non-persistent buffer and a tensor attribute."""

    scale: torch.Tensor
    table: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))
        self.register_buffer("table", torch.arange(16, dtype=torch.float32), persistent=False)
        self.cache = torch.linspace(0, 1, 32)


def snapshot(module: WithExtras) -> dict[str, torch.Tensor]:
    return {"lin.weight": module.lin.weight.detach().clone(), "lin.bias": module.lin.bias.detach().clone(),
            "scale": module.scale.clone(), "table": module.table.clone(), "cache": module.cache.clone()}


STATE = ["lin.bias", "lin.weight", "scale"]


@pytest.mark.parametrize("whole", [False, True], ids=["per-storage", "whole"])
async def test_a_discarding_sleep_drops_state_keeps_the_rest_and_a_wake_places_both(
        whole: bool) -> None:
    """Dropped: parameters and persistent buffers (no host bytes, shapes kept, stale); kept:
    the non-persistent buffer and the attribute (their bytes on the host, exact after wake);
    the wake gives every unit its place again, stale tensors with undefined contents."""
    module = WithExtras()
    before = snapshot(module)
    store = device_store("m", module, make_device_layer("cpu"), whole=whole)
    move = await prepare_discard(store, everything=True)
    assert move is not None
    move.commit()
    assert store.stale_names() == STATE
    report = store.report()
    assert report.device_bytes == 0
    kept = module.table.nbytes + module.cache.nbytes
    assert kept <= report.host_bytes < kept + 2 * 256  # the kept ones, aligned, nothing else
    assert module.lin.weight.shape == (8, 8) and module.scale.shape == (8,)
    assert torch.equal(module.table, before["table"]) and torch.equal(module.cache, before["cache"])
    awake = list(store.units) if not whole else []
    wake = await prepare_undiscard(store, awake)
    wake.commit()
    assert store.discarded is None
    assert all(u.where == ("device" if not whole else "host") for u in store.units)
    assert torch.equal(module.table, before["table"]) and torch.equal(module.cache, before["cache"])
    assert store.stale_names() == STATE
    assert module.lin.weight.untyped_storage().nbytes() > 8  # a real buffer again


async def test_a_write_makes_a_stale_tensor_fresh_and_a_second_sleep_drops_only_the_stale() -> None:
    """After a wake, writing some stale tensors makes those fresh; the next sleep drops only
    the still-stale ones and keeps the written values (copied to the host)."""
    module = WithExtras()
    store = device_store("m", module, make_device_layer("cpu"))
    move = await prepare_discard(store, everything=True)
    assert move is not None
    move.commit()
    (await prepare_undiscard(store, list(store.units))).commit()
    weight = torch.randn(8, 8)
    write = await store.prepare_write([WriteSource("lin.weight", lambda: weight)])
    write.commit()
    assert store.stale_names() == ["lin.bias", "scale"]
    again = await prepare_discard(store, everything=False)
    assert again is not None
    again.commit()
    assert store.stale_names() == ["lin.bias", "scale"]
    assert torch.equal(module.lin.weight, weight)  # kept: on the host with its value


async def test_a_store_with_nothing_stale_sleeps_as_usual_unless_everything_is_dropped() -> None:
    """Without stale tensors and without ``everything`` there is nothing to drop (None)."""
    store = device_store("m", WithExtras(), make_device_layer("cpu"))
    assert await prepare_discard(store, everything=False) is None


async def test_an_undone_discard_or_wake_changes_nothing() -> None:
    """A prepared discarding sleep, then a prepared wake, each undone instead of committed,
    leave every tensor, the stale set and the report as they were."""
    module = WithExtras()
    before = snapshot(module)
    store = device_store("m", module, make_device_layer("cpu"))
    report = store.report()
    pointers = [t.data_ptr() for t in (module.lin.weight, module.scale, module.table)]
    move = await prepare_discard(store, everything=True)
    assert move is not None
    await move.undo()
    assert store.report() == report and store.stale_names() == []
    assert [t.data_ptr() for t in (module.lin.weight, module.scale, module.table)] == pointers
    assert all(torch.equal(v, snapshot(module)[k]) for k, v in before.items())
    move = await prepare_discard(store, everything=True)
    assert move is not None
    move.commit()
    asleep = store.report()
    wake = await prepare_undiscard(store, list(store.units))
    await wake.undo()
    assert store.report() == asleep and store.discarded is not None
