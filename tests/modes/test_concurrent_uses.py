"""Concurrent uses of one component: overlapping uses of an offloaded component share one
placement; layerwise offload under threads and tasks running the same component at once, on a
device layer slowed and jittered so that races have room to happen."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator

import anyio
import anyio.to_thread
import pytest
import torch

from lifecycle import LifecycleController
from lifecycle.testing import FaultInjection
from strategies import LayerwiseOffloadStrategy, ResidencyConfig
from tests.helpers import faulty_device, small_pipeline
from tests.modes.strategy_suite import (
    NONLAYER_BYTES,
    OFFLOADED_TRANSFORMER_BYTES,
    DiT,
    copied_in_bytes,
    x_in,
)

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

TASKS, ROUNDS, LAYERS = 4, 20, 8


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    """Several forward threads with OpenMP workers each oversubscribe 2 cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


async def serving(prefetch: int) -> tuple[LifecycleController, DiT, DiT, FaultInjection,
                                          LayerwiseOffloadStrategy]:
    torch.manual_seed(0)
    model = DiT(LAYERS)
    reference = copy.deepcopy(model)
    # 1 ms per allocation plus up to 1 ms jitter on every allocation and copy.
    layer = faulty_device(alloc_delay=0.001, jitter=0.001, seed=prefetch)
    config = ResidencyConfig.parse("transformer=layerwise-offload",
                                   prefetch={"transformer": prefetch})
    ctl = LifecycleController(device_layer=layer, residency=config)
    await ctl.attach({"transformer": model})
    strategy = ctl.strategy("transformer")
    assert isinstance(strategy, LayerwiseOffloadStrategy)
    return ctl, model, reference, layer, strategy


def assert_idle(ctl: LifecycleController, layer: FaultInjection, device_bytes: int,
                live: int = 0) -> None:
    """Exact accounting: the report, the bytes in flight and the buffers the layer allocated
    that are really alive (``live``: the non-layer weights once attach or a wake copied
    them into buffers of the layer's; none while they are the model's own storages)."""
    store = ctl.strategy("transformer").store
    assert store.pending_bytes == 0
    assert ctl.report().components["transformer"].device_bytes == device_bytes
    assert layer.live_device_bytes == live  # every streamed layer's buffer was freed


@pytest.mark.parametrize("prefetch", [1, 2])
async def test_concurrent_uses_forwarding_in_worker_threads_keep_exact_accounting(
        prefetch: int) -> None:
    """4 tasks x 20 rounds of use() each running the forward in a worker thread (what the
    diffusers adapter does): every output is exact, and after every round and after sleep
    the report, the bytes in flight and the live buffers agree exactly."""
    ctl, model, reference, layer, _ = await serving(prefetch)
    # The non-layer weights, in buffers of the layer's when the model was in host memory.
    held = copied_in_bytes(layer, reference.inp, reference.out)
    assert held in (0, NONLAYER_BYTES)
    x = x_in()
    with torch.no_grad():
        expected = reference(x)

    async def one(errors: list[BaseException]) -> None:
        async with ctl.use("transformer"):
            out = await anyio.to_thread.run_sync(lambda: model(x))
        if not torch.equal(out, expected):
            errors.append(AssertionError("output differs from the resident model's"))

    for _ in range(ROUNDS):
        errors: list[BaseException] = []
        with torch.no_grad():
            async with anyio.create_task_group() as tg:
                for _ in range(TASKS):
                    tg.start_soon(one, errors)
        assert not errors
        assert_idle(ctl, layer, NONLAYER_BYTES, live=held)
    assert (await ctl.sleep()).success
    assert_idle(ctl, layer, 0)
    assert (await ctl.wake()).success
    assert_idle(ctl, layer, NONLAYER_BYTES, live=NONLAYER_BYTES)


async def test_plain_threads_forwarding_inside_one_use_never_share_a_fetch() -> None:
    """Threads started by the caller, all forwarding inside one use(): each layer has at
    most one buffer, outputs are exact, and the end of the use frees every streamed layer."""
    ctl, model, reference, layer, strategy = await serving(2)
    held = copied_in_bytes(layer, reference.inp, reference.out)  # (see above)
    x = x_in()
    with torch.no_grad():
        expected = reference(x)
    outputs: list[torch.Tensor] = []
    failures: list[BaseException] = []

    def worker() -> None:
        try:
            with torch.no_grad():
                for _ in range(5):
                    outputs.append(model(x))
        except BaseException as exc:  # reported below, in the test's thread
            failures.append(exc)

    async with ctl.use("transformer"):
        threads = [threading.Thread(target=worker) for _ in range(TASKS)]
        for t in threads:
            t.start()

        def join_all() -> None:
            for t in threads:
                t.join()

        await anyio.to_thread.run_sync(join_all)
        assert not failures
        # While in use, never more than one buffer per layer: live bytes bounded exactly.
        assert layer.live_device_bytes <= strategy.peak_bound() * TASKS
    assert len(outputs) == 5 * TASKS and all(torch.equal(o, expected) for o in outputs)
    assert_idle(ctl, layer, NONLAYER_BYTES, live=held)


async def test_concurrent_uses_share_one_placement_until_the_last_one_ends() -> None:
    """Two overlapping uses of one offloaded component move it in once and out after both."""
    layer = faulty_device()
    ctl = LifecycleController(device_layer=layer, residency="transformer=component-offload")
    await ctl.attach(small_pipeline())
    first_in, second_done = anyio.Event(), anyio.Event()
    start = layer.copies

    async def second() -> None:
        await first_in.wait()
        async with ctl.use("transformer"):
            assert ctl.in_flight == 2
        second_done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(second)
        async with ctl.use("transformer"):
            first_in.set()
            await second_done.wait()
            assert ctl.report().components["transformer"].device_bytes == OFFLOADED_TRANSFORMER_BYTES
    assert (layer.copies - start, ctl.in_flight) == (1, 0)
    assert ctl.report().components["transformer"].device_bytes == 0
