"""vLLM's weight-transfer contract over a real server on 127.0.0.1 (issue 33), in TRL's order
(pause keep, start, update_weights, finish, resume): the ipc backend over the tensor path and
the nccl backend over a gloo trainer's process group; one transaction from start to finish,
misordered calls vLLM's 409s, an abandoned or failed transaction rolled back: nothing is
written before finish (the nccl backend stages what it receives), so the weights and the
version stay exactly the old ones."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from lifecycle import LifecycleController
from lifecycle._checksum import reference_checksum
from lifecycle._weight_sync import WeightSyncLimits
from lifecycle.demo import DemoPipeline
from lifecycle.http import demo_generate
from tests.http.clients import parameters, serialize
from tests.http.server import Served, running_server
from tests.ranks.trainer import Trainer

pytestmark = [pytest.mark.service, pytest.mark.moves]

NOT_STARTED = ("update_weights requires a preceding start_weight_update. "
               "Call POST /start_weight_update first.")
STARTED = ("start_weight_update called while a weight update is already in progress.  "
           "Call POST /finish_weight_update first.")


@pytest.fixture(autouse=True)
def _quick_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RES_OPTIONS", "timeout:1 attempts:1")  # see tests/ranks/trainer.py


@pytest.fixture
def served() -> Iterator[Served]:
    pipe = DemoPipeline.build(2**16)
    with running_server(pipe, demo_generate(pipe), LifecycleController("cpu")) as s:
        yield s


def post(s: Served, path: str, body: Any = None, **params: Any) -> httpx.Response:
    return s.client.post(path, json={} if body is None else body, params=params)


def ipc_info(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """vLLM's ipc update_info: names, dtype names, shapes and the pickled tensors."""
    return {"names": [n for n, _ in named],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named],
            "ipc_handles_pickled": serialize(named)}


def prefixed(s: Served, module: str, delta: float) -> list[tuple[str, torch.Tensor]]:
    return [(f"{module}.{n}", t) for n, t in parameters(s.pipe.modules[module], delta)]


def test_an_ipc_transfer_is_one_transaction_visible_only_at_finish(served: Served) -> None:
    """TRL's order over ipc: two /update_weights (transformer, then VAE) change nothing until
    /finish_weight_update, which writes both and labels them; generations wait meanwhile."""
    before = served.ctl.weights_checksum()
    new_t, new_v = prefixed(served, "transformer", 0.5), prefixed(served, "vae", -0.5)
    assert post(served, "/init_weight_transfer_engine", {"init_info": {}}).json() == {
        "message": "Weight transfer initialized", "backend": "ipc"}
    assert post(served, "/pause", mode="keep", clear_cache="false").status_code == 200
    assert post(served, "/start_weight_update").json() == {"message": "Weight update started"}
    for chunk in (new_t, new_v):
        r = post(served, "/update_weights", {"update_info": ipc_info(chunk)})
        assert r.status_code == 200, r.text
    assert served.ctl.weights_checksum() == before
    r = post(served, "/finish_weight_update", {"weight_version": "3"})
    assert r.json() == {"message": "Weight update finished", "weight_version": "3"}, r.text
    got = dict(served.pipe.modules["transformer"].named_parameters())
    assert all(torch.equal(got[n.removeprefix("transformer.")], t) for n, t in new_t)
    got = dict(served.pipe.modules["vae"].named_parameters())
    assert all(torch.equal(got[n.removeprefix("vae.")], t) for n, t in new_v)
    assert post(served, "/resume").json() == {"status": "resumed"}
    assert post(served, "/generate", {"seed": 1}).status_code == 200


def test_misordered_and_hostile_transfer_calls_are_4xx_and_change_nothing(served: Served) -> None:
    """start before init, update and finish before start, a second start: vLLM's 409s; a
    missing init_info or update_info, a payload that is not one, names that do not match:
    400s; a bad tensor staged fails the finish as a whole; the weights never change."""
    before = (served.ctl.weights_checksum(), served.ctl.weights_version)
    r = post(served, "/start_weight_update")
    assert r.status_code == 409 and "init_weight_transfer_engine first" in r.json()["detail"]
    assert post(served, "/init_weight_transfer_engine", {}).json()["message"] == \
        "Missing 'init_info' in request body"
    post(served, "/init_weight_transfer_engine", {"init_info": {}})
    r = post(served, "/update_weights", {"update_info": ipc_info(prefixed(served, "vae", 1))})
    assert (r.status_code, r.json()["detail"]) == (409, NOT_STARTED)
    r = post(served, "/finish_weight_update", {})
    assert (r.status_code, r.json()["detail"]) == (
        409, "finish_weight_update called without a preceding start_weight_update.")
    assert post(served, "/start_weight_update").status_code == 200
    r = post(served, "/start_weight_update")
    assert (r.status_code, r.json()["detail"]) == (409, STARTED)
    for body, words in [({}, "Missing 'update_info' in request body"),
                        ({"update_info": {"ipc_handles_pickled": "bm90IGEgcGlja2xl"}},
                         "Failed to deserialize update_info.ipc_handles_pickled"),
                        ({"update_info": {**ipc_info(prefixed(served, "vae", 1)),
                                          "names": ["vae.nope"]}},
                         "update_info.names does not match the tensors sent")]:
        r = post(served, "/update_weights", body)
        assert r.status_code == 400 and words in r.json()["message"], r.text
    wrong = [("vae." + n, torch.zeros(1)) for n, _ in parameters(served.pipe.modules["vae"])][:1]
    good = prefixed(served, "transformer", 1.0)
    for chunk in (good, wrong):
        assert post(served, "/update_weights", {"update_info": ipc_info(chunk)}).status_code == 200
    r = post(served, "/finish_weight_update", {"weight_version": "x"})
    assert r.status_code == 400 and r.json()["message"].startswith("Shape mismatch"), r.text
    assert (served.ctl.weights_checksum(), served.ctl.weights_version) == before
    assert served.client.get("/is_paused").json()["is_paused"] is False


