"""Embedding the controller in an application: it cleans up after itself, keeps the event
loop free and never takes the application's share of anyio's worker threads."""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import anyio
import anyio.to_thread
import pytest

from lifecycle import LifecycleController, Phase
from tests.helpers import small_pipeline

pytestmark = pytest.mark.anyio


def copier_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("residency-copy")]


@pytest.mark.moves  # (the cuda-sim pass: its layer is closed, then used again)
async def test_async_with_detaches_and_the_controller_can_be_used_again() -> None:
    """Leaving ``async with LifecycleController(...)`` detaches the pipeline (weights left
    on the host, hooks removed); the controller can attach again after."""
    async with LifecycleController("cpu", residency="vae=component-offload") as ctl:
        await ctl.attach(small_pipeline())
        assert ctl.phase is Phase.AWAKE
    assert ctl.phase is Phase.UNINITIALIZED  # type: ignore[comparison-overlap]
    assert not ctl.components
    async with ctl:
        await ctl.attach(small_pipeline())
        await ctl.aclose()
        assert ctl.phase is Phase.UNINITIALIZED


async def test_async_with_stops_the_copy_thread_layerwise_forwards_started() -> None:
    """Layerwise forwards start the CPU copy thread; closing the controller joins it."""
    from tests.modes.strategy_suite import DiT, x_in

    before = len(copier_threads())
    async with LifecycleController("cpu", residency="transformer=layerwise-offload") as ctl:
        model = DiT(4)
        await ctl.attach({"transformer": model})
        async with ctl.use("transformer"):
            model(x_in())
        assert len(copier_threads()) == before + 1
    assert len(copier_threads()) == before


async def test_checksum_async_hashes_in_a_worker_thread_and_agrees(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``weights_checksum_async`` gives what ``weights_checksum`` gives, hashed off the
    event loop's thread."""
    ctl = LifecycleController("cpu")
    await ctl.attach(small_pipeline())
    threads: list[threading.Thread] = []
    real = hashlib.sha256

    def spy(*args: Any, **kwargs: Any) -> Any:
        threads.append(threading.current_thread())
        return real(*args, **kwargs)

    expected = ctl.weights_checksum()
    monkeypatch.setattr(hashlib, "sha256", spy)  # the hash itself: wherever the library calls it
    assert await ctl.weights_checksum_async() == expected
    assert threads and all(t is not threading.main_thread() for t in threads)


async def test_library_threads_do_not_use_the_applications_default_limiter() -> None:
    """With every token of anyio's default thread limiter held by the application, updates
    and checksums still run: the library uses capacity limiters of its own."""
    ctl = LifecycleController("cpu")
    pipe = small_pipeline()
    await ctl.attach(pipe)
    default = anyio.to_thread.current_default_thread_limiter()
    held = default.total_tokens
    default.total_tokens = 1
    try:
        async with default:  # the application's only token, held
            with anyio.fail_after(20):
                state = {k: v + 1 for k, v in pipe["transformer"].state_dict().items()}
                assert (await ctl.update_weights_from_tensors(state)).success
                assert await ctl.weights_checksum_async() == ctl.weights_checksum()
    finally:
        default.total_tokens = held
