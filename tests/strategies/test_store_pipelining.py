"""A move of several chunks (strategies/_store.py, ``copy_pairs``): two chunks handed to the
layer at once, so the link never waits for the host to queue the next; a failure in any chunk
raises its own error once every chunk handed over has landed, and leaves nothing behind."""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable

import pytest
import torch
from torch import nn

import strategies._store as store_module
from lifecycle.testing import FaultInjection, InjectedFault
from strategies import DeviceLayer
from strategies._store import Move
from strategies.devices import CopyPair, Tier
from strategies.protocol import TensorStore, forget_locals
from tests.strategies.device_modules import device_store

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


def stack() -> nn.Sequential:
    """Six 16x16 linear layers: a 1 KiB weight and a 64-byte bias each (12 units)."""
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)))


def recorded(layer: DeviceLayer) -> list[tuple[str, int]]:
    """``("start", i)`` when the ``i``-th batch is handed to ``layer.copy``, ``("end", i)``
    when that call returns (landed, or failed)."""
    events: list[tuple[str, int]] = []
    inner = layer.copy
    calls = itertools.count()

    async def copy(pairs: list[CopyPair], to: Tier) -> None:
        i = next(calls)
        events.append(("start", i))
        try:
            await inner(pairs, to)
        finally:
            events.append(("end", i))

    layer.copy = copy  # type: ignore[method-assign,assignment]
    return events


def most_in_flight(events: list[tuple[str, int]]) -> int:
    running = most = 0
    for kind, _ in events:
        running += 1 if kind == "start" else -1
        most = max(most, running)
    return most


def values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in module.state_dict().items()}


async def ready(layer: DeviceLayer, direction: str
                ) -> tuple[nn.Module, dict[str, torch.Tensor], TensorStore, Callable[..., Awaitable[Move]]]:
    """The stack in a store on ``layer``, where a move to ``direction`` starts from: the
    module, its values, the store, and the move's ``prepare``."""
    module = stack()
    before = values(module)
    store = device_store("s", module, layer)
    if direction == "device":
        (await store.prepare_to_host(store.units)).commit()
    return module, before, store, (store.prepare_to_host if direction == "host"
                                   else store.prepare_to_device)


@pytest.mark.parametrize("direction", ["host", "device"])
async def test_a_move_of_several_chunks_keeps_two_in_flight_and_lands_every_byte(
        faulty: Callable[..., FaultInjection], monkeypatch: pytest.MonkeyPatch,
        direction: str) -> None:
    """With 1 KiB chunks, a move of the six-layer stack hands its seven chunks (a weight, then
    a bias and a weight, five times, then a bias) over with the next one handed before the
    one before it has landed, never more than two at once, and every value comes back
    exactly."""
    monkeypatch.setattr(store_module, "CHUNK", 1024)
    layer = faulty(copy_delay=0.002)
    module, before, store, prepare = await ready(layer, direction)
    events = recorded(layer)
    move = await prepare(store.units)
    move.commit()
    assert move.bytes_copied == 6 * (1024 + 64)
    assert len(events) == 2 * 7 and most_in_flight(events) == 2
    assert events[:2] == [("start", 0), ("start", 1)]
    if direction == "host":
        (await store.prepare_to_device(store.units)).commit()
    got = values(module)
    assert all(torch.equal(got[n], before[n]) for n in before)


@pytest.mark.parametrize("direction", ["host", "device"])
async def test_a_copy_failing_in_any_chunk_raises_its_own_error_and_leaves_nothing(
        faulty: Callable[..., FaultInjection], monkeypatch: pytest.MonkeyPatch,
        direction: str) -> None:
    """Whichever of the twelve copies fails, the move raises that InjectedFault itself (not
    an exception group) once no chunk handed over is still copying, and the store is as
    before: every value, no byte pending, no device buffer alive."""
    monkeypatch.setattr(store_module, "CHUNK", 1024)
    for k in range(1, 13):
        layer = faulty(copy_delay=0.001)
        module, before, store, prepare = await ready(layer, direction)
        report = store.report()
        events = recorded(layer)
        layer.arm(copy_at=k)
        with pytest.raises(InjectedFault) as caught:
            await prepare(store.units)
        forget_locals(caught.value)
        del caught
        assert [kind for kind, _ in events].count("start") == \
            [kind for kind, _ in events].count("end")
        assert (store.report(), store.pending_bytes) == (report, 0)
        assert layer.live_device_bytes == 0
        got = values(module)
        assert all(torch.equal(got[n], before[n]) for n in before)