def test_an_abandoned_transfer_is_rolled_back_and_generation_goes_on(served: Served) -> None:
    """A transaction not finished within init_info.update_timeout is dropped by the
    watchdog: generation is unpaused, nothing changed, the next update says it was
    abandoned; a new transaction works."""
    before = served.ctl.weights_checksum()
    post(served, "/init_weight_transfer_engine", {"init_info": {"update_timeout": 0.5}})
    post(served, "/start_weight_update")
    post(served, "/update_weights", {"update_info": ipc_info(prefixed(served, "vae", 1))})
    assert served.client.get("/is_paused").json()["is_paused"] is True
    deadline = time.monotonic() + 10
    while served.client.get("/is_paused").json()["is_paused"]:
        assert time.monotonic() < deadline, "never abandoned"
        time.sleep(0.05)
    r = post(served, "/update_weights", {"update_info": ipc_info(prefixed(served, "vae", 1))})
    assert r.status_code == 409 and "abandoned: not finished within 0.5 s" in r.json()["detail"]
    assert served.ctl.weights_checksum() == before
    post(served, "/start_weight_update")
    post(served, "/update_weights", {"update_info": ipc_info(prefixed(served, "vae", 2))})
    assert post(served, "/finish_weight_update").status_code == 200
    assert served.ctl.weights_checksum()["vae"] != before["vae"]


