"""The RL clients' control routes on ``residency serve --nproc 2`` (issue 33): tags release and
resume the named components on both ranks, vLLM's sleep and wake, an abort ends a generation
on every rank, weight versions and the weights checker run on every rank, and the world size (vLLM's
weight-transfer routes on two ranks: tests/http/test_weight_transfer_ranks.py)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.http.server import serving_ranks

pytestmark = pytest.mark.service

ASLEEP = "Server is sleeping. Call resume_memory_occupation first."


def wait_in_flight(client: httpx.Client) -> None:
    """Until a generation is in flight on the server (20 s at most)."""
    deadline = time.monotonic() + 20
    while client.get("/is_paused").json()["in_flight"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_the_control_routes_run_on_both_ranks() -> None:
    """One server of two ranks, the clients' bodies in a row: every rank follows each call."""
    with serving_ranks("--collective-timeout", "5", "--pipeline",
                       "tests.http.slow_pipeline:factory") as (_, client):

        def ranks(key: str) -> dict[str, object]:
            return {r: s[key] for r, s in client.get("/state").json()["ranks"].items()}

        assert client.get("/get_world_size").json() == {"world_size": 2}
        r = client.post("/release_memory_occupation", json={"tags": ["transformer"]})
        assert (r.status_code, r.json()["moved"]) == (200, ["transformer"]), r.text
        assert ranks("asleep") == {"0": ["transformer"], "1": ["transformer"]}
        assert ranks("phase") == {"0": "awake", "1": "awake"}
        r = client.post("/generate", json={"seed": 1})
        assert (r.status_code, r.json()["message"]) == (400, ASLEEP)
        assert client.post("/resume_memory_occupation", json={"tags": ["dit"]}).status_code == 200
        assert client.post("/sleep", params={"level": 1}).json()["sleeping"] is True
        assert ranks("phase") == {"0": "sleeping", "1": "sleeping"}
        assert client.post("/wake_up", params={"tags": "vae"}).json()["asleep"] == [
            "text_encoder", "transformer"]
        assert client.post("/wake_up").json()["asleep"] == []

        r = client.post("/update_weight_version", json={"new_version": "7"})
        assert r.json()["new_version"] == "7"
        assert ranks("weight_version") == {"0": "7", "1": "7"}
        assert client.post("/weights_checker", json={"action": "snapshot"}).json()["success"]
        assert client.post("/weights_checker", json={"action": "reset_tensors"}).status_code == 200
        r = client.post("/weights_checker", json={"action": "compare"})
        assert r.status_code == 400 and "differ from the snapshot" in r.json()["message"]
        # Both ranks were reset alike (the same seed): their generations still agree.
        r = client.post("/generate", json={"seed": 2})
        assert r.status_code == 200 and r.json()["ranks_agree"] is True, r.text

        with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=str(client.base_url),
                                                          timeout=60) as other:
            running = pool.submit(other.post, "/generate", json={"delay": 30, "rid": "long"})
            wait_in_flight(client)
            t0 = time.monotonic()
            r = client.post("/pause_generation", json={"mode": "abort"})
            assert r.json()["aborted"] == 1
            done = running.result(timeout=30)
            assert done.status_code == 503 and done.json()["rid"] == "long", done.text
            assert time.monotonic() - t0 < 10  # rank 1 ended its part too
        assert client.post("/continue_generation", json={}).status_code == 200
        r = client.post("/generate", json={"seed": 3})
        assert r.status_code == 200 and r.json()["ranks_agree"] is True, r.text


def test_vllm_pause_is_sleeping_abort_by_id_and_a_multi_module_upload_on_both_ranks() -> None:
    """vLLM's /pause?mode=keep and /resume, /is_sleeping per component, /abort_request by id
    (rank 1 ends its part too) and a payload keyed by module for two modules, written on both
    ranks as one update (their outputs agree after), on one server of two ranks."""
    import torch

    from lifecycle.demo import DemoPipeline
    from tests.http.clients import parameters, serialize, sharing

    with serving_ranks("--collective-timeout", "5", "--pipeline",
                       "tests.http.slow_pipeline:factory") as (_, client):

        def ranks(key: str) -> dict[str, object]:
            return {r: s[key] for r, s in client.get("/state").json()["ranks"].items()}

        r = client.post("/pause", params={"mode": "keep", "clear_cache": "false"})
        assert r.json() == {"status": "paused"}
        assert client.get("/is_paused").json()["mode"] == "keep"
        assert client.post("/resume").json() == {"status": "resumed"}

        client.post("/release_memory_occupation", json={"tags": ["vae"]})
        assert client.get("/is_sleeping").json() == {
            "is_sleeping": False,
            "components": {"text_encoder": False, "transformer": False, "vae": True}}
        assert ranks("asleep") == {"0": ["vae"], "1": ["vae"]}
        client.post("/resume_memory_occupation", json={"tags": ["vae"]})

        with ThreadPoolExecutor(1) as pool, httpx.Client(base_url=str(client.base_url),
                                                          timeout=60) as other:
            running = pool.submit(other.post, "/generate", json={"delay": 30, "rid": "a"})
            wait_in_flight(client)
            t0 = time.monotonic()
            assert client.post("/abort_request", json={"rid": "b"}).json()["aborted"] == 0
            assert client.post("/abort_request", json={"rid": "a"}).json()["aborted"] == 1
            done = running.result(timeout=30)
            assert done.status_code == 503 and done.json()["rid"] == "a", done.text
            assert time.monotonic() - t0 < 10

        modules = DemoPipeline.build(2**20).modules
        payload = {m: parameters(modules[m], 0.5) for m in ("transformer", "vae")}
        versions = {k: int(str(v)) + 1 for k, v in ranks("weights_version").items()}
        with sharing("file_system"):  # a server in other processes: no fd passing
            body = {"serialized_named_tensors": [serialize(payload)],
                    "target_modules": ["transformer", "vae"]}
        r = client.post("/update_weights_from_tensor", json=body)
        assert r.status_code == 200, r.text
        assert ranks("weights_version") == versions
        r = client.post("/generate", json={"seed": 5})
        assert r.status_code == 200 and r.json()["ranks_agree"] is True, r.text
        bad = {"transformer": parameters(modules["transformer"], 1.0),
               "vae": [(n, torch.zeros(1)) for n, _ in modules["vae"].named_parameters()][:1]}
        with sharing("file_system"):
            body = {"serialized_named_tensors": [serialize(bad)],
                    "target_modules": ["transformer", "vae"]}
        r = client.post("/update_weights_from_tensor", json=body)
        assert r.status_code == 400 and "Shape mismatch" in r.json()["message"], r.text
        assert ranks("weights_version") == versions
