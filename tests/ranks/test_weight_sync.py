"""Weight sync over a trainer's process group (gloo on 127.0.0.1, a fork-started trainer that
joins as RL trainers do): exact weights, 1 and 2 server ranks, a trainer killed or stalled
mid-broadcast, refusals that keep the trainer in step, init/destroy cycles that leak nothing,
LoRA merges over the group."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.distributed as dist
from torch import nn

from lifecycle import (
    DistributedUpdate,
    InvalidRequest,
    LifecycleController,
    RefusedBroadcast,
    SyncLifecycleController,
    WeightSyncGroupBroken,
    WeightSyncGroupMissing,
    WeightUpdateWhileSleeping,
)
from lifecycle._checksum import reference_checksum
from lifecycle._weight_sync import TensorSpec, broadcast_from_json, parse_specs
from tests.helpers import faulty_device, layer, small_pipeline
from tests.models.zoo import CASES
from tests.ranks.test_collective import TIMEOUT, run_ranks
from tests.ranks.trainer import Trainer, free_port

pytestmark = pytest.mark.anyio

GROUP = "weight_update_group"


@pytest.fixture(autouse=True)
def _quick_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's store looks up the host name of each peer it meets; a DNS server that drops a
    query makes that take glibc's 5 s timeout (a sandbox's resolver did, 1 in ~15): 1 s here."""
    monkeypatch.setenv("RES_OPTIONS", "timeout:1 attempts:1")


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    """A trainer process (forked before the test's event loop runs)."""
    t = Trainer()
    yield t
    t.close()


def metadata(named: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The update's metadata as the trainer posts it: names, dtype names, shapes."""
    return {"names": list(named), "dtypes": [str(t.dtype) for t in named.values()],
            "shapes": [list(t.shape) for t in named.values()]}


def shifted(module: nn.Module, delta: float) -> dict[str, torch.Tensor]:
    return {k: v.detach() + delta for k, v in module.named_parameters()}


async def joined(trainer: Trainer, ctl: LifecycleController, **kwargs: Any) -> int:
    """``ctl`` and ``trainer`` in one new group on a fresh port; returns the port."""
    port = trainer.init()
    result = await ctl.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo",
                                                 timeout=10.0, **kwargs)
    assert result.success, result.message
    assert trainer.result() == ("init", "ok")
    return port


async def test_a_broadcast_lands_exactly_in_a_real_model_in_buckets(trainer: Trainer) -> None:
    """A tiny FluxTransformer2DModel served layerwise-offloaded receives another seed's
    parameters over gloo in buckets of 16 KiB: its checksum is the trainer's, it computes
    what the trainer's model computes, and staging never held more than one bucket."""
    case = CASES["flux"]
    served, source = case.build(0), case.build(1)
    async with LifecycleController("cpu", residency="transformer=layerwise-offload") as ctl:
        await ctl.attach({"transformer": served})
        await joined(trainer, ctl, bucket_bytes=16 * 2**10)
        named = {k: v.detach() for k, v in source.named_parameters()}
        trainer.broadcast(list(named.values()))
        result = await ctl.update_weights_from_distributed(
            **metadata(named), group_name=GROUP, target_modules=["transformer"], weight_version="1")
        assert (result.success, result.version, result.weight_version) == (True, 1, "1")
        assert trainer.result()[0] == "broadcast"
        assert ctl.weights_checksum() == {"transformer": reference_checksum(source.named_parameters())}
        async with ctl.use("transformer") as module:
            assert torch.equal(case.run(module), case.run(source))
        group = ctl.weight_update_groups[GROUP]
        largest = max(-(-(t.nbytes + 64) // 64) * 64 for t in named.values())  # slot: + canary
        assert 0 < group.peak_staging_bytes <= max(16 * 2**10, largest)
        assert (group.broken, group.updates, group.rank, group.world_size) == (None, 1, 1, 2)
        await ctl.aclose()
        assert ctl.weight_update_groups == {}


def test_two_server_ranks_take_one_broadcast_and_refuse_together(tmp_path: Path) -> None:
    """Two collective server ranks (ranks 1 and 2 of the trainer's group) both receive each
    broadcast: an update commits on both; one that rank 2 must refuse (its model differs) is
    refused on both, both still receive the broadcast (the trainer's completes) and the
    group stays usable for the next update."""
    trainer = Trainer()
    source = small_pipeline(seed=1)["transformer"]
    first = {k: v for k, v in shifted(source, 1.0).items() if k.startswith("0.")}
    refused = shifted(source, 2.0)
    last = {k: v for k, v in shifted(source, 3.0).items() if k.startswith("0.")}
    port = trainer.init(world_size=3, timeout=30.0)  # each rank starts its fork server first
    for named in (first, refused, last):
        trainer.broadcast(list(named.values()))

    async def scenario(rank: int, world: int, tmp: Path) -> dict[str, Any]:
        async with LifecycleController(device_layer=faulty_device(), process_group=dist.group.WORLD,
                                       collective_timeout=TIMEOUT) as ctl:
            pipe = small_pipeline()
            if rank == 1:
                pipe["transformer"] = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 17))
            await ctl.attach(pipe)
            init = await ctl.init_weights_update_group("127.0.0.1", port, 1, 3, backend="gloo",
                                                       timeout=10.0)
            out: dict[str, Any] = {"init": (init.success, init.group and init.group.rank)}
            for key, named in (("first", first), ("refused", refused), ("last", last)):
                result = await ctl.update_weights_from_distributed(**metadata(named),
                                                                   timeout=10.0)
                out[key] = (result.success, result.version, sorted(result.failed_ranks))
            out["layer0"] = {k: torch.equal(v, last[k])
                             for k, v in pipe["transformer"].state_dict().items() if k in last}
            out["broken"] = ctl.weight_update_groups[GROUP].broken
            await ctl.aclose()
            return out

    try:
        out = run_ranks(scenario, tmp_path)
        answers = [trainer.result() for _ in range(4)]
    finally:
        trainer.close()
    assert [a[0] for a in answers] == ["init", "broadcast", "broadcast", "broadcast"]
    for rank in (0, 1):
        assert out[rank] == {"init": (True, rank + 1), "first": (True, 1, []),
                             "refused": (False, 1, [1]), "last": (True, 2, []),
                             "layer0": {"0.weight": True, "0.bias": True}, "broken": None}


