"""Weight sync over a trainer's process group through the HTTP routes (issue 23): a trainer
process over gloo broadcasting while the HTTP call is in flight, as the clients run them side
by side, against one server rank (in this process) and two (``residency serve --nproc 2``):
exact weights and LoRA merges, a wrong shape answered at once with the trainer kept in step,
a trainer killed mid-broadcast, bad bodies, and tensor-parallel uploads picked by GPU UUID."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator, Mapping
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save

from lifecycle import LifecycleController
from lifecycle.demo import DemoPipeline, parse_size
from tests.http.clients import (
    bucket_payload,
    reference_checksum,
    serialize,
    sharing,
    tensor_sha256,
)
from tests.http.server import Served, running_server, serving_ranks
from tests.ranks.trainer import Trainer, free_port

GROUP = "weight_update_group"
DNS = {"RES_OPTIONS": "timeout:1 attempts:1"}  # see tests/ranks/trainer.py


@pytest.fixture(autouse=True)
def _quick_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in DNS.items():
        monkeypatch.setenv(key, value)


@pytest.fixture
def trainer() -> Iterator[Trainer]:
    """A trainer process (forked from the fork server)."""
    t = Trainer()
    yield t
    t.close()


@pytest.fixture
def served() -> Iterator[Served]:
    """The demo pipeline (the smallest) served in this process by one rank."""
    with running_server(DemoPipeline.build(2**16), None, LifecycleController("cpu"),
                        process_groups=True) as s:
        yield s


def post(client: httpx.Client, path: str, body: Any) -> httpx.Response:
    return client.post(path, json=body)


def metadata(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The update's metadata as the clients post it: names, dtype names, shapes."""
    return {"names": [n for n, _ in named], "dtypes": [str(t.dtype) for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}


def update_body(named: list[tuple[str, torch.Tensor]], **extra: Any) -> dict[str, Any]:
    return {**metadata(named), "group_name": GROUP, "target_modules": ["transformer"], **extra}


def init_body(port: int, world_size: int = 2, **extra: Any) -> dict[str, Any]:
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": world_size, "group_name": GROUP, "backend": "gloo", "timeout": 10,
            **extra}


def random_like(named: Mapping[str, torch.Tensor], seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(t.shape, generator=gen).to(t.dtype)) for n, t in named.items()]


def oblong(named: list[tuple[str, torch.Tensor]]) -> str:
    """The name of the first tensor of ``named`` that is 2-D and not square."""
    return next(n for n, t in named if t.dim() == 2 and t.shape[0] != t.shape[1])


def transposed(named: list[tuple[str, torch.Tensor]], which: str
               ) -> list[tuple[str, torch.Tensor]]:
    """``named`` with the 2-D tensor ``which`` sent transposed (a wrong shape)."""
    return [(n, t.T.contiguous() if n == which else t) for n, t in named]


def joined(client: httpx.Client, trainer: Trainer, world_size: int = 2) -> None:
    port = trainer.init(world_size=world_size)
    r = post(client, "/init_weights_update_group", init_body(port, world_size))
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert trainer.result() == ("init", "ok")


def sync(client: httpx.Client, trainer: Trainer, named: list[tuple[str, torch.Tensor]],
         **extra: Any) -> httpx.Response:
    """The trainer broadcasts ``named`` while the update is posted, as the clients do."""
    trainer.broadcast([t for _, t in named])
    return post(client, "/update_weights_from_distributed", update_body(named, **extra))


def checksums(client: httpx.Client) -> dict[str, str]:
    result: dict[str, str] = post(client, "/get_weights_checksum", {}).json()
    return result


