"""Partial sleep and wake (``components=``): only the named components move, the phase is
sleeping only once every one is asleep, an asleep component serves nothing and takes no
update, and a fault rolls the partial move back."""

from __future__ import annotations

import pytest
import torch

from lifecycle import (
    ComponentAsleep,
    InvalidRequest,
    LifecycleController,
    Phase,
    TransitionFailed,
    TransitionRejected,
)
from tests.helpers import faulty_device, fingerprints, small_pipeline

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

UPDATE_WHILE_SLEEPING = ("Cannot update weights while the server is sleeping. "
                         "Call resume_memory_occupation first.")


def device_bytes(ctl: LifecycleController) -> dict[str, int]:
    return {n: c.device_bytes for n, c in ctl.report().components.items()}


async def test_a_group_sleeps_alone_and_the_others_keep_serving() -> None:
    """sleep(components=["dit"]) releases the transformer only: the phase stays awake, the
    transformer refuses use(), requests naming it, forwards and updates (the reference's
    message), while the VAE serves and takes updates."""
    pipe = small_pipeline()
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(pipe)
        before = device_bytes(ctl)
        sums = ctl.weights_checksum()
        slept = await ctl.sleep(components=["dit"])
        assert (slept.success, slept.sleeping, slept.phase) == (True, False, Phase.AWAKE)
        assert (slept.moved, slept.asleep) == (("transformer",), ("transformer",))
        assert slept.bytes_released == before["transformer"]
        assert device_bytes(ctl) == {**before, "transformer": 0}
        assert ctl.asleep == {"transformer"}
        with pytest.raises(ComponentAsleep):
            async with ctl.use("transformer"):
                pass
        with pytest.raises(ComponentAsleep):
            async with ctl.request(["text_encoder", "transformer", "vae"]):
                pass
        with pytest.raises(ComponentAsleep):
            pipe["transformer"](torch.ones(1, 16))
        async with ctl.use("vae") as vae:
            assert vae is pipe["vae"]
        refused = await ctl.update_weights_from_tensors(
            [("0.bias", torch.zeros(32))], "transformer")
        assert (refused.success, refused.message) == (False, UPDATE_WHILE_SLEEPING)
        assert ctl.weights_checksum() == sums
        done = await ctl.update_weights_from_tensors([("2.bias", torch.ones(3))], "vae")
        assert done.success, done.message
        assert torch.equal(dict(pipe["vae"].named_parameters())["2.bias"], torch.ones(3))
        await ctl.sleep()  # lands the update's mirror refresh


async def test_the_phase_is_sleeping_once_every_component_is_asleep() -> None:
    """Sleeping the transformer, then the rest, makes the phase sleeping; a wake of the VAE
    alone makes it awake again; a wake of the rest restores every tensor bit for bit."""
    pipe = small_pipeline()
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(pipe)
        sums = fingerprints(pipe)
        await ctl.sleep(components="transformer")
        rest = await ctl.sleep()
        assert (rest.phase, rest.moved) == (Phase.SLEEPING, ("text_encoder", "vae"))
        assert ctl.report().device_bytes == 0
        woke = await ctl.wake(components=["vae"])
        assert (woke.phase, woke.moved, woke.asleep) == (
            Phase.AWAKE, ("vae",), ("text_encoder", "transformer"))
        woke = await ctl.wake()
        assert (woke.phase, woke.moved, woke.asleep) == (
            Phase.AWAKE, ("text_encoder", "transformer"), ())
        assert fingerprints(pipe) == sums


async def test_components_already_where_a_call_puts_them_are_a_noop() -> None:
    """A sleep of an asleep component and a wake of awake ones succeed doing nothing."""
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(small_pipeline())
        await ctl.sleep(components=["vae"])
        again = await ctl.sleep(components=["vae"])
        assert (again.success, again.message, again.bytes_moved) == (True, "already sleeping", 0)
        awake = await ctl.wake(components=["transformer", "text_encoder"])
        assert (awake.success, awake.message, awake.asleep) == (True, "already awake", ("vae",))