async def test_a_trainer_killed_mid_broadcast_fails_the_update_and_breaks_the_group(
        trainer: Trainer) -> None:
    """The trainer is killed after two of four tensors (two buckets written): the update
    fails at once (well within its timeout) and rolls back, the pipeline is exactly as
    before, the group is reported broken and refuses updates until destroyed; a new group
    with a new trainer then works."""
    pipe = small_pipeline()
    async with LifecycleController(device_layer=faulty_device()) as ctl:
        await ctl.attach(pipe)
        await joined(trainer, ctl, bucket_bytes=1024)
        named = shifted(small_pipeline(seed=1)["transformer"], 1.0)
        sums = ctl.weights_checksum(algorithm="full")
        trainer.broadcast(list(named.values()), die_after=2)
        t0 = time.perf_counter()
        result = await ctl.update_weights_from_distributed(**metadata(named), timeout=20.0,
                                                           weight_version="lost")
        assert time.perf_counter() - t0 < 5.0
        assert (result.success, result.rolled_back, result.version) == (False, True, 0)
        assert result.weight_version is None
        assert "WeightSyncTransferFailed: the trainer's broadcast of tensor 3/4 '2.weight'" \
            in result.message
        assert result.causes == ("WeightSyncTransferFailed",)
        assert ctl.weights_checksum(algorithm="full") == sums
        broken = ctl.weight_update_groups[GROUP].broken
        assert broken is not None and "tensor 3/4 '2.weight'" in broken
        with pytest.raises(WeightSyncGroupBroken, match="destroy it and init it again"):
            await ctl.update_weights_from_distributed(**metadata(named))
        assert (await ctl.destroy_weights_update_group(GROUP)).success
        again = Trainer()
        try:
            await joined(again, ctl)
            again.broadcast(list(named.values()))
            assert (await ctl.update_weights_from_distributed(**metadata(named))).success
            assert again.result()[0] == "broadcast"
        finally:
            again.close()
        assert all(torch.equal(v, named[k]) for k, v in pipe["transformer"].named_parameters())


