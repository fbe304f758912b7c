"""Request-level prefetch: the next component moves in while the current one runs;
what a request that ends early, or a sleep, does with a pending prefetch."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest

from tests.modes.strategy_suite import (
    OFFLOADED_TRANSFORMER_BYTES,
    _one_intra_op_thread,  # noqa: F401 (an autouse fixture)
    offload_all,
)

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


ORDER = ["text_encoder", "transformer", "vae"]


async def wait_for(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        while not condition():
            await anyio.sleep(0.01)


async def test_request_moves_the_next_component_in_while_the_current_one_runs() -> None:
    """Inside use('text_encoder') the transformer is copied in the background under a
    prefetch lease; entering use('transformer') then copies nothing more."""
    ctl, layer = await offload_all()
    async with ctl.request(ORDER):
        async with ctl.use("text_encoder"):
            start = layer.copies
            await anyio.sleep(0.05)
            assert ctl.in_flight == 3  # the request, the use, the prefetch
            await wait_for(lambda: layer.copies - start == 1)
            # Copied in, not yet placed: the report counts the buffer it holds.
            assert ctl.strategy("transformer").store.units[0].where == "host"
            assert ctl.report().components["transformer"].device_bytes == OFFLOADED_TRANSFORMER_BYTES
        before = layer.copies
        async with ctl.use("transformer"):
            assert layer.copies == before
            assert ctl.report().components["transformer"].device_bytes == OFFLOADED_TRANSFORMER_BYTES
    assert ctl.in_flight == 0
    assert ctl.report().device_bytes == 0


@pytest.mark.parametrize("copying", [False, True], ids=["prefetched", "still-copying"])
async def test_request_ending_without_the_prefetched_use_leaves_nothing_behind(copying: bool) -> None:
    """A prefetch the request never used is dropped: no device byte, no lease."""
    ctl, layer = await offload_all()
    async with ctl.request(ORDER), ctl.use("text_encoder"):
        layer.copy_delay = 0.05 if copying else 0.0
        await anyio.sleep(0.01 if copying else 0.05)
        assert ctl.in_flight == 3  # the request, the use, the prefetch
    assert ctl.in_flight == 0
    assert ctl.report().device_bytes == 0
    layer.copy_delay = 0.0
    async with ctl.use("transformer"):
        assert ctl.report().components["transformer"].device_bytes == OFFLOADED_TRANSFORMER_BYTES


@pytest.mark.parametrize("copying", [False, True], ids=["prefetched", "still-copying"])
async def test_sleep_while_a_prefetch_is_pending_succeeds_and_drops_it(copying: bool) -> None:
    """A sleep inside a request (which does not wait for its own request) drops the pending
    prefetch and leaves no device byte; only the request's own lease is left."""
    ctl, layer = await offload_all(drain_timeout=5.0)
    async with ctl.request(ORDER):
        async with ctl.use("text_encoder"):
            layer.copy_delay = 0.05 if copying else 0.0
            await anyio.sleep(0.01 if copying else 0.05)
        result = await ctl.sleep()
        assert (result.success, result.sleeping) == (True, True)
        assert ctl.report().device_bytes == 0
        assert ctl.in_flight == 1  # the request itself
    assert ctl.in_flight == 0
    assert ctl.report().device_bytes == 0
    layer.copy_delay = 0.0
    assert (await ctl.wake()).success
    async with ctl.use("transformer"):
        assert ctl.report().components["transformer"].device_bytes == OFFLOADED_TRANSFORMER_BYTES
