"""Sleep releases every device byte; wake restores every tensor bit-identically."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lifecycle import LifecycleController, Phase
from tests.helpers import (
    attach_allocates,
    faulty_device,
    fingerprints,
    layer,
    new_on_the_device,
    run_pipeline,
    small_pipeline,
    tensor_ids,
    tied_lm,
)

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


def total_bytes(pipe: dict[str, nn.Module]) -> int:
    """Bytes of every distinct storage in the pipeline."""
    seen: dict[int, int] = {}
    for m in pipe.values():
        for t in list(m.parameters()) + list(m.buffers()):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


async def test_sleep_releases_every_device_byte_and_wake_restores_them() -> None:
    """After sleep the report shows zero device bytes; after wake all bytes are back."""
    pipe = small_pipeline()
    ctl = LifecycleController("cpu")
    await ctl.attach(pipe)
    total = total_bytes(pipe)
    assert ctl.report().device_bytes == total
    slept = await ctl.sleep()
    report = ctl.report()
    assert (report.phase, report.device_bytes, report.host_bytes) == (Phase.SLEEPING, 0, total)
    assert slept.bytes_released == total
    assert all(c.device_bytes == 0 for c in report.components.values())
    await ctl.wake()
    assert ctl.report().device_bytes == total


async def test_hundred_cycles_keep_weights_outputs_and_identity() -> None:
    """100 sleep/wake cycles: checksums, outputs and tensor objects are unchanged."""
    pipe = small_pipeline()
    ctl = LifecycleController("cpu")
    await ctl.attach(pipe)
    sums, outputs, ids = fingerprints(pipe), run_pipeline(pipe), tensor_ids(pipe)
    for _ in range(100):
        await ctl.sleep()
        await ctl.wake()
    assert fingerprints(pipe) == sums
    assert tensor_ids(pipe) == ids
    for a, b in zip(outputs, run_pipeline(pipe), strict=True):
        assert torch.equal(a, b)


async def test_wake_keeps_dtype_shape_requires_grad_and_tied_weights() -> None:
    """Every tensor comes back with its metadata; tied weights are still one tensor."""
    pipe = small_pipeline()
    layer(pipe["transformer"], 0, nn.Linear).bias.requires_grad_(False)
    pipe["transformer"].half()
    meta = {k: (t.dtype, t.shape, t.requires_grad) for k, t in
            pipe["transformer"].state_dict(keep_vars=True).items()}
    ctl = LifecycleController("cpu")
    await ctl.attach(pipe)
    await ctl.sleep()
    await ctl.wake()
    after = {k: (t.dtype, t.shape, t.requires_grad) for k, t in
             pipe["transformer"].state_dict(keep_vars=True).items()}
    assert after == meta
    lm = tied_lm(pipe)
    assert lm.head.weight is lm.embed.weight
    # The buffer that views the embedding's storage still shares it.
    assert lm.first_row.untyped_storage().data_ptr() == lm.embed.weight.untyped_storage().data_ptr()


async def test_unchanged_weights_sleep_without_copying_and_mirrors_are_reused() -> None:
    """The first sleep fills the mirrors (a pipeline in host memory attaches with them
    made, current: it copies nothing either); later sleeps copy nothing and allocate no host
    memory."""
    layer = faulty_device()
    pipe = small_pipeline()
    made_at_attach = attach_allocates(pipe["transformer"], layer)
    ctl = LifecycleController(device_layer=layer)
    await ctl.attach(pipe)
    first = await ctl.sleep()
    assert first.bytes_moved == (0 if made_at_attach else total_bytes(pipe))
    await ctl.wake()
    host_allocs = layer.host_allocations
    copies = layer.copies
    second = await ctl.sleep()
    assert second.bytes_moved == 0
    assert layer.copies == copies
    assert layer.host_allocations == host_allocs
    assert second.bytes_released == total_bytes(pipe)


async def test_in_place_change_while_awake_is_copied_on_the_next_sleep() -> None:
    """A parameter changed in place, and a buffer updated by a train-mode forward, are
    detected by their version and copied; nothing else is."""
    pipe = small_pipeline()
    ctl = LifecycleController("cpu")
    await ctl.attach(pipe)
    await ctl.sleep()
    await ctl.wake()
    weight = layer(pipe["transformer"], 0, nn.Linear).weight
    with torch.no_grad():
        weight.mul_(2)
    expected = fingerprints(pipe)
    result = await ctl.sleep()
    assert result.bytes_moved == weight.nbytes
    await ctl.wake()
    assert fingerprints(pipe) == expected
    bn = layer(pipe["vae"], 1, nn.BatchNorm2d)
    bn.train()
    with torch.no_grad():
        pipe["vae"](torch.randn(2, 4, 5, 5))
    bn.eval()
    expected = fingerprints(pipe)
    result = await ctl.sleep()
    # running_mean, running_var, num_batches_tracked changed.
    assert result.bytes_moved == 8 * 4 + 8 * 4 + 8
    await ctl.wake()
    assert fingerprints(pipe) == expected


async def test_writes_through_dot_data_need_mark_dirty() -> None:
    """Writes via ``param.data`` bypass the version counter; mark_dirty() makes sleep copy them."""
    pipe = small_pipeline()
    ctl = LifecycleController("cpu")
    await ctl.attach(pipe)
    await ctl.sleep()
    await ctl.wake()
    layer(pipe["transformer"], 2, nn.Linear).weight.data.fill_(3.0)
    expected = fingerprints(pipe)
    ctl.mark_dirty(["transformer"])
    await ctl.sleep()
    await ctl.wake()
    assert fingerprints(pipe) == expected


async def test_replaced_parameter_is_picked_up_at_the_next_sleep() -> None:
    """A parameter re-pointed or replaced by the user while awake is inventoried again, not lost."""
    pipe = small_pipeline()
    ctl = LifecycleController("cpu")
    await ctl.attach(pipe)
    await ctl.sleep()
    await ctl.wake()
    lin = layer(pipe["transformer"], 0, nn.Linear)
    # (built on the device, as a GPU user would: host memory there would be refused)
    lin.weight.data = new_on_the_device(torch.full_like(lin.weight, 0.25), ctl.device_layer)
    lin.bias = nn.Parameter(new_on_the_device(torch.full_like(lin.bias, -1.0), ctl.device_layer))
    expected = fingerprints(pipe)
    await ctl.sleep()
    assert ctl.report().device_bytes == 0
    await ctl.wake()
    assert fingerprints(pipe) == expected
    assert layer(pipe["transformer"], 0, nn.Linear).bias is lin.bias


async def test_detach_then_reattach_round_trips_the_weights() -> None:
    """Weights left on the host by detach attach again with identical values."""
    pipe = small_pipeline()
    ctl = LifecycleController("cpu")
    await ctl.attach(pipe)
    expected = fingerprints(pipe)
    await ctl.detach()
    ctl2 = LifecycleController("cpu")
    await ctl2.attach(pipe)
    await ctl2.sleep()
    await ctl2.wake()
    assert fingerprints(pipe) == expected


async def test_parameter_replaced_while_offloaded_is_a_typed_refusal() -> None:
    """Replacing a tensor of a component that lives on the host is refused at the next
    sleep with a TransitionRejected naming the component; nothing moves."""
    from lifecycle import TransitionRejected

    pipe = small_pipeline()
    ctl = LifecycleController("cpu", residency="vae=component-offload")
    await ctl.attach(pipe)
    conv = layer(pipe["vae"], 0, nn.Conv2d)
    conv.weight = nn.Parameter(torch.zeros_like(conv.weight))
    before = ctl.report()
    with pytest.raises(TransitionRejected, match="component 'vae' was changed behind the "
                                                 "controller while offloaded"):
        await ctl.sleep()
    assert ctl.report() == before and ctl.phase is Phase.AWAKE