async def test_a_stalled_trainer_fails_the_update_after_its_timeout(trainer: Trainer) -> None:
    """A trainer that stops after one tensor makes the update fail at its deadline (the
    timeout, for the whole broadcast): rolled back, the group broken."""
    async with LifecycleController("cpu") as ctl:
        pipe = small_pipeline()
        await ctl.attach(pipe)
        await joined(trainer, ctl)
        named = shifted(pipe["transformer"], 1.0)
        sums = ctl.weights_checksum(algorithm="full")
        trainer.broadcast(list(named.values()), stall_after=1)
        t0 = time.perf_counter()
        result = await ctl.update_weights_from_distributed(**metadata(named), timeout=0.5)
        assert 0.4 < time.perf_counter() - t0 < 5.0
        assert (result.success, result.rolled_back) == (False, True)
        assert ctl.weights_checksum(algorithm="full") == sums
        assert ctl.weight_update_groups[GROUP].broken is not None
        trainer.kill()


async def test_a_fault_while_writing_rolls_back_and_keeps_the_trainer_in_step(
        trainer: Trainer) -> None:
    """A copy failing while the second bucket is written rolls every written tensor back;
    the rest of the broadcast is still received (the trainer's completes), the group stays
    usable and the retry commits."""
    layer = faulty_device()
    async with LifecycleController(device_layer=layer) as ctl:
        pipe = small_pipeline()
        await ctl.attach(pipe)
        await joined(trainer, ctl, bucket_bytes=1024)
        named = shifted(pipe["transformer"], 1.0)
        sums = ctl.weights_checksum(algorithm="full")
        trainer.broadcast(list(named.values()))
        layer.arm(copy_at=2)
        result = await ctl.update_weights_from_distributed(**metadata(named))
        assert (result.success, result.rolled_back) == (False, True)
        assert "InjectedFault" in result.message
        assert trainer.result()[0] == "broadcast"
        assert ctl.weights_checksum(algorithm="full") == sums
        assert ctl.weight_update_groups[GROUP].broken is None
        trainer.broadcast(list(named.values()))
        assert (await ctl.update_weights_from_distributed(**metadata(named))).success
        assert all(torch.equal(v, named[k]) for k, v in pipe["transformer"].named_parameters())


async def test_a_cancelled_update_finishes_its_receive_rolls_back_and_breaks_the_group(
        trainer: Trainer) -> None:
    """Cancelled while waiting for a stalled trainer, the update stops the group's receiving
    process (no receive is left writing into the staging buffer), rolls back (answering
    that, or raising the cancellation) and breaks the group."""
    async with LifecycleController("cpu") as ctl:
        pipe = small_pipeline()
        await ctl.attach(pipe)
        await joined(trainer, ctl, bucket_bytes=1024)
        named = shifted(pipe["transformer"], 1.0)
        sums = ctl.weights_checksum(algorithm="full")
        trainer.broadcast(list(named.values()), stall_after=2)
        t0 = time.perf_counter()
        result = None
        with anyio.move_on_after(0.1):
            result = await ctl.update_weights_from_distributed(**metadata(named), timeout=0.5)
        assert time.perf_counter() - t0 < 5.0
        assert result is None or (result.success, result.rolled_back) == (False, True)
        assert ctl.weights_checksum(algorithm="full") == sums and ctl.weights_version == 0
        assert ctl.weight_update_groups[GROUP].broken is not None
        trainer.kill()


