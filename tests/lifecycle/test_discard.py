"""Discard sleep: a release that drops weights instead of copying them to the host, the stale
components after the wake, and what they refuse until updates write every discarded tensor."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lifecycle import (
    InvalidRequest,
    LifecycleController,
    Phase,
    TransitionFailed,
    WeightsDiscarded,
)
from lifecycle.demo import DemoPipeline
from lifecycle.testing import FaultInjection
from tests.helpers import faulty_device
from tests.models.zoo import CASES

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

SIZE = 2**20
MODES = ["resident", "component-offload", "snapshot-offload", "layerwise-offload"]


Served = tuple[LifecycleController, DemoPipeline, torch.Tensor, dict[str, torch.Tensor]]


async def served(mode: str, layer: FaultInjection | None = None, **kwargs: object) -> Served:
    """A demo pipeline with its transformer in ``mode``, its output, its transformer weights;
    placed in the layer's device memory before attach (``model.to("cuda")``: its first
    sleep copies every byte, and each copy is a point a fault can hit)."""
    pipe = DemoPipeline.build(SIZE)
    expected = pipe.forward_sync(steps=2)
    state = {k: v.clone() for k, v in pipe.modules["transformer"].state_dict().items()}
    layer = layer or faulty_device()
    layer.place(*pipe.modules.values())
    ctl = LifecycleController(device_layer=layer,
                              residency=f"transformer={mode}", **kwargs)  # type: ignore[arg-type]
    await ctl.attach(pipe)
    return ctl, pipe, expected, state


Serve = Callable[..., Awaitable[Served]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """``await serve(mode, layer, **kwargs)``: :func:`served`, the controller closed after the
    test however it ends."""
    async with AsyncExitStack() as stack:
        async def make(mode: str, layer: FaultInjection | None = None, **kwargs: object) -> Served:
            made = await served(mode, layer, **kwargs)
            stack.push_async_callback(made[0].aclose)
            return made

        yield make


@pytest.mark.parametrize("mode", MODES)
async def test_the_rl_loop_with_a_discarding_release_serves_exactly_after_the_full_update(
        mode: str, serve: Serve) -> None:
    """Release with discard: nothing of the transformer copied or kept on the host; resume:
    it is stale and refuses to generate; a partial update leaves it stale (the result says
    how many are left); the full update makes it fresh and the output is exact again."""
    ctl, pipe, expected, state = await serve(mode)
    result = await ctl.release_memory_occupation(discard=["transformer"])
    assert result.success and result.discarded == ("transformer",)
    assert "discarded" in result.message
    asleep = ctl.report().components["transformer"]
    kept = [b for n, b in pipe.modules["transformer"].named_buffers() if n not in state]
    assert asleep.device_bytes == 0
    # On the host: only what an update cannot bring back (non-persistent buffers), aligned.
    assert sum(b.nbytes for b in kept) <= asleep.host_bytes <= sum(
        (b.nbytes + 255) // 256 * 256 for b in kept)
    assert asleep.pinned_bytes in (0, asleep.host_bytes) or asleep.pinned_bytes <= 4096
    assert ctl.report().components["text_encoder"].host_bytes > 0  # others sleep as usual
    await ctl.resume_memory_occupation()
    assert set(ctl.stale) == {"transformer"} and ctl.stale["transformer"] == len(state)
    assert ctl.report().stale == dict(ctl.stale)
    with pytest.raises(WeightsDiscarded, match=r"transformer.*Update weights first"):
        await pipe.generate(ctl=ctl, steps=2)
    half = dict(sorted(state.items())[:len(state) // 2])
    partial = await ctl.update_weights_from_tensors(half, "transformer")
    assert partial.success and partial.stale == {"transformer": len(state) - len(half)}
    assert "still stale" in partial.message
    left = sorted(set(state) - set(half))
    assert partial.stale_tensors == {"transformer": (len(left), tuple(left[:3]))}
    with pytest.raises(WeightsDiscarded):
        await pipe.generate(ctl=ctl, steps=2)
    full = await ctl.update_weights_from_tensors(state, "transformer")
    assert full.success and full.stale == {} and ctl.stale == {}
    assert torch.equal(await pipe.generate(ctl=ctl, steps=2), expected)


async def test_discard_names_are_checked_before_anything_moves(serve: Serve) -> None:
    """Unknown names (or a value of another kind) are an InvalidRequest naming the valid
    components; the pipeline stays awake and untouched."""
    ctl, _, _, _ = await serve("resident")
    before = ctl.report()
    with pytest.raises(InvalidRequest, match=r"unknown components.*'text_encoder', 'transformer'"):
        await ctl.sleep(discard=["transformer", "nope"])
    with pytest.raises(InvalidRequest, match="discard must be"):
        await ctl.sleep(discard=3)  # type: ignore[arg-type]
    assert ctl.phase is Phase.AWAKE and ctl.report() == before


async def test_a_discard_on_release_naming_a_missing_component_is_refused_at_attach() -> None:
    """The controller's default is checked against the pipeline when it is attached (not at
    the first release, which would then fail every time): nothing is attached."""
    async with LifecycleController(device_layer=faulty_device(),
                                   discard_on_release=["transformer", "unet"]) as ctl:
        with pytest.raises(InvalidRequest, match=r"discard_on_release names unknown components "
                                                 r"\['unet'\]"):
            await ctl.attach(DemoPipeline.build(SIZE))
        assert ctl.phase is Phase.UNINITIALIZED and ctl.components == {}


async def test_every_release_discards_what_the_controller_says_unless_the_call_says_otherwise(
        serve: Serve) -> None:
    """``discard_on_release`` applies to releases that say nothing; ``discard=False`` on the
    call keeps the weights; plain ``sleep()`` never discards."""
    ctl, _, _, _ = await serve("resident", discard_on_release="all")
    assert (await ctl.release_memory_occupation()).discarded == ("text_encoder", "transformer", "vae")
    await ctl.wake()
    assert set(ctl.stale) == {"text_encoder", "transformer", "vae"}
    await ctl.aclose()
    ctl, _, _, _ = await serve("resident", discard_on_release="transformer")
    assert (await ctl.release_memory_occupation(discard=False)).discarded == ()
    await ctl.wake()
    assert (await ctl.sleep()).discarded == ()
    await ctl.wake()
    assert ctl.stale == {}


async def test_a_dirty_discarded_component_copies_nothing_and_its_refresh_is_cancelled() -> None:
    """After an update (mirrors refreshing in the background, slowly) a discarding sleep
    moves no byte of the transformer to the host and does not wait for the refresh: it is
    cancelled before it copied every tensor."""
    layer = faulty_device(copy_delay=0.005)
    pipe = DemoPipeline.build(16 * 2**20)
    state = {k: v.clone() for k, v in pipe.modules["transformer"].state_dict().items()}
    async with LifecycleController(device_layer=layer) as ctl:
        await ctl.attach(pipe)
        await ctl.sleep()
        await ctl.wake()  # mirrors exist: an update leaves them to refresh
        assert (await ctl.update_weights_from_tensors({k: v + 1 for k, v in state.items()},
                                                      "transformer")).success
        copies = layer.copies
        result = await ctl.sleep(discard="transformer")
        assert result.discarded == ("transformer",) and result.bytes_moved == 0
        assert layer.copies - copies < len(state)  # the refresh stopped: not every tensor copied
        assert ctl.report().components["transformer"].host_bytes < 4096  # kept buffers only


async def test_a_stale_component_sleeps_by_discarding_again_and_serves_nothing(serve: Serve) -> None:
    """Sleeping while stale drops the stale tensors again (no garbage to the host) whatever
    ``discard`` says; use(), a request naming it, a forward of a submodule and a checksum
    raise WeightsDiscarded; the fresh components serve."""
    ctl, pipe, _, _ = await serve("resident")
    await ctl.sleep(discard=["transformer"])
    await ctl.wake()
    again = await ctl.sleep()
    assert again.discarded == ("transformer",) and again.bytes_moved == 0
    await ctl.wake()
    dit = pipe.modules["transformer"]
    with pytest.raises(WeightsDiscarded):
        async with ctl.use("transformer"):
            pass
    with pytest.raises(WeightsDiscarded):
        async with ctl.request(["text_encoder", "transformer"]):
            pass
    block = next(m for m in dit.modules() if isinstance(m, torch.nn.Linear))
    with pytest.raises(WeightsDiscarded), torch.no_grad():
        block(torch.zeros(1, block.in_features))
    with pytest.raises(WeightsDiscarded):
        ctl.weights_checksum(["transformer"])
    with pytest.raises(WeightsDiscarded):  # a per-tensor check would compare undefined values
        await ctl.check_tensor_hashes("transformer", {"x_proj.bias": "0" * 64})
    assert set(ctl.weights_checksum(["vae"])) == {"vae"}
    async with ctl.use("vae"):
        pass
    assert ctl.in_flight == 0


async def test_buffers_an_update_cannot_bring_back_sleep_and_wake_as_usual(serve: Serve) -> None:
    """Non-persistent buffers and tensor attributes are kept (copied to the host, exact after
    the wake); the parameters and persistent buffers are the stale ones."""
    ctl, pipe, _, state = await serve("component-offload")
    dit = pipe.modules["transformer"]
    kept = {n: b.clone() for n, b in dit.named_buffers() if n not in state}
    assert kept, "the demo transformer has non-persistent buffers"
    await ctl.sleep(discard=True)
    assert 0 < ctl.report().components["transformer"].host_bytes < sum(
        v.nbytes for v in state.values())
    await ctl.wake()
    now = dict(dit.named_buffers())
    assert all(torch.equal(now[n], b) for n, b in kept.items())
    assert ctl.stale["transformer"] == len(state)


async def test_detaching_a_stale_pipeline_is_allowed_and_warned(
        serve: Serve, caplog: pytest.LogCaptureFixture) -> None:
    """Detach while stale (asleep or awake) works and logs a warning naming the stale
    components; the module's tensors then have their shapes and real storage (undefined values)."""
    for wake in (False, True):
        ctl, pipe, _, state = await serve("layerwise-offload")
        await ctl.sleep(discard=["transformer"])
        if wake:
            await ctl.wake()
        with caplog.at_level(logging.WARNING, logger="lifecycle"):
            caplog.clear()
            assert await ctl.detach() is Phase.UNINITIALIZED
        events = [r.msg for r in caplog.records if isinstance(r.msg, dict)]
        assert [e["components"] for e in events if e["event"] == "detach.stale"] == [
            {"transformer": len(state)}]
        for name, t in pipe.modules["transformer"].state_dict().items():
            assert (t.shape == state[name].shape and 0 not in t.stride()) or t.numel() <= 1
        pipe.modules["transformer"].load_state_dict(state)  # writable: real storages
        await ctl.aclose()