def nccl_info(named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    return {"names": [n for n, _ in named],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
            "shapes": [list(t.shape) for _, t in named]}


@pytest.fixture
def grouped(request: pytest.FixtureRequest) -> Iterator[tuple[Served, Trainer]]:
    """A server that joins trainers' groups (a staging bound of 200 000 bytes: the
    transformer's and the VAE's weights fit, with the text encoder's they do not) and a
    gloo trainer in its transfer group; ``update_timeout`` 30 s, or the parameter."""
    update_timeout = getattr(request, "param", 30)
    pipe = DemoPipeline.build(2**16)
    ctl = LifecycleController("cpu", weight_sync_limits=WeightSyncLimits(
        max_staging_bytes=200_000))
    trainer = Trainer()
    try:
        with running_server(pipe, demo_generate(pipe), ctl, process_groups=True) as s:
            port = trainer.init(world_size=2, group_name="vllm_weight_transfer")
            r = post(s, "/init_weight_transfer_engine", {"init_info": {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "timeout": 10, "update_timeout": update_timeout}})
            assert r.status_code == 200, r.text
            assert trainer.result() == ("init", "ok")
            yield s, trainer
    finally:
        trainer.kill()


def send(s: Served, trainer: Trainer, named: list[tuple[str, torch.Tensor]],
         **faults: int) -> httpx.Response:
    """One /update_weights of the nccl backend, the trainer broadcasting meanwhile."""
    trainer.broadcast([t for _, t in named], **faults)
    return post(s, "/update_weights", {"update_info": nccl_info(named)})


def sums(s: Served) -> Any:
    return post(s, "/get_weights_checksum").json()


def state(s: Served) -> tuple[Any, int, Any]:
    """What a rolled-back transaction leaves as it was: checksums, version, label."""
    return sums(s), s.ctl.weights_version, s.client.get("/get_weight_version").json()


def stage(s: Served, trainer: Trainer, named: list[tuple[str, torch.Tensor]]) -> None:
    """One /update_weights that stages ``named`` (the trainer's broadcast completed)."""
    r = send(s, trainer, named)
    assert r.status_code == 200, r.text
    assert trainer.result()[0] == "broadcast"


def trainers_sum(named: list[tuple[str, torch.Tensor]], module: str) -> str:
    """The checksum a trainer computes of the weights it sent for ``module``."""
    return reference_checksum([(n.removeprefix(f"{module}."), t) for n, t in named])


def test_an_nccl_transfer_is_staged_and_written_only_at_finish(
        grouped: tuple[Served, Trainer]) -> None:
    """A gloo trainer broadcasts the transformer, then the VAE, in two /update_weights: the
    checksums stay the old weights' until /finish_weight_update writes both as one update
    (one version step) and labels them; then they are the trainer's."""
    served, trainer = grouped
    before, version = sums(served), served.ctl.weights_version
    new_t, new_v = prefixed(served, "transformer", 0.25), prefixed(served, "vae", 0.25)
    assert post(served, "/start_weight_update").status_code == 200
    r = send(served, trainer, new_t)
    assert r.json() == {"message": "Weights updated", "staged": {"transformer": 32}}, r.text
    assert trainer.result()[0] == "broadcast"
    r = send(served, trainer, new_v)
    assert r.json()["staged"] == {"transformer": 32, "vae": 18}, r.text
    assert trainer.result()[0] == "broadcast"
    assert sums(served) == before
    assert served.ctl.weights_version == version
    r = post(served, "/finish_weight_update", {"weight_version": "1"})
    assert r.json() == {"message": "Weight update finished", "weight_version": "1"}, r.text
    assert sums(served) == {**before, "transformer": trainers_sum(new_t, "transformer"),
                            "vae": trainers_sum(new_v, "vae")}
    assert served.ctl.weights_version == version + 1


@pytest.mark.parametrize("grouped", [1], indirect=True)
def test_an_abandoned_nccl_transfer_leaves_the_weights_and_version_as_they_were(
        grouped: tuple[Served, Trainer]) -> None:
    """A transaction whose finish never comes (update_timeout 1 s) is dropped by the
    watchdog: what it staged is gone, the weights, version and label are the old ones, and
    the group still serves the next transaction."""
    served, trainer = grouped
    before = state(served)
    post(served, "/start_weight_update")
    stage(served, trainer, prefixed(served, "vae", 1.0))
    deadline = time.monotonic() + 10
    while served.client.get("/is_paused").json()["is_paused"]:
        assert time.monotonic() < deadline, "never abandoned"
        time.sleep(0.05)
    r = post(served, "/finish_weight_update", {"weight_version": "2"})
    assert r.status_code == 409 and "abandoned: not finished within 1 s" in r.json()["detail"]
    assert state(served) == before
    post(served, "/start_weight_update")
    new_v = prefixed(served, "vae", 2.0)
    stage(served, trainer, new_v)
    assert post(served, "/finish_weight_update").status_code == 200
    assert sums(served)["vae"] == trainers_sum(new_v, "vae")


def test_a_trainer_killed_mid_transfer_leaves_the_weights_and_version_as_they_were(
        grouped: tuple[Served, Trainer]) -> None:
    """The transformer staged, the trainer dies mid-way through the VAE's broadcast: the
    /update_weights fails (400, rolled back), the transaction is dropped, and the weights,
    version and label are exactly the old ones."""
    served, trainer = grouped
    before = state(served)
    post(served, "/start_weight_update")
    stage(served, trainer, prefixed(served, "transformer", 1.0))
    r = send(served, trainer, prefixed(served, "vae", 1.0), die_after=9)
    assert r.status_code == 400 and r.json()["rolled_back"] is True, r.text
    assert "tensor 10/18" in r.json()["message"]
    assert state(served) == before
    r = post(served, "/finish_weight_update", {})
    assert r.status_code == 409 and "abandoned" in r.json()["detail"]


def test_staging_past_the_bound_is_a_400_naming_it_and_the_broadcast_is_drained(
        grouped: tuple[Served, Trainer]) -> None:
    """The text encoder staged after the transformer and the VAE would hold more than
    max_staging_bytes: a 400
    naming the bound, the transaction dropped, the trainer's broadcast still completes and
    the group serves the next transaction."""
    served, trainer = grouped
    before = sums(served)
    post(served, "/start_weight_update")
    for module in ("transformer", "vae"):
        stage(served, trainer, prefixed(served, module, 1.0))
    r = send(served, trainer, prefixed(served, "text_encoder", 1.0))
    assert r.status_code == 400 and "over the 200000 bytes one group may stage " \
        "(max_staging_bytes)" in r.json()["message"], r.text
    answer, seconds = trainer.result()
    assert answer == "broadcast" and isinstance(seconds, float), seconds
    assert sums(served) == before
    post(served, "/start_weight_update")
    new_v = prefixed(served, "vae", 2.0)
    stage(served, trainer, new_v)
    assert post(served, "/finish_weight_update").status_code == 200
    assert sums(served) == {**before, "vae": trainers_sum(new_v, "vae")}


@pytest.mark.parametrize("grouped", [1], indirect=True)
def test_a_trainer_stalled_mid_transfer_meets_the_transactions_deadline(
        grouped: tuple[Served, Trainer]) -> None:
    """A trainer that stops broadcasting mid-way: the receive ends at the transaction's own
    deadline (update_timeout 1 s from its start), a 400 rolled back, and the weights,
    version and label are exactly the old ones."""
    served, trainer = grouped
    before = state(served)
    post(served, "/start_weight_update")
    t0 = time.monotonic()
    r = send(served, trainer, prefixed(served, "vae", 1.0), stall_after=5)
    assert r.status_code == 400 and r.json()["rolled_back"] is True, r.text
    assert "the update's deadline passed at tensor 6/18" in r.json()["message"]
    assert time.monotonic() - t0 < 10
    assert state(served) == before
    r = post(served, "/finish_weight_update", {})
    assert r.status_code == 409 and "abandoned" in r.json()["detail"]