async def test_refusals_come_before_the_broadcast_and_keep_the_trainer_in_step(
        trainer: Trainer) -> None:
    """A wrong shape, a wrong dtype, an unknown name, a sleeping pipeline and a bad mode are
    refused (each naming the fault) before anything is written; the server still receives
    each broadcast, so the trainer's completes and the next update on the group commits."""
    async with LifecycleController("cpu") as ctl:
        pipe = small_pipeline()
        await ctl.attach(pipe)
        await joined(trainer, ctl)
        good = shifted(pipe["transformer"], 1.0)
        sums = ctl.weights_checksum(algorithm="full")
        wrong_shape = dict(good, **{"0.weight": torch.zeros(16, 32)})
        wrong_dtype = dict(good, **{"0.bias": torch.zeros(32, dtype=torch.float64)})
        unknown = dict(good, **{"9.weight": torch.zeros(3)})
        cases = [(wrong_shape, "Shape mismatch for 0.weight: model=(32, 16), sent=(16, 32)"),
                 (wrong_dtype, "dtype mismatch for 0.bias: model=torch.float32, sent=torch.float64 "
                               "(send it in the model's dtype)"),
                 (unknown, "1 name(s) match no parameter or buffer of transformer: ['9.weight']")]
        for named, message in cases:
            trainer.broadcast(list(named.values()))
            result = await ctl.update_weights_from_distributed(**metadata(named), timeout=10.0)
            assert (result.success, result.rolled_back) == (False, False)
            assert result.message == message + "; nothing was updated"
            assert trainer.result()[0] == "broadcast"
        trainer.broadcast(list(good.values()))
        with pytest.raises(InvalidRequest, match="weight_update_mode must be one of"):
            await ctl.update_weights_from_distributed(**metadata(good), weight_update_mode="bad")
        assert trainer.result()[0] == "broadcast"
        refusal = DistributedUpdate.parse({**metadata(good), "bucket_bytes": 0})
        assert isinstance(refusal, RefusedBroadcast)
        trainer.broadcast(list(good.values()))
        with pytest.raises(InvalidRequest, match="bucket_bytes must be a positive int") as info:
            await ctl.update_from_broadcast(refusal)
        assert info.value.field == "bucket_bytes"
        assert trainer.result()[0] == "broadcast"
        await ctl.sleep()
        trainer.broadcast(list(good.values()))
        with pytest.raises(WeightUpdateWhileSleeping):
            await ctl.update_weights_from_distributed(**metadata(good))
        assert trainer.result()[0] == "broadcast"
        await ctl.wake()
        assert ctl.weights_checksum(algorithm="full") == sums and ctl.weights_version == 0
        trainer.broadcast(list(good.values()))
        assert (await ctl.update_weights_from_distributed(**metadata(good))).success
        assert all(torch.equal(v, good[k]) for k, v in pipe["transformer"].named_parameters())
        assert ctl.weight_update_groups[GROUP].broken is None