def test_a_trainer_syncs_exact_weights_and_a_lora_merge_over_http(
        served: Served, trainer: Trainer) -> None:
    """Destroy (absent: a success), init, an update while the trainer broadcasts: exact
    weights (the clients' checksum), the weight_version stored, the group in /state; a LoRA
    merge broadcast over the group is exact in fp32; destroy."""
    client = served.client
    r = post(client, "/destroy_weights_update_group", {"group_name": GROUP})
    assert r.status_code == 200 and "does not exist" in r.json()["message"]
    joined(client, trainer)
    group = client.get("/state").json()["weight_update_groups"][GROUP]
    assert (group["rank"], group["world_size"], group["backend"], group["broken"]) == \
        (1, 2, "gloo", None)
    module = served.pipe.modules["transformer"]
    new = random_like(dict(module.named_parameters()), seed=1)
    r = sync(client, trainer, new, weight_version="12", flush_cache=True,
             abort_all_requests=False)
    assert r.status_code == 200 and r.json()["weight_version"] == "12", r.text
    assert trainer.result()[0] == "broadcast"
    assert checksums(client)["transformer"] == reference_checksum(new)
    assert client.get("/get_weight_version").json() == {"weight_version": "12"}
    base = dict(new)["x_proj.weight"]
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(4, base.shape[1], generator=gen), torch.randn(base.shape[0], 4, generator=gen)
    r = sync(client, trainer, [("base_model.model.x_proj.lora_A.default.weight", a),
                               ("base_model.model.x_proj.lora_B.default.weight", b)],
             weight_update_mode="lora_merge", lora_alpha=8, lora_rank=4)
    assert r.status_code == 200, r.text
    assert trainer.result()[0] == "broadcast"
    assert torch.equal(module.get_parameter("x_proj.weight"), base + 2.0 * (b @ a))
    assert post(client, "/destroy_weights_update_group", {}).status_code == 200
    trainer.destroy()
    assert trainer.result() == ("destroy", "ok")
    assert client.get("/state").json()["weight_update_groups"] == {}


def test_a_wrong_shape_is_refused_at_once_and_a_killed_trainer_breaks_the_group(
        served: Served, trainer: Trainer) -> None:
    """A wrong shape and two target modules: 400 within seconds, the trainer's broadcast
    completes, nothing changes. The trainer killed mid-broadcast: a 400 saying the update was
    rolled back, the weights as before, the group reported broken and refusing updates until
    destroyed; a new trainer and a new init then sync again. A tensor announced too large to
    hold is a 400 that breaks the group (it cannot be drained)."""
    client = served.client
    joined(client, trainer)
    module = served.pipe.modules["transformer"]
    new = random_like(dict(module.named_parameters()), seed=3)
    name = oblong(new)
    weight = dict(new)[name]
    before = checksums(client)
    for named, extra, message in [
            (transposed(new, name), {},
             f"Shape mismatch for {name}: model={tuple(weight.shape)}, "
             f"sent={tuple(weight.T.shape)}; nothing was updated"),
            (new, {"target_modules": ["transformer", "vae"]},
             "target_modules must name exactly one module, got ['transformer', 'vae']")]:
        t0 = time.perf_counter()
        r = sync(client, trainer, named, **extra)
        assert r.status_code == 400 and r.json()["message"] == message, r.text
        assert time.perf_counter() - t0 < 5.0
        assert trainer.result()[0] == "broadcast"
    assert checksums(client) == before
    t0 = time.perf_counter()
    trainer.broadcast([t for _, t in new], die_after=2)
    r = post(client, "/update_weights_from_distributed", update_body(new, timeout=20))
    assert time.perf_counter() - t0 < 5.0
    assert r.status_code == 400 and r.json()["rolled_back"] is True, r.text
    assert "update failed and was rolled back; weights are unchanged: WeightSyncTransferFailed" \
        in r.json()["message"]
    assert checksums(client) == before
    broken = client.get("/state").json()["weight_update_groups"][GROUP]["broken"]
    assert broken is not None and "tensor 3/" in broken
    r = post(client, "/update_weights_from_distributed", update_body(new))
    assert r.status_code == 400 and "is broken" in r.json()["message"]
    assert post(client, "/destroy_weights_update_group", {"group_name": GROUP}).status_code == 200
    again = Trainer()
    try:
        joined(client, again)
        r = sync(client, again, new)
        assert r.status_code == 200, r.text
        assert again.result()[0] == "broadcast"
        # A tensor announced too large to hold cannot be drained: a 400, the group broken.
        r = post(client, "/update_weights_from_distributed", {
            "names": ["huge"], "dtypes": ["float32"], "shapes": [[10**30]]})
        assert r.status_code == 400 and r.json()["message"] == \
            "1 tensor(s) are over the 4294967296 bytes one group may stage " \
            "(max_staging_bytes): ['huge']; nothing was updated"
        broken = client.get("/state").json()["weight_update_groups"][GROUP]["broken"]
        assert "cannot be received here" in broken
    finally:
        again.close()
    assert checksums(client)["transformer"] == reference_checksum(new)


