"""Checksums as trainers compute them: the reference's component checksum (the default of
``weights_checksum``), ours (``algorithm="full"``), and the clients' per-tensor hash."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import pytest
import torch
from torch import nn

from lifecycle import InvalidRequest, LifecycleController, SyncLifecycleController, UnknownComponent
from tests.helpers import faulty_device, layer, small_pipeline

pytestmark = pytest.mark.anyio


def reference_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The reference's compute_weights_checksum, as it is written there."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda nt: nt[0]):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def client_tensor_sha256(t: torch.Tensor) -> str:
    """The reference clients' per-tensor hash: dtype, shape, then bytes."""
    h = hashlib.sha256()
    h.update(str(t.dtype).encode())
    h.update(repr(tuple(t.shape)).encode())
    h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


async def test_weights_checksum_is_the_references_in_every_residency_and_asleep() -> None:
    """The default checksum equals the reference's over each component's parameters, in
    resident, offloaded and layerwise placements, asleep and awake."""
    reference = small_pipeline()
    expected = {n: reference_checksum(m.named_parameters()) for n, m in reference.items()}
    pipe = small_pipeline()
    async with LifecycleController(device_layer=faulty_device(),
                                   residency="text_encoder=layerwise-offload,vae=component-offload,"
                                             "transformer=snapshot-offload") as ctl:
        await ctl.attach(pipe)
        assert ctl.weights_checksum() == expected
        await ctl.sleep()
        assert await ctl.weights_checksum_async() == expected
        await ctl.wake()
        assert ctl.weights_checksum(["vae"], algorithm="reference") == {"vae": expected["vae"]}


async def test_bfloat16_parameters_are_hashed_as_their_bytes() -> None:
    """A bfloat16 component hashes as the reference does (its bytes viewed as uint8)."""
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to(torch.bfloat16)
    expected = reference_checksum(module.named_parameters())
    async with LifecycleController("cpu") as ctl:
        await ctl.attach({"transformer": module})
        assert ctl.weights_checksum() == {"transformer": expected}


async def test_the_full_checksum_also_covers_buffers_and_the_reference_does_not() -> None:
    """A batch-norm running statistic changed behind the controller changes the "full"
    checksum (every tensor, with dtype and shape) and not the reference's (parameters)."""
    pipe = small_pipeline()
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(pipe)
        before = {a: ctl.weights_checksum(["vae"], algorithm=a) for a in ("reference", "full")}
        assert before["reference"] != before["full"]
        with torch.no_grad():
            running_mean = layer(pipe["vae"], 1, nn.BatchNorm2d).running_mean
            assert running_mean is not None
            running_mean.add_(1)
        assert ctl.weights_checksum(["vae"]) == before["reference"]
        assert ctl.weights_checksum(["vae"], algorithm="full") != before["full"]
        with pytest.raises(InvalidRequest, match=r"one of \['reference', 'full'\], got 'md5'"):
            ctl.weights_checksum(algorithm="md5")  # type: ignore[arg-type]


async def test_tensor_hashes_name_every_mismatched_and_missing_tensor() -> None:
    """check_tensor_hashes takes the clients' per-tensor SHA-256 (dtype, shape, bytes): all
    equal is a success; otherwise the answer names each mismatched and each missing tensor."""
    pipe = small_pipeline()
    async with LifecycleController("cpu", residency="transformer=component-offload") as ctl:
        await ctl.attach(pipe)
        state = small_pipeline()["transformer"].state_dict()
        expected = {name: client_tensor_sha256(t) for name, t in state.items()}
        same = await ctl.check_tensor_hashes("transformer", expected)
        assert same.as_dict() == {"success": True, "message": "all 4 tensor(s) of transformer match",
                                  "target_module": "transformer", "checked": 4, "mismatched": [],
                                  "missing": []}
        changed = dict(expected, **{"0.bias": client_tensor_sha256(state["0.bias"] + 1),
                                    "9.weight": expected["0.weight"]})
        differ = await ctl.check_tensor_hashes("transformer", changed)
        assert (differ.success, differ.mismatched, differ.missing) == (False, ("0.bias",),
                                                                       ("9.weight",))
        assert differ.message == ("2 of 5 tensor(s) of transformer do not match; 1 mismatched: "
                                  "['0.bias']; 1 missing from transformer: ['9.weight']")
        # The hash covers dtype and shape: the same bytes under another shape differ.
        flat = {"0.bias": client_tensor_sha256(state["0.bias"].reshape(4, 8))}
        assert (await ctl.check_tensor_hashes("transformer", flat)).mismatched == ("0.bias",)


async def test_tensor_hash_checks_refuse_bad_arguments() -> None:
    """An unknown module and a missing or malformed expectation are typed errors."""
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(small_pipeline())
        with pytest.raises(UnknownComponent, match=r"\['nope'\]. Available Module\(s\): "
                                                   r"\['text_encoder', 'transformer', 'vae'\]"):
            await ctl.check_tensor_hashes("nope", {"a": "00"})
        with pytest.raises(InvalidRequest, match="expected_named_tensors_sha256 is required"):
            await ctl.check_tensor_hashes("vae", {})
        with pytest.raises(InvalidRequest, match="to SHA-256 hex strings, got str: int"):
            await ctl.check_tensor_hashes("vae", {"0.weight": 5})  # type: ignore[dict-item]


def test_the_blocking_facade_offers_both_checksums_and_the_hash_check() -> None:
    """SyncLifecycleController forwards the algorithm and the per-tensor check."""
    pipe = small_pipeline()
    with SyncLifecycleController("cpu") as ctl:
        ctl.attach(pipe)
        assert ctl.weights_checksum(["vae"]) == {
            "vae": reference_checksum(pipe["vae"].named_parameters())}
        assert ctl.weights_checksum(algorithm="full") == \
            ctl.controller.weights_checksum(algorithm="full")
        bias = layer(pipe["vae"], 0, nn.Conv2d).bias
        assert bias is not None
        assert ctl.check_tensor_hashes("vae", {"0.bias": client_tensor_sha256(bias)}).success
