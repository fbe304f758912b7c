"""Work handed to a worker thread lets go of its arguments and result before the caller goes
on (strategies._threads), however late the thread itself gets to run again: a buffer the
caller drops is freed then, not when the scheduler next runs the thread."""

from __future__ import annotations

import gc
import threading
import weakref
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import anyio
import anyio.to_thread
import pytest
import torch

from strategies._threads import released, to_thread

pytestmark = pytest.mark.anyio


@pytest.fixture
def no_collector() -> Iterator[None]:
    """Only reference counts free here: a reference cycle would not go unnoticed."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def fresh() -> torch.Tensor:
    return torch.ones(256)


def doubled(t: torch.Tensor) -> torch.Tensor:
    return t * 2


async def test_anyio_alone_keeps_the_argument_or_the_result_while_its_thread_is_slow(
        slow_handback: float, no_collector: None) -> None:
    """The hazard itself: anyio's thread (asyncio's backend) still holds the argument, and
    trio's the result, when the caller goes on; both go when the thread runs again."""
    arg = fresh()
    out = await anyio.to_thread.run_sync(doubled, arg)
    kept = weakref.ref(arg), weakref.ref(out)
    del arg, out
    assert any(ref() is not None for ref in kept)
    await anyio.sleep(slow_handback * 4)
    assert all(ref() is None for ref in kept)


async def test_to_thread_lets_go_of_argument_and_result_before_the_caller_goes_on(
        slow_handback: float, no_collector: None) -> None:
    arg = fresh()
    out = await to_thread(doubled, arg)
    assert torch.equal(out, torch.full((256,), 2.0))
    kept = weakref.ref(arg), weakref.ref(out)
    del arg, out
    assert [ref() for ref in kept] == [None, None]


async def test_to_thread_raises_what_the_call_raised_and_keeps_its_arguments_only_with_it(
        slow_handback: float, no_collector: None) -> None:
    """The exception is the call's own, traceback and all (the frames in it hold the
    arguments, as a call made here would): dropped, nothing of the call is left."""

    def fails(t: torch.Tensor) -> None:
        raise ValueError(f"refused {tuple(t.shape)}")

    arg = fresh()
    kept = weakref.ref(arg)
    with pytest.raises(ValueError, match=r"refused \(256,\)") as info:
        await to_thread(fails, arg)
    assert any(tb.name == "fails" for tb in info.traceback)
    del arg, info
    assert kept() is None


async def test_an_abandoned_call_lets_go_of_its_arguments_when_it_ends(
        no_collector: None) -> None:
    started, finish = threading.Event(), threading.Event()

    def waits(t: torch.Tensor) -> torch.Tensor:
        started.set()
        finish.wait(10)
        return t + 1

    handed = [fresh()]
    kept = weakref.ref(handed[0])
    with anyio.move_on_after(10) as scope:
        async with anyio.create_task_group() as tg:
            async def call() -> None:
                await to_thread(waits, handed.pop(), abandon_on_cancel=True)
            tg.start_soon(call)
            await to_thread(started.wait, 10)
            tg.cancel_scope.cancel()
    assert not scope.cancelled_caught
    assert kept() is not None  # the thread still runs the call
    finish.set()
    with anyio.fail_after(10):
        while kept() is not None:
            await anyio.sleep(0.01)


def test_an_executor_job_lets_go_of_its_arguments_before_its_future_resolves(
        slow_handback: float, no_collector: None) -> None:
    """``released`` for an executor (the layers' copy and refresh threads): the future
    resolves with the arguments gone; its exception still reaches the future."""
    with ThreadPoolExecutor(1) as pool:
        arg = fresh()
        kept = weakref.ref(arg)
        pool.submit(doubled, arg).result()
        del arg
        assert kept() is not None  # a plain work item: still held by the slow thread

        arg = fresh()
        kept = weakref.ref(arg)
        assert pool.submit(released(doubled, arg)).result() is None
        del arg
        assert kept() is None

        def fails(t: torch.Tensor) -> None:
            raise ValueError("refused")

        with pytest.raises(ValueError, match="refused"):
            pool.submit(released(fails, fresh())).result()


def test_a_job_runs_once() -> None:
    job = released(doubled, fresh())
    job()
    with pytest.raises(AssertionError, match="runs once"):
        job()
