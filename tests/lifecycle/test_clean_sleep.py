"""A clean sleep (nothing changed since the mirrors were made) moves no byte: it re-points
tensors and releases device storages, with no thread hop and no event built for nobody."""

from __future__ import annotations

import gc
import logging
import weakref
from collections.abc import Callable
from typing import Any

import anyio.to_thread
import pytest
import torch
from torch import nn

from lifecycle import LifecycleController
from lifecycle._events import MOVE_PREPARED, TRANSITION_COMMITTED, get_logger, wanted
from lifecycle._units import gbps
from lifecycle.testing import capture_events
from strategies import CpuDevice
from tests.helpers import fingerprints, layer, run_pipeline, small_pipeline

pytestmark = pytest.mark.anyio


async def slept_once() -> tuple[LifecycleController, dict[str, nn.Module]]:
    """An attached pipeline (in eval mode: a training-mode forward may write buffers without
    a version bump, so it marks them stale) whose host mirrors are current."""
    pipe = small_pipeline()
    for module in pipe.values():
        module.eval()
    ctl = LifecycleController(device_layer=CpuDevice())  # (the ordering layer syncs)
    await ctl.attach(pipe)
    await ctl.sleep()
    await ctl.wake()
    return ctl, pipe


async def test_a_clean_sleep_moves_no_byte_and_never_hops_to_a_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing changed since the last sleep (a forward only read the weights): the sleep
    copies nothing, starts no worker thread (on the CPU layer: nothing to synchronize),
    releases every device byte, and the wake gives the same weights and outputs."""
    ctl, pipe = await slept_once()
    async with ctl:
        before, outputs = fingerprints(pipe), run_pipeline(pipe)
        hops: list[Callable[..., Any]] = []
        run_sync = anyio.to_thread.run_sync

        async def counted(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            hops.append(func)
            return await run_sync(func, *args, **kwargs)

        monkeypatch.setattr(anyio.to_thread, "run_sync", counted)
        result = await ctl.sleep()
        monkeypatch.undo()
        assert result.success and result.bytes_moved == 0 and hops == []
        assert result.bytes_released == sum(ctl.strategy(n).store.nbytes for n in ctl.components)
        assert ctl.report().device_bytes == 0
        await ctl.wake()
        assert fingerprints(pipe) == before
        assert all(torch.equal(a, b) for a, b in zip(run_pipeline(pipe), outputs, strict=True))


async def test_events_are_not_built_when_nobody_listens(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no sink and the library's loggers above info, a sleep builds neither its summary
    nor its per-component events (their fields are never computed); with a sink, both are."""
    logging.getLogger("lifecycle").setLevel(logging.WARNING)
    gc.collect()  # metrics of earlier tests left for the collector drop their sinks
    try:
        assert not wanted(get_logger("lifecycle"), logging.INFO)
        ctl, _ = await slept_once()
        async with ctl:

            def boom(*_: object) -> float:
                raise AssertionError("an event's fields were computed for nobody")

            with monkeypatch.context() as patch:
                # The rate every event of a sleep carries (the summary's and each component's):
                # the function itself fails, wherever the library calls it from.
                patch.setattr(gbps, "__code__", boom.__code__)
                assert (await ctl.sleep()).success
            await ctl.wake()
            with capture_events() as seen:
                assert wanted(get_logger("lifecycle"), logging.DEBUG)
                assert (await ctl.sleep()).success
            names = [e["event"] for e in seen]
            assert names.count(MOVE_PREPARED) == len(ctl.components)
            summary = [e for e in seen if e["event"] == TRANSITION_COMMITTED]
            assert [(e["trigger"], e["bytes"]) for e in summary] == [("sleep", 0)]
    finally:
        logging.getLogger("lifecycle").setLevel(logging.NOTSET)


async def test_a_change_after_a_clean_sleep_is_still_copied() -> None:
    """The fast checks still see a change: one tensor written in place is copied at the next
    sleep (only its unit), and the woken weights hold the change."""
    ctl, pipe = await slept_once()
    async with ctl:
        assert (await ctl.sleep()).bytes_moved == 0
        await ctl.wake()
        weight = layer(pipe["transformer"], 0, nn.Linear).weight
        with torch.no_grad():
            weight.add_(1.0)
        expected = fingerprints(pipe)
        result = await ctl.sleep()
        assert result.bytes_moved == weight.nbytes
        await ctl.wake()
        assert fingerprints(pipe) == expected


async def test_held_bytes_are_exact_across_sleeps() -> None:
    """The layer's held device bytes (deaths drained lazily) change by exactly the placed
    device bytes at every wake and sleep (no drift over cycles), the peak is the largest of
    them, and an allocation counts until its storage dies."""
    layer = CpuDevice()
    async with LifecycleController(device_layer=layer) as ctl:
        await ctl.attach(small_pipeline())
        nbytes = ctl.report().device_bytes
        await ctl.sleep()
        gc.collect()
        asleep = layer.held_bytes
        assert asleep == 0  # a buffer viewing a temporary no longer keeps the temporary's storage
        for _ in range(5):
            await ctl.wake()
            assert layer.held_bytes == asleep + ctl.report().device_bytes == asleep + nbytes
            await ctl.sleep()
            gc.collect()
            assert layer.held_bytes == asleep and ctl.report().device_bytes == 0
        assert layer.peak_bytes == asleep + nbytes
        layer.reset_peak()
        assert layer.peak_bytes == layer.held_bytes
        held = layer.held_bytes
        extra = layer.alloc(1000, "device")
        assert layer.held_bytes == held + 1000 == layer.peak_bytes
        del extra
        assert layer.held_bytes == held



class _ViewBuffers(nn.Module):
    """Buffers that are views of temporaries, as real models register them: an expanded
    ``arange`` (position ids), a slice of a larger table, a row of a detached weight."""

    ids: torch.Tensor
    pe: torch.Tensor
    row: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer("ids", torch.arange(8).expand(2, -1), persistent=False)
        self.register_buffer("pe", torch.linspace(0, 1, 64).reshape(8, 8)[:, :8])
        self.register_buffer("row", self.proj.weight.detach()[0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(x + self.pe[0] + self.row)
        return out + self.ids[0].float()


async def test_a_buffer_viewing_a_temporary_lets_the_temporary_go_at_sleep() -> None:
    """The storages behind view buffers are freed by a sleep (nothing stays held on the
    device), while each buffer stays the same object with the same values, and outputs
    after a wake are exact."""
    module = _ViewBuffers()
    bases = [weakref.ref(b._base.untyped_storage()) for b in (module.ids, module.pe)
             if b._base is not None]
    assert len(bases) == 2
    x = torch.linspace(-1, 1, 16).reshape(2, 8)
    with torch.no_grad():
        expected = module(x)
    objects = [module.ids, module.pe, module.row]
    values = [t.clone() for t in objects]
    layer = CpuDevice()
    async with LifecycleController(device_layer=layer) as ctl:
        await ctl.attach({"transformer": module})
        assert all(a is b for a, b in zip([module.ids, module.pe, module.row], objects, strict=True))
        assert all(torch.equal(t, v) for t, v in zip(objects, values, strict=True))
        await ctl.sleep()
        gc.collect()
        assert layer.held_bytes == 0 and all(ref() is None for ref in bases)
        await ctl.wake()
        with torch.no_grad():
            assert torch.equal(module(x), expected)