@pytest.mark.parametrize("when", ["sleep", "wake"])
async def test_a_fault_at_any_point_of_a_discarding_sleep_or_its_wake_changes_nothing(
        when: str, serve: Serve) -> None:
    """For every copy and allocation of a discarding sleep (or of the wake after it), an
    injected failure leaves phase, placement, host bytes and the stale set as they were."""
    probe = faulty_device()
    ctl, _, _, _ = await serve("component-offload", probe)
    if when == "wake":
        await ctl.sleep(discard=["transformer", "text_encoder"])
    copies, allocs = probe.copies, probe.allocations
    await (ctl.sleep(discard=["transformer", "text_encoder"]) if when == "sleep" else ctl.wake())
    points = [("copy", k) for k in range(1, probe.copies - copies + 1)] + \
        [("alloc", k) for k in range(1, probe.allocations - allocs + 1)]
    assert len(points) >= 3
    await ctl.aclose()
    for kind, k in points:
        layer = faulty_device()
        ctl, _, _, _ = await serve("component-offload", layer)
        if when == "wake":
            await ctl.sleep(discard=["transformer", "text_encoder"])
        before = (ctl.phase, ctl.report(), dict(ctl.stale))
        layer.arm(**{f"{kind}_at": k})
        with pytest.raises(TransitionFailed):
            await (ctl.sleep(discard=["transformer", "text_encoder"]) if when == "sleep"
                   else ctl.wake())
        assert (ctl.phase, ctl.report(), dict(ctl.stale)) == before, (kind, k)
        await ctl.aclose()