def _process_counts() -> tuple[int, int, int]:
    """Open file descriptors, threads and resident bytes of this process."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task")), rss


async def test_twenty_destroy_init_cycles_leak_no_ports_threads_or_memory(
        trainer: Trainer) -> None:
    """Destroy (absent at first: a success), init and one update, 20 times over one master
    port: file descriptors (sockets), threads and memory come back to where they were."""
    async with LifecycleController("cpu") as ctl:
        pipe = small_pipeline()
        await ctl.attach(pipe)
        port = free_port()  # one master port for every cycle, as trainers do
        named = {"0.bias": torch.zeros(32)}
        counts = []
        for cycle in range(22):
            destroyed = await ctl.destroy_weights_update_group(GROUP)
            assert destroyed.success
            if cycle:
                trainer.destroy()
                assert trainer.result() == ("destroy", "ok")
            else:
                assert "does not exist" in destroyed.message
            assert trainer.init(port=port) == port
            assert (await ctl.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo",
                                                        timeout=10.0)).success
            assert trainer.result() == ("init", "ok")
            named["0.bias"] = named["0.bias"] + 1
            trainer.broadcast([named["0.bias"]])
            assert (await ctl.update_weights_from_distributed(**metadata(named))).success
            assert trainer.result()[0] == "broadcast"
            if cycle in (1, 21):  # after a warm-up cycle, and after 20 more
                counts.append(_process_counts())
        (fds0, threads0, rss0), (fds1, threads1, rss1) = counts
        assert fds1 <= fds0 and threads1 <= threads0, counts
        assert rss1 - rss0 < 16 * 2**20, counts
        assert torch.equal(layer(pipe["transformer"], 0, nn.Linear).bias, torch.full((32,), 22.0))


async def test_bad_group_calls_are_typed_errors_and_a_missing_trainer_a_failed_join() -> None:
    """Init arguments out of range are InvalidRequest naming the field; an update on no
    group is WeightSyncGroupMissing; destroying an absent group succeeds; a join nobody
    answers fails within its timeout with a failed result."""
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(small_pipeline())
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"master_port": 0}, "master_port", "master_port must be in 1..65535, got 0"),
            ({"rank_offset": 0}, "rank_offset", "rank_offset must be in 1..world_size-1 (the "
                                                "trainer is rank 0), got 0 with world_size 2"),
            ({"world_size": 1}, "rank_offset", "rank_offset must be in 1..world_size-1"),
            ({"backend": "mpi"}, "backend", "backend must be one of ['gloo', 'nccl'], got 'mpi'"),
            ({"backend": "nccl"}, "backend", "backend 'nccl' needs a CUDA device; this controller "
                                             "serves cpu (use 'gloo')"),
            ({"timeout": 0}, "timeout", "timeout must be a positive float, got 0"),
            ({"group_name": ""}, "group_name", "group_name must be a non-empty string of at most 256 "
                                               "characters, got ''"),
        ]
        for change, field, message in cases:
            args: dict[str, Any] = {"master_address": "127.0.0.1", "master_port": 29500,
                                    "rank_offset": 1, "world_size": 2, "backend": "gloo"} | change
            with pytest.raises(InvalidRequest) as info:
                await ctl.init_weights_update_group(**args)
            assert info.value.field == field and str(info.value).startswith(message)
        with pytest.raises(WeightSyncGroupMissing, match="'g' is not initialized; call "
                                                         "init_weights_update_group first"):
            await ctl.update_weights_from_distributed(["0.bias"], ["float32"], [[32]], "g")
        assert (await ctl.destroy_weights_update_group("g")).success
        t0 = time.perf_counter()
        failed = await ctl.init_weights_update_group("127.0.0.1", free_port(), 1, 2,
                                                     backend="gloo", timeout=0.3)
        assert time.perf_counter() - t0 < 5.0
        assert not failed.success and failed.message.startswith(
            "Failed to initialize weight update group 'weight_update_group' at 127.0.0.1:")
        assert ctl.weight_update_groups == {}


async def test_unreadable_metadata_breaks_the_group_and_a_second_init_is_refused(
        trainer: Trainer) -> None:
    """A tensor list the server cannot read (so it cannot follow the broadcast) raises
    InvalidRequest and breaks the group; a second init of a live group is refused."""
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(small_pipeline())
        port = await joined(trainer, ctl)
        with pytest.raises(InvalidRequest, match="already initialized; destroy it first"):
            await ctl.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo")
        with pytest.raises(InvalidRequest, match="dtypes must be torch dtype names such as"):
            await ctl.update_weights_from_distributed(["0.bias"], ["float33"], [[32]])
        assert ctl.weight_update_groups[GROUP].broken == \
            "a request whose tensor list could not be read"
        with pytest.raises(WeightSyncGroupBroken):
            await ctl.update_weights_from_distributed(["0.bias"], ["float32"], [[32]])
        trainer.kill()


def test_a_distributed_update_is_parsed_into_types_and_a_bad_field_is_a_refusal_naming_it(
        ) -> None:
    """parse gives the typed request (defaults for absent fields); a field it refuses comes
    back as a RefusedBroadcast naming the field, with the tensors it can still receive (none
    when the list is unreadable) and the timeout to receive them in; a group name or a
    weight version that is not a string is raised at once (there is nothing to receive)."""
    body: dict[str, Any] = {"names": ["a", "b"], "dtypes": ["torch.bfloat16", "int8"],
                            "shapes": [[2, 3], []], "timeout": 5, "weight_version": "v"}
    update = DistributedUpdate.parse(body)
    assert update == DistributedUpdate(
        (TensorSpec("a", torch.bfloat16, (2, 3)), TensorSpec("b", torch.int8, ())),
        timeout=5.0, weight_version="v")
    specs = update.specs if isinstance(update, DistributedUpdate) else None
    refusals: list[tuple[dict[str, Any], str, str, bool, float]] = [
            ({"timeout": 0}, "timeout", "timeout must be a positive float, got 0", True, 60.0),
            ({"weight_update_mode": "bad"}, "weight_update_mode", "weight_update_mode must be "
             "one of ['full', 'lora_merge'], got 'bad'", True, 5.0),
            ({"weight_update_mode": "lora_merge", "lora_rank": 0}, "lora_rank",
             "lora_rank must be an integer >= 1, got 0", True, 5.0),
            ({"bucket_bytes": 1.5}, "bucket_bytes", "bucket_bytes must be a positive int, got "
             "1.5", True, 5.0),
            ({"target_modules": ["a", "b"]}, "target_modules", "target_modules must name "
             "exactly one module, got ['a', 'b']", True, 5.0),
            ({"dtypes": ["float33", "int8"]}, "dtypes", "dtypes must be torch dtype names",
             False, 60.0)]
    for change, field, message, kept, timeout in refusals:
        refusal = DistributedUpdate.parse(body | change)
        assert isinstance(refusal, RefusedBroadcast), change
        assert (refusal.field, refusal.error.field) == (field, field)
        assert str(refusal.error).startswith(message), refusal.reason
        assert (refusal.specs == specs if kept else refusal.specs is None), change
        assert (refusal.group_name, refusal.timeout) == (GROUP, timeout)
    raised: list[tuple[dict[str, Any], str]] = [
        ({"group_name": 3}, "group_name"), ({"group_name": ""}, "group_name"),
        ({"weight_version": 3}, "weight_version")]
    for change, field in raised:
        with pytest.raises(InvalidRequest) as info:
            DistributedUpdate.parse(body | change)
        assert info.value.field == field


def test_a_distributed_update_and_a_refusal_read_back_from_their_json_are_equal() -> None:
    """to_json survives JSON (how the ranks of a server pass it on) and reads back equal."""
    for body in ({"names": ["x.lora_A.weight"], "dtypes": ["float32"], "shapes": [[4, 16]],
                  "weight_update_mode": "lora_merge", "lora_alpha": 8, "lora_rank": 4,
                  "group_name": "g", "target_modules": ["vae"], "bucket_bytes": 1024,
                  "flush_cache": True, "weight_version": "3"},
                 {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "timeout": -1},
                 {"names": "a", "dtypes": ["float32"], "shapes": [[1]]}):
        request = DistributedUpdate.parse(body)
        assert broadcast_from_json(json.loads(json.dumps(request.to_json()))) == request


def test_tensor_lists_are_read_strictly() -> None:
    """The three lists must agree, names be unique, dtypes torch names (with or without
    ``torch.``), shapes lists of sizes."""
    specs = parse_specs(["a", "b"], ["torch.bfloat16", torch.int8], [[2, 3], []])
    assert [(s.name, s.dtype, s.shape, s.nbytes) for s in specs] == [
        ("a", torch.bfloat16, (2, 3), 12), ("b", torch.int8, (), 1)]
    for names, dtypes, shapes, message in [
            ([], [], [], "names must be a non-empty list, got list"),
            ("ab", ["float32"], [[1]], "names must be a non-empty list, got str"),
            (["a", "b"], ["float32"], [[1], [1]], "one entry per tensor, got 2, 1 and 2"),
            (["a", "a"], ["float32"] * 2, [[1], [1]], "names must be unique, 'a' is given twice"),
            ([""], ["float32"], [[1]], r"names\[0\] must be a non-empty string"),
            (["a"], ["float32"], [[-1]], r"shapes\[0\] \(a\) must be a list of integers >= 0"),
            (["a"], ["Tensor"], [[1]], "dtypes must be torch dtype names")]:
        with pytest.raises(InvalidRequest, match=message):
            parse_specs(names, dtypes, shapes)


async def test_a_lora_adapter_broadcast_is_merged_into_the_base(trainer: Trainer) -> None:
    """PEFT-named LoRA tensors broadcast by the trainer merge exactly as in fp32."""
    async with LifecycleController("cpu") as ctl:
        pipe = small_pipeline()
        base = layer(pipe["transformer"], 0, nn.Linear).weight.detach().clone()
        await ctl.attach(pipe)
        await joined(trainer, ctl)
        gen = torch.Generator().manual_seed(0)
        named = {"base_model.model.0.lora_A.default.weight": torch.randn(4, 16, generator=gen),
                 "base_model.model.0.lora_B.default.weight": torch.randn(32, 4, generator=gen)}
        trainer.broadcast(list(named.values()))
        result = await ctl.update_weights_from_distributed(
            **metadata(named), weight_update_mode="lora_merge", lora_alpha=16, lora_rank=4)
        assert result.success, result.message
        a, b = named.values()
        assert torch.equal(layer(pipe["transformer"], 0, nn.Linear).weight, base + 4.0 * (b @ a))
        assert ctl.report().lora_base_bytes == base.nbytes


def test_the_blocking_facade_syncs_over_a_group(trainer: Trainer) -> None:
    """SyncLifecycleController offers init, update and destroy over a group."""
    pipe = small_pipeline()
    named = {"2.bias": torch.full((16,), 5.0)}
    with SyncLifecycleController("cpu") as ctl:
        ctl.attach(pipe)
        port = trainer.init()
        assert ctl.init_weights_update_group("127.0.0.1", port, 1, 2, backend="gloo").success
        trainer.broadcast(list(named.values()))
        result = ctl.update_weights_from_distributed(**metadata(named), weight_version="s")
        assert (result.success, ctl.weight_version_label) == (True, "s")
        assert list(ctl.weight_update_groups) == [GROUP]
        assert ctl.destroy_weights_update_group().success
    assert torch.equal(layer(pipe["transformer"], 2, nn.Linear).bias, named["2.bias"])