async def test_unknown_selectors_and_foreign_discards_are_refused_and_nothing_moves() -> None:
    """A selector naming nothing the pipeline holds, an empty list, and a discard of a
    component the sleep does not release: InvalidRequest naming what is valid; nothing moved."""
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(small_pipeline())
        before = device_bytes(ctl)
        for kwargs, words in [({"components": ["transfromer"]}, "'transfromer' name(s) nothing"),
                              ({"components": []}, "components is empty"),
                              ({"components": ["image_encoder"]}, "'image_encoder' name(s)"),
                              ({"components": ["vae"], "discard": ["transformer"]},
                               "discard names ['transformer'], which this sleep does not")]:
            with pytest.raises(InvalidRequest) as caught:
                await ctl.sleep(**kwargs)  # type: ignore[arg-type]
            assert words in str(caught.value)
        assert device_bytes(ctl) == before and ctl.asleep == frozenset()


async def test_a_discarding_partial_sleep_drops_only_the_components_it_releases() -> None:
    """sleep(components=["transformer"], discard=True) discards the transformer (stale after
    the wake) and keeps the others' weights; the text encoder sleeping later keeps a copy."""
    pipe = small_pipeline()
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(pipe)
        kept = ctl.weights_checksum(["text_encoder", "vae"])
        slept = await ctl.sleep(components=["transformer"], discard=True)
        assert slept.discarded == ("transformer",)
        second = await ctl.sleep(components=["text_encoder"], discard=False)
        assert second.discarded == ()
        await ctl.wake()
        assert set(ctl.stale) == {"transformer"}
        assert ctl.weights_checksum(["text_encoder", "vae"]) == kept


async def test_a_fault_in_a_partial_sleep_rolls_it_back() -> None:
    """The second copy of a two-component partial sleep fails (a pipeline on the device at
    attach: its sleep copies): both stay on the device and awake, the weights unchanged; the
    same sleep then succeeds."""
    layer = faulty_device()
    pipe = small_pipeline()
    layer.place(*pipe.values())
    async with LifecycleController(device_layer=layer) as ctl:
        await ctl.attach(pipe)
        before, sums = device_bytes(ctl), fingerprints(pipe)
        layer.arm(copy_at=2)
        with pytest.raises(TransitionFailed):
            await ctl.sleep(components=["transformer", "vae"])
        assert (ctl.phase, ctl.asleep, device_bytes(ctl)) == (Phase.AWAKE, frozenset(), before)
        assert fingerprints(pipe) == sums
        done = await ctl.sleep(components=["transformer", "vae"])
        assert done.moved == ("transformer", "vae")


async def test_a_residency_change_while_partly_asleep_is_refused() -> None:
    """set_residency while some components are asleep is rejected, naming them."""
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(small_pipeline())
        await ctl.sleep(components=["vae"])
        with pytest.raises(TransitionRejected) as caught:
            await ctl.set_residency("vae=component-offload")
        assert "components ['vae'] are asleep" in str(caught.value)


async def test_a_use_with_auto_wake_wakes_the_asleep_component() -> None:
    """With auto_wake a use of an asleep component wakes it and runs."""
    async with LifecycleController("cpu", auto_wake=True) as ctl:
        await ctl.attach(small_pipeline())
        await ctl.sleep(components=["dit"])
        async with ctl.use("transformer"):
            assert ctl.asleep == frozenset()


@pytest.mark.parametrize("residency", [None, "vae=component-offload",
                                       "transformer=snapshot-offload"])
async def test_a_detach_while_partly_asleep_gives_every_weight_back(residency: str | None
                                                                    ) -> None:
    """Whatever the residency, a partial sleep, a use of the awake component, a partial wake
    and a detach leave every tensor of the pipeline bit for bit as attached."""
    pipe = small_pipeline()
    sums = fingerprints(pipe)
    async with LifecycleController("cpu", residency=residency) as ctl:
        await ctl.attach(pipe)
        assert (await ctl.sleep(components=["vae", "transformer"])).moved == ("transformer",
                                                                              "vae")
        async with ctl.use("text_encoder"):
            pass
        assert (await ctl.wake(components="vae")).asleep == ("transformer",)
        assert await ctl.detach() is Phase.UNINITIALIZED
    assert fingerprints(pipe) == sums


async def test_the_default_discard_of_a_partial_release_keeps_to_what_it_releases() -> None:
    """With discard_on_release=["transformer"], a release of the VAE alone keeps its host
    copy (and is not refused); a release of the transformer discards it."""
    async with LifecycleController("cpu", discard_on_release=["transformer"]) as ctl:
        await ctl.attach(small_pipeline())
        vae = await ctl.release_memory_occupation(components=["vae"])
        assert (vae.moved, vae.discarded) == (("vae",), ())
        dit = await ctl.release_memory_occupation(components=["dit"])
        assert (dit.moved, dit.discarded) == (("transformer",), ("transformer",))