async def test_an_update_from_disk_makes_a_discarded_component_fresh(serve: Serve, tmp_path: Path) -> None:
    """A disk checkpoint holding every discarded tensor makes the component fresh."""
    ctl, pipe, expected, state = await serve("snapshot-offload")
    await ctl.sleep(discard=["transformer"])
    await ctl.wake()
    (tmp_path / "transformer").mkdir()
    save_file(state, str(tmp_path / "transformer" / "model.safetensors"))
    result = await ctl.update_weights_from_disk(tmp_path, ["transformer"])
    assert result.success and ctl.stale == {}
    assert torch.equal(await pipe.generate(ctl=ctl, steps=2), expected)


@pytest.mark.parametrize("case", ["flux", "t5_encoder"])
@pytest.mark.parametrize("mode", ["resident", "layerwise-offload"])
async def test_real_models_come_back_exactly_from_their_own_state_dict(case: str, mode: str
                                                                       ) -> None:
    """A diffusers transformer and a transformers encoder with tied embeddings: discarded,
    woken (stale, refused), updated from their state dict (tied names once): exact again."""
    model_case = CASES[case]
    model = model_case.build(0)
    expected = model_case.run(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    async with LifecycleController(device_layer=faulty_device(), residency=f"model={mode}") as ctl:
        await ctl.attach({"model": model})
        await ctl.sleep(discard=True)
        await ctl.wake()
        assert ctl.stale["model"] > 0
        with pytest.raises(WeightsDiscarded):
            model_case.run(model)
        assert (await ctl.update_weights_from_tensors(state, "model")).success
        assert ctl.stale == {}
        if mode == "layerwise-offload":
            async with ctl.use("model"):
                assert torch.equal(model_case.run(model), expected)
        else:
            assert torch.equal(model_case.run(model), expected)


async def test_metrics_show_the_stale_tensors_of_each_component(serve: Serve) -> None:
    """``residency_stale_tensors{component}`` counts each component's discarded tensors not
    updated yet (0 for the fresh ones), read at scrape time."""
    from lifecycle.metrics import ControllerMetrics

    ctl, _, _, state = await serve("resident")
    with ControllerMetrics(ctl) as metrics:
        await ctl.sleep(discard=["transformer"])
        await ctl.wake()
        text = metrics.render().decode()
        assert f'residency_stale_tensors{{component="transformer"}} {float(len(state))}' in text
        assert 'residency_stale_tensors{component="vae"} 0.0' in text
        await ctl.update_weights_from_tensors(state, "transformer")
        assert 'residency_stale_tensors{component="transformer"} 0.0' in metrics.render().decode()