@pytest.mark.parametrize(("path", "body", "message"), [
    ("/init_weights_update_group", {"master_port": 29500, "rank_offset": 1, "world_size": 2},
     "master_address is required"),
    ("/init_weights_update_group", init_body(0), "master_port must be in 1..65535, got 0"),
    ("/init_weights_update_group", init_body(29500, rank_offset=2),
     "rank_offset must be in 1..world_size-1 (the trainer is rank 0), got 2 with world_size 2"),
    ("/init_weights_update_group", {**init_body(29500), "backend": None},
     "backend 'nccl' needs a CUDA device; this controller serves cpu (use 'gloo')"),
    ("/init_weights_update_group", init_body(29500, timeout=0),
     "timeout must be a number of seconds above 0 and at most 86400, got 0"),
    ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"]},
     "shapes is required"),
    ("/update_weights_from_distributed",
     {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "load_format": "flattened_bucket"},
     "load_format 'flattened_bucket' is not supported over a weight update group"),
    ("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]},
     "weight update group 'weight_update_group' is not initialized; call "
     "init_weights_update_group first"),
    ("/destroy_weights_update_group", {"group_name": 3}, "group_name must be a string, got int"),
])
def test_bad_group_calls_are_400s_naming_the_field(served: Served, path: str,
                                                    body: dict[str, Any], message: str) -> None:
    """Missing fields, ports and ranks out of range, NCCL on a CPU server (the reference's
    default backend), a bad timeout, a broadcast format we cannot follow, an update with no
    group: 400 with a message naming what is wrong; nothing changes."""
    before = checksums(served.client)
    r = post(served.client, path, body)
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert r.json()["message"].startswith(message), r.json()
    assert checksums(served.client) == before


def test_a_join_nobody_answers_fails_within_its_timeout(served: Served) -> None:
    """An init whose trainer never serves its store: 400 "Failed to initialize ..." after
    the request's timeout, and no group is left behind."""
    t0 = time.perf_counter()
    r = post(served.client, "/init_weights_update_group", init_body(free_port(), timeout=0.3))
    assert time.perf_counter() - t0 < 5.0
    assert r.status_code == 400 and r.json()["message"].startswith(
        "Failed to initialize weight update group 'weight_update_group' at 127.0.0.1:"), r.text
    assert served.client.get("/state").json()["weight_update_groups"] == {}


