"""vLLM's weight-transfer contract on ``residency serve --nproc 2`` (issue 33): every rank
stages the same tensors (an ipc payload relayed by rank 0, a gloo trainer's broadcast received
by each rank in the trainer's group), nothing is visible on any rank before finish, and finish
writes on both ranks or on neither (a rank whose VAE cannot take the update rolls both back);
a call that fails on one rank stages nothing anywhere."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from lifecycle._checksum import reference_checksum
from lifecycle.demo import DemoPipeline
from tests.http.clients import parameters, serialize, sharing
from tests.http.server import serving_ranks
from tests.ranks.trainer import Trainer

pytestmark = [pytest.mark.service, pytest.mark.moves]

FACTORY = "tests.http.rank_pipeline:factory"  # the demo pipeline of 1 MiB, as built here
MODULES = DemoPipeline.build(2**20).modules


@pytest.fixture(autouse=True)
def _quick_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RES_OPTIONS", "timeout:1 attempts:1")  # see tests/ranks/trainer.py


def prefixed(module: str, delta: float) -> list[tuple[str, torch.Tensor]]:
    return [(f"{module}.{n}", t) for n, t in parameters(MODULES[module], delta)]


def metadata(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    return {"names": [n for n, _ in named],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}


def ipc(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """vLLM's ipc update_info, for a server in other processes (file_system sharing: fd
    passing needs a multiprocessing relative); ``named`` must outlive the call."""
    with sharing("file_system"):
        return {"update_info": {**metadata(named), "ipc_handles_pickled": serialize(named)}}


def trainers_sum(named: list[tuple[str, torch.Tensor]], module: str) -> str:
    return reference_checksum([(n.removeprefix(f"{module}."), t) for n, t in named])


class Ranks:
    """A client of a two-rank server, and what each rank shows."""

    def __init__(self, client: httpx.Client) -> None:
        self.client = client

    def post(self, path: str, body: Any = None) -> httpx.Response:
        return self.client.post(path, json={} if body is None else body)

    def each(self, key: str) -> dict[str, Any]:
        return {r: s[key] for r, s in self.client.get("/state").json()["ranks"].items()}

    def unchanged_since_snapshot(self) -> bool:
        """Whether no tensor of any rank differs from its ``/weights_checker`` snapshot."""
        r = self.post("/weights_checker", {"action": "compare"})
        assert r.status_code in (200, 400), r.text
        return r.status_code == 200

    def sums(self) -> dict[str, str]:
        return dict(self.post("/get_weights_checksum").json())

    def agree(self) -> bool:
        r = self.post("/generate", {"seed": 4})
        assert r.status_code == 200, r.text
        return bool(r.json()["ranks_agree"])


@pytest.fixture
def ranks(request: pytest.FixtureRequest) -> Iterator[Ranks]:
    env = getattr(request, "param", None)
    with serving_ranks("--pipeline", FACTORY, "--allow-process-groups", env=env) as (_, c):
        yield Ranks(c)


def test_an_ipc_transfer_is_staged_on_both_ranks_and_written_on_both_at_finish(
        ranks: Ranks) -> None:
    """TRL's order over ipc: the transformer, then the VAE, staged on both ranks (rank 0
    relays the payload); no tensor of either rank changes before finish; finish writes both
    modules on both ranks as one update, labelled on both, and their outputs agree."""
    versions = ranks.each("weights_version")
    assert ranks.post("/init_weight_transfer_engine", {"init_info": {}}).json()["backend"] == "ipc"
    assert ranks.post("/weights_checker", {"action": "snapshot"}).status_code == 200
    assert ranks.post("/start_weight_update").status_code == 200
    new_t, new_v = prefixed("transformer", 0.5), prefixed("vae", -0.5)
    r = ranks.post("/update_weights", ipc(new_t))
    assert r.json() == {"message": "Weights updated", "staged": {"transformer": len(new_t)}}
    r = ranks.post("/update_weights", ipc(new_v))
    assert r.json()["staged"] == {"transformer": len(new_t), "vae": len(new_v)}, r.text
    assert ranks.unchanged_since_snapshot()
    assert ranks.each("weights_version") == versions
    r = ranks.post("/finish_weight_update", {"weight_version": "3"})
    assert r.json() == {"message": "Weight update finished", "weight_version": "3"}, r.text
    assert ranks.each("weights_version") == {k: v + 1 for k, v in versions.items()}
    assert ranks.each("weight_version") == {"0": "3", "1": "3"}
    sums = ranks.sums()
    assert (sums["transformer"], sums["vae"]) == (trainers_sum(new_t, "transformer"),
                                                  trainers_sum(new_v, "vae"))
    assert not ranks.unchanged_since_snapshot()
    assert ranks.agree()  # rank 1 holds the same weights as rank 0


@pytest.mark.parametrize("ranks", [{"RESIDENCY_TEST_MISSHAPEN_RANK": "1"}], indirect=True)
def test_a_finish_that_fails_on_one_rank_writes_on_neither(ranks: Ranks) -> None:
    """Rank 1's VAE cannot take the VAE's tensors: the finish is refused (400 naming the
    shape), and rank 0, which could have written them, wrote nothing either: no tensor of
    either rank changed, versions and labels as they were. The next transaction (the
    transformer alone) is written on both."""
    versions, labels, before = (ranks.each("weights_version"), ranks.each("weight_version"),
                                ranks.sums())
    ranks.post("/init_weight_transfer_engine", {"init_info": {}})
    assert ranks.post("/weights_checker", {"action": "snapshot"}).status_code == 200
    ranks.post("/start_weight_update")
    for named in (prefixed("transformer", 1.0), prefixed("vae", 1.0)):
        assert ranks.post("/update_weights", ipc(named)).status_code == 200
    r = ranks.post("/finish_weight_update", {"weight_version": "bad"})
    assert r.status_code == 400 and "Shape mismatch" in r.json()["message"], r.text
    assert ranks.unchanged_since_snapshot()
    assert (ranks.each("weights_version"), ranks.each("weight_version"), ranks.sums()) == (
        versions, labels, before)
    ranks.post("/start_weight_update")
    new_t = prefixed("transformer", 2.0)
    assert ranks.post("/update_weights", ipc(new_t)).status_code == 200
    r = ranks.post("/finish_weight_update", {"weight_version": "good"})
    assert r.status_code == 200, r.text
    assert ranks.each("weights_version") == {k: v + 1 for k, v in versions.items()}
    assert ranks.sums()["transformer"] == trainers_sum(new_t, "transformer")


def test_a_payload_one_rank_refuses_is_refused_on_both_and_stages_nothing(
        ranks: Ranks) -> None:
    """Names that do not match the tensors: refused (400) before any rank stages them; what
    was staged before stays staged, on both ranks, and is what finish writes."""
    ranks.post("/init_weight_transfer_engine", {"init_info": {}})
    ranks.post("/start_weight_update")
    new_v = prefixed("vae", 0.75)
    assert ranks.post("/update_weights", ipc(new_v)).status_code == 200
    bad = ipc(prefixed("transformer", 1.0))
    bad["update_info"]["names"] = ["transformer.nope"]
    r = ranks.post("/update_weights", bad)
    assert r.status_code == 400 and "names does not match" in r.json()["message"], r.text
    before = ranks.sums()
    assert ranks.post("/finish_weight_update").status_code == 200
    after = ranks.sums()
    assert after["transformer"] == before["transformer"]
    assert after["vae"] == trainers_sum(new_v, "vae")
    assert ranks.agree()


def test_an_nccl_transfer_is_received_by_both_ranks_and_a_killed_trainer_rolls_both_back(
        ranks: Ranks) -> None:
    """A gloo trainer of world size 3 (the server's two ranks join as 1 and 2) broadcasts the
    transformer and the VAE: staged on both ranks, written on both at finish; in the next
    transaction the trainer dies mid-broadcast: a 400 rolled back on both ranks, versions and
    weights as they were."""
    trainer = Trainer()
    try:
        port = trainer.init(world_size=3, group_name="vllm_weight_transfer")
        r = ranks.post("/init_weight_transfer_engine", {"init_info": {
            "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 3, "timeout": 20, "update_timeout": 60}})
        assert r.json()["backend"] == "nccl", r.text
        assert trainer.result() == ("init", "ok")
        versions = ranks.each("weights_version")
        ranks.post("/start_weight_update")
        new_t, new_v = prefixed("transformer", 0.25), prefixed("vae", 0.25)
        for named in (new_t, new_v):
            trainer.broadcast([t for _, t in named])
            r = ranks.post("/update_weights", {"update_info": metadata(named)})
            assert r.status_code == 200, r.text
            assert trainer.result()[0] == "broadcast"
        assert ranks.each("weights_version") == versions
        assert ranks.post("/finish_weight_update", {"weight_version": "1"}).status_code == 200
        written = {k: v + 1 for k, v in versions.items()}
        assert ranks.each("weights_version") == written
        sums = ranks.sums()
        assert (sums["transformer"], sums["vae"]) == (trainers_sum(new_t, "transformer"),
                                                      trainers_sum(new_v, "vae"))
        assert ranks.agree()

        ranks.post("/start_weight_update")
        named = prefixed("vae", 3.0)
        trainer.broadcast([t for _, t in named], die_after=5)
        r = ranks.post("/update_weights", {"update_info": metadata(named)})
        assert r.status_code == 400 and r.json()["rolled_back"] is True, r.text
        assert (ranks.each("weights_version"), ranks.sums()) == (written, sums)
        r = ranks.post("/finish_weight_update")
        assert r.status_code == 409 and "abandoned" in r.json()["detail"], r.text
        assert ranks.agree()
    finally:
        trainer.kill()
