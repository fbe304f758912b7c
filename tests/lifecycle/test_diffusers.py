"""A real (tiny, random, built from config: no downloads) diffusers pipeline under the
controller: attach, generate through its own ``__call__``, sleep, wake, offload."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from lifecycle import ComponentAsleep, ComponentNotPlaced, LifecycleController, Phase
from lifecycle.adapters import PipelineRunner

diffusers = pytest.importorskip("diffusers")

pytestmark = pytest.mark.anyio


def tiny_pipeline(seed: int = 0) -> Any:
    torch.manual_seed(seed)
    unet = diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1,
        block_out_channels=(8, 16), down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"), norm_num_groups=4).eval()
    pipe = diffusers.DDPMPipeline(unet=unet,
                                  scheduler=diffusers.DDPMScheduler(num_train_timesteps=10))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def call_args(seed: int = 0) -> dict[str, Any]:
    return {"batch_size": 1, "generator": torch.Generator().manual_seed(seed),
            "num_inference_steps": 2, "output_type": "np"}


def images(output: Any) -> np.ndarray:
    return np.asarray(output.images)


@pytest.fixture(scope="module")
def reference() -> np.ndarray:
    """The pipeline's output without any controller."""
    return images(tiny_pipeline()(**call_args()))


async def test_attach_sleep_wake_through_the_pipelines_own_call(reference: np.ndarray) -> None:
    """Through the runner the pipeline's output equals the unmanaged one, asleep both the runner and a
    direct call are refused, and after wake both match again."""
    pipe = tiny_pipeline()
    ctl = LifecycleController("cpu")
    runner = await PipelineRunner.attach(pipe, ctl)
    assert list(ctl.components) == ["unet"]  # the scheduler is not a module: ignored
    assert runner.order == ("unet",)

    first = images(await runner(**call_args()))
    assert first.shape == (1, 8, 8, 3)
    np.testing.assert_array_equal(first, reference)

    result = await ctl.sleep()
    assert result.success and ctl.phase is Phase.SLEEPING
    assert ctl.report().device_bytes == 0
    with pytest.raises(ComponentAsleep):
        pipe(**call_args())  # a direct call is refused, not silently run on freed weights
    with pytest.raises(ComponentAsleep):
        await runner(**call_args())

    assert (await ctl.wake()).success
    again = images(await runner(**call_args()))
    np.testing.assert_array_equal(again, first)
    # a direct call works again too: the unet is resident
    np.testing.assert_array_equal(images(pipe(**call_args())), first)


async def test_component_offload_through_the_runner(reference: np.ndarray) -> None:
    """Component-offload places the whole unet only during a runner call, and a direct call outside
    ``use()`` is refused."""
    pipe = tiny_pipeline()
    ctl = LifecycleController("cpu", residency="unet=component-offload")
    runner = await PipelineRunner.attach(pipe, ctl)
    placed_during_call: list[int] = []

    def record(module: Any, args: Any) -> None:
        placed_during_call.append(ctl.report().components["unet"].device_bytes)

    handle = pipe.unet.register_forward_pre_hook(record)
    try:
        out = images(await runner(**call_args()))
    finally:
        handle.remove()
    np.testing.assert_array_equal(out, reference)
    total = ctl.report().components["unet"].total_bytes
    assert placed_during_call and all(b == total for b in placed_during_call)
    assert ctl.report().components["unet"].device_bytes == 0  # offloaded between calls
    with pytest.raises(ComponentNotPlaced):
        pipe(**call_args())  # outside use(): the adapter is the way to call it

    await ctl.sleep()
    await ctl.wake()
    np.testing.assert_array_equal(images(await runner(**call_args())), reference)


async def test_sleep_waits_for_a_running_call(reference: np.ndarray) -> None:
    """A sleep requested during a runner call completes only after the call, whose output is
    unchanged."""
    import anyio

    pipe = tiny_pipeline()
    ctl = LifecycleController("cpu")
    runner = await PipelineRunner.attach(pipe, ctl)
    started = threading.Event()
    events: list[str] = []

    def slow(module: Any, args: Any) -> None:
        started.set()
        time.sleep(0.05)

    handle = pipe.unet.register_forward_pre_hook(slow)
    results: list[np.ndarray] = []

    async def generate() -> None:
        results.append(images(await runner(**call_args())))
        events.append("call done")

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(generate)
            while not started.is_set():
                await anyio.sleep(0.005)
            result = await ctl.sleep()
            events.append("sleep done")
    finally:
        handle.remove()
    assert result.success
    assert events == ["call done", "sleep done"]
    np.testing.assert_array_equal(results[0], reference)


async def test_the_pipelines_own_errors_come_through_unwrapped() -> None:
    """A pipeline's own TypeError comes through the runner unwrapped, with every lease returned and the
    unet offloaded."""
    pipe = tiny_pipeline()
    ctl = LifecycleController("cpu", residency="unet=component-offload")
    runner = await PipelineRunner.attach(pipe, ctl)
    with pytest.raises(TypeError, match="no_such_argument"):
        await runner(no_such_argument=1)
    assert ctl.in_flight == 0  # every lease returned
    assert ctl.report().components["unet"].device_bytes == 0
    assert (await ctl.sleep()).success


async def test_runner_refuses_a_pipeline_that_is_not_attached() -> None:
    """The runner refuses to run when no pipeline or another pipeline is attached, and refuses to wrap
    an object that is not callable."""
    ctl = LifecycleController("cpu")
    runner = PipelineRunner(tiny_pipeline(), ctl)
    with pytest.raises(RuntimeError, match="no pipeline is attached"):
        await runner(**call_args())
    await ctl.attach(tiny_pipeline(seed=1))
    with pytest.raises(RuntimeError, match="not this pipeline's"):
        await runner(**call_args())
    with pytest.raises(TypeError, match="not callable"):
        PipelineRunner({"unet": torch.nn.Linear(2, 2)}, ctl)