def test_two_server_ranks_take_each_broadcast_and_pick_their_own_tensor_parallel_entry() -> None:
    """``residency serve --nproc 2``: the ranks join the trainer's group as ranks 1 and 2 (a
    world_size without room for both is a 400 first), both take each broadcast (the checker
    runs on both ranks), a wrong shape is refused on both with the trainer kept in step; a
    two-entry upload with payload_gpu_uuids gives each rank the entry of its own UUID, an
    entry rank 1 cannot decode is refused on both ranks naming rank 1, a module-keyed bucket
    relayed to both ranks lands on both, and so does a safetensors upload of the whole
    transformer (over the store's 8 MiB value limit: relayed in pieces)."""
    local = DemoPipeline.build(parse_size("16MB"))
    params = dict(local.modules["transformer"].named_parameters())
    trainer = Trainer()
    try:
        with serving_ranks("--size", "16MB", "--allow-process-groups", env=DNS) as (_, client):
            assert checksums(client)["transformer"] == reference_checksum(params.items())
            port = trainer.init(world_size=3)  # the trainer waits for the ranks from now on
            r = post(client, "/init_weights_update_group", init_body(port, world_size=2))
            assert r.status_code == 400 and r.json()["message"].startswith(
                "world_size 2 leaves no room for this server's 2 ranks from rank_offset 1"), r.text
            r = post(client, "/init_weights_update_group", init_body(port, world_size=3))
            assert r.status_code == 200, r.text
            assert trainer.result() == ("init", "ok")
            ranks = client.get("/state").json()["ranks"]
            assert [ranks[r]["weight_update_groups"][GROUP]["rank"] for r in "01"] == [1, 2]

            def check(named: list[tuple[str, torch.Tensor]]) -> httpx.Response:
                return post(client, "/update_weights_from_tensor_checker", {
                    "target_module": "transformer",
                    "expected_named_tensors_sha256": {n: tensor_sha256(t) for n, t in named}})

            new = random_like(params, seed=4)
            r = sync(client, trainer, new, weight_version="v1")
            assert r.status_code == 200, r.text
            assert trainer.result()[0] == "broadcast"
            assert check(new).status_code == 200
            r = sync(client, trainer, transposed(new, oblong(new)))
            assert r.status_code == 400 and "rank 1: UpdateRefused: Shape mismatch for" \
                in r.json()["message"], r.text
            assert trainer.result()[0] == "broadcast"
            assert check(new).status_code == 200

            uuids = [ranks[r]["device_uuid"] for r in "01"]
            assert uuids[0] != uuids[1]
            bias = dict(new)["x_proj.bias"]
            for_rank = [[("x_proj.bias", bias + 1 + r)] for r in range(2)]
            with sharing("file_system"):  # another process: no fd passing
                entries = [serialize(for_rank[1]), serialize(for_rank[0])]
            r = post(client, "/update_weights_from_tensor", {
                "serialized_named_tensors": entries, "payload_gpu_uuids": uuids[::-1]})
            assert r.status_code == 200, r.text
            assert check(for_rank[0]).json()["message"].startswith("rank 1: 1 of 1 tensor(s)")
            assert check(for_rank[1]).json()["message"].startswith("rank 0: 1 of 1 tensor(s)")
            # Rank 1 cannot decode its entry (rank r takes entry r): refused on both ranks.
            r = post(client, "/update_weights_from_tensor",
                     {"serialized_named_tensors": [entries[1], "!!!!"]})
            assert r.status_code == 400 and r.json()["message"] == \
                "rank 1: Failed to deserialize serialized_named_tensors[1]: not valid base64 " \
                "(4 characters)", r.text
            assert check(for_rank[0]).json()["message"].startswith("rank 1: 1 of 1 tensor(s)")
            with sharing("file_system"):
                entry = bucket_payload(new)
            r = post(client, "/update_weights_from_tensor", {
                "serialized_named_tensors": [entry], "load_format": "flattened_bucket",
                "payload_gpu_uuids": uuids[1:], "target_modules": ["transformer"]})
            assert r.status_code == 400 and "no payload was exported from this worker's GPU" \
                in r.json()["message"] and r.json()["message"].startswith("rank 0: ")
            r = post(client, "/update_weights_from_tensor", {
                "serialized_named_tensors": [entry], "load_format": "flattened_bucket",
                "target_modules": ["transformer"], "weight_version": "v2"})
            assert r.status_code == 200, r.text
            assert check(new).status_code == 200
            assert {client.get("/state").json()["ranks"][r]["weight_version"] for r in "01"} \
                == {"v2"}
            again = random_like(params, seed=5)  # safetensors carries the data: 14 MB of text
            entry = base64.b64encode(save(dict(again))).decode()
            assert len(entry) > 8 * 2**20
            r = post(client, "/update_weights_from_tensor", {"serialized_named_tensors": [entry]})
            assert r.status_code == 200, r.text
            assert check(again).status_code == 200
            assert post(client, "/destroy_weights_update_group", {}).status_code == 200
            trainer.destroy()
            assert trainer.result() == ("destroy", "ok")
    finally:
        trainer.close()
