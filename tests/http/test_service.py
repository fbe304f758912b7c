"""The HTTP control plane end to end: a real uvicorn server on 127.0.0.1, a real HTTP client,
the reference's paths, bodies and answers, plus auth, bad input, metrics and concurrency."""

from __future__ import annotations

import base64
import concurrent.futures
import os
import pickle
import time
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.multiprocessing
from safetensors.torch import save, save_file

from lifecycle import LifecycleController, Phase
from lifecycle.demo import DemoPipeline
from lifecycle.http import demo_generate
from tests.http.server import Served, running_server
from tests.http.slow_pipeline import factory

pytestmark = pytest.mark.service

SLEEPING_400 = "Server is sleeping. Call resume_memory_occupation first."
UPDATE_WHILE_SLEEPING = ("Cannot update weights while the server is sleeping. "
                         "Call resume_memory_occupation first.")


@pytest.fixture
def served() -> Iterator[Served]:
    """The demo pipeline (1 MB) served with the slow generation of tests.http.slow_pipeline."""
    pipe, generate = factory()
    with running_server(pipe, generate, LifecycleController("cpu", drain_timeout=5)) as s:
        yield s


def post(s: Served, path: str, body: Any = None, **kwargs: Any) -> httpx.Response:
    return s.client.post(path, json={} if body is None else body, **kwargs)


def state_of(module: torch.nn.Module, delta: float) -> dict[str, torch.Tensor]:
    """The module's state dict, floating values shifted by ``delta``, tied tensors once."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for k, v in module.state_dict().items():
        if v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        out[k] = (v + delta).contiguous() if v.is_floating_point() else v.clone()
    return out


# -- release / resume ---------------------------------------------------------------------
@pytest.mark.parametrize("body", [None, {}, {"tags": ["weights", "kv_cache"]}])
def test_release_and_resume_answer_like_the_reference_and_are_idempotent(
        served: Served, body: Any) -> None:
    """Release and resume answer 200 with success/sleeping/message, repeat as no-ops, and
    accept an empty body, {} or the LLM clients' tags."""
    kwargs: dict[str, Any] = {} if body is None else {"json": body}
    r = served.client.post("/release_memory_occupation", **kwargs)
    assert r.status_code == 200
    assert r.json()["success"] is True and r.json()["sleeping"] is True
    assert served.ctl.phase is Phase.SLEEPING and served.ctl.report().device_bytes == 0
    again = served.client.post("/release_memory_occupation", **kwargs)
    assert again.status_code == 200 and again.json()["message"] == "already sleeping"
    r = served.client.post("/resume_memory_occupation", **kwargs)
    assert r.status_code == 200 and r.json()["sleeping"] is False
    again = served.client.post("/resume_memory_occupation", **kwargs)
    assert again.status_code == 200 and again.json()["message"] == "already awake"


def test_health_is_ok_while_sleeping_and_state_tells_the_phase(served: Served) -> None:
    """/health and /health_generate answer 200 awake and asleep; /state reports the phase,
    the version and the placement of every component; /flush_cache answers GET and POST."""
    for phase in ("awake", "sleeping"):
        for path in ("/health", "/health_generate"):
            r = served.client.get(path)
            assert r.status_code == 200 and r.json() == {"status": "ok"}
        st = served.client.get("/state").json()
        assert st["phase"] == phase and st["weights_version"] == 0
        assert set(st["components"]) == {"text_encoder", "transformer", "vae"}
        post(served, "/release_memory_occupation")
    assert served.client.get("/flush_cache").json() == {"success": True}
    assert post(served, "/flush_cache").json() == {"success": True}


# -- generate -------------------------------------------------------------------------------
def test_generate_while_sleeping_is_the_reference_400_and_nothing_runs(served: Served) -> None:
    """A generation answers the image's digest; while sleeping the reference's 400; after a
    resume the same digest again."""
    first = post(served, "/generate", {"seed": 3})
    assert first.status_code == 200 and first.json()["shape"] == [1, 3, 32, 32]
    post(served, "/release_memory_occupation")
    asleep = post(served, "/generate", {"seed": 3})
    assert asleep.status_code == 400 and asleep.json()["message"] == SLEEPING_400
    assert served.ctl.report().device_bytes == 0
    post(served, "/resume_memory_occupation")
    assert post(served, "/generate", {"seed": 3}).json()["sha256"] == first.json()["sha256"]


def test_auto_wake_serves_a_generation_while_sleeping_with_one_wake() -> None:
    """With auto-wake, a generation while sleeping wakes the pipeline and is served."""
    pipe = DemoPipeline.build(2**20)
    ctl = LifecycleController("cpu", auto_wake=True)
    with running_server(pipe, demo_generate(pipe), ctl) as s:
        post(s, "/release_memory_occupation")
        r = post(s, "/generate", {"seed": 1})
        assert r.status_code == 200 and s.ctl.phase is Phase.AWAKE


# -- updates ----------------------------------------------------------------------------------
def checksums(s: Served) -> dict[str, str]:
    r = post(s, "/get_weights_checksum")
    assert r.status_code == 200
    result: dict[str, str] = r.json()
    return result


def test_update_from_disk_answers_updated_n_modules_and_ignores_unknown_fields(
        served: Served, tmp_path: Path) -> None:
    """A disk update answers "Updated N modules (a, b)." with the new version; fields meant
    for other servers are ignored; the checksums are those of the written weights."""
    for name in ("transformer", "vae"):
        (tmp_path / name).mkdir()
        save_file(state_of(served.pipe.modules[name], 0.5), str(tmp_path / name / "m.safetensors"))
    before = checksums(served)
    r = post(served, "/update_weights_from_disk", {
        "model_path": str(tmp_path), "target_modules": ["transformer", "vae"],
        "flush_cache": True, "load_format": "auto", "weight_version": "7",
        "abort_all_requests": False})
    assert r.status_code == 200, r.text
    assert r.json()["message"] == "Updated 2 modules (transformer, vae)."
    assert r.json()["version"] == 1 and served.ctl.weights_version == 1
    after = checksums(served)
    assert after["text_encoder"] == before["text_encoder"] and after["vae"] != before["vae"]
    assert after == served.ctl.weights_checksum()


@pytest.mark.parametrize(("body", "message"), [
    ({}, "model_path is required"),
    ({"model_path": 7}, "model_path must be a string, got int"),
    ({"model_path": "/nowhere", "target_modules": ["nope"]},
     "Module(s) requested for update not found in pipeline: ['nope']. "
     "Available Module(s): ['text_encoder', 'transformer', 'vae']"),
    ({"model_path": "{tmp}", "target_modules": ["vae"]},
     "Cannot update weights: missing weight files for modules: ['vae']. "
     "No partial updates allowed."),
])
def test_update_from_disk_refusals_are_400_with_the_reference_message_and_change_nothing(
        served: Served, tmp_path: Path, body: dict[str, Any], message: str) -> None:
    """Every refusal of a disk update is a 400 with its exact message; weights unchanged."""
    before = checksums(served)
    if body.get("model_path") == "{tmp}":
        body = {**body, "model_path": str(tmp_path)}
    r = post(served, "/update_weights_from_disk", body)
    assert r.status_code == 400
    assert r.json()["success"] is False and r.json()["message"] == message
    assert checksums(served) == before and served.ctl.weights_version == 0


def test_an_update_with_a_wrong_shape_or_while_sleeping_is_refused(
        served: Served, tmp_path: Path) -> None:
    """A shape mismatch, and any update while sleeping, are 400 and change nothing."""
    (tmp_path / "vae").mkdir()
    bad = state_of(served.pipe.modules["vae"], 1.0)
    key = next(k for k, v in bad.items() if v.dim() == 4)
    bad[key] = torch.zeros(1, 1, 1, 1)
    save_file(bad, str(tmp_path / "vae" / "m.safetensors"))
    before = checksums(served)
    r = post(served, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert r.status_code == 400 and r.json()["message"].startswith(f"Shape mismatch for {key}")
    post(served, "/release_memory_occupation")
    r = post(served, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert r.status_code == 400 and r.json()["message"] == UPDATE_WHILE_SLEEPING
    post(served, "/resume_memory_occupation")
    assert checksums(served) == before


def safetensors_payload(tensors: dict[str, torch.Tensor]) -> str:
    return base64.b64encode(save(tensors)).decode()


@pytest.mark.parametrize("load_format", ["safetensors", None])
def test_update_from_tensor_with_a_safetensors_payload(served: Served,
                                                       load_format: str | None) -> None:
    """The recommended transport: base64 of a safetensors file, named or sniffed."""
    new = state_of(served.pipe.modules["transformer"], 0.25)
    body: dict[str, Any] = {"serialized_named_tensors": [safetensors_payload(new)]}
    if load_format:
        body["load_format"] = load_format
    r = post(served, "/update_weights_from_tensor", body)
    assert r.status_code == 200, r.text
    assert r.json()["message"] == "Updated 1 modules (transformer)."
    for k, v in new.items():
        assert torch.equal(served.pipe.modules["transformer"].state_dict()[k], v)


def test_update_from_tensor_with_the_references_pickled_payload(served: Served) -> None:
    """The reference's clients' format: base64 of torch's multiprocessing pickle of
    (name, tensor) pairs, decoded by the allow-list unpickler."""
    new = state_of(served.pipe.modules["vae"], -0.5)
    payload = base64.b64encode(bytes(ForkingPickler.dumps(list(new.items())))).decode()
    r = post(served, "/update_weights_from_tensor",
             {"serialized_named_tensors": [payload], "target_modules": ["vae"]})
    assert r.status_code == 200, r.text
    assert all(torch.equal(served.pipe.modules["vae"].state_dict()[k], v) for k, v in new.items())


class _Boom:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_malicious_pickle_is_refused_naming_the_global_and_nothing_runs(
        served: Served, tmp_path: Path) -> None:
    """A payload that would call os.system is a 400 naming it; the command never ran."""
    marker = tmp_path / "ran"
    payload = base64.b64encode(pickle.dumps([("w", _Boom(marker))])).decode()
    before = checksums(served)
    r = post(served, "/update_weights_from_tensor", {"serialized_named_tensors": [payload]})
    assert r.status_code == 400 and "system" in r.json()["message"]
    assert not marker.exists() and checksums(served) == before


@pytest.mark.parametrize(("body", "message"), [
    ({}, "serialized_named_tensors is required"),
    ({"serialized_named_tensors": "x"}, "serialized_named_tensors must be a list of strings"),
    ({"serialized_named_tensors": ["!!!not base64!!!"]}, "serialized_named_tensors[0]"),
    ({"serialized_named_tensors": []}, "serialized_named_tensors is required"),
    ({"serialized_named_tensors": ["a", "b"]},
     "serialized_named_tensors size must be 1 or world_size (1), got 2"),
])
def test_bad_tensor_uploads_are_400_and_change_nothing(served: Served, body: dict[str, Any],
                                                         message: str) -> None:
    """A missing, mistyped or undecodable upload is a 400 that says which, nothing written."""
    before = checksums(served)
    r = post(served, "/update_weights_from_tensor", body)
    assert r.status_code == 400 and message in r.json()["message"]
    assert checksums(served) == before


def test_checksum_of_named_modules_marks_unknown_ones_not_found(served: Served) -> None:
    """/get_weights_checksum answers a SHA-256 per known name and "not_found" otherwise."""
    r = post(served, "/get_weights_checksum", {"module_names": ["vae", "nope"]})
    assert r.json() == {"vae": served.ctl.weights_checksum(["vae"])["vae"], "nope": "not_found"}


# -- auth, bad input, metrics ------------------------------------------------------------------
def test_the_api_key_guards_every_path_but_health_and_metrics() -> None:
    """Without the key (or with a wrong one) 401 {"error": "Unauthorized"}; the scheme is
    case-insensitive; /health and /metrics stay open."""
    pipe = DemoPipeline.build(2**20)
    with running_server(pipe, demo_generate(pipe), LifecycleController("cpu"),
                        api_key="s3cret") as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = s.client.post("/release_memory_occupation", json={}, headers=headers)
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
            assert s.client.get("/state", headers=headers).status_code == 401
        assert s.ctl.phase is Phase.AWAKE
        ok = s.client.post("/release_memory_occupation", json={},
                           headers={"Authorization": "bearer s3cret"})
        assert ok.status_code == 200
        assert s.client.get("/health").status_code == 200
        assert s.client.get("/metrics").status_code == 200


def test_bad_input_of_every_kind_is_a_json_4xx_and_the_server_keeps_serving() -> None:
    """Invalid JSON, a non-object body, a mistyped field: 400 naming it; a body over the
    limit: 413; unknown path: 404; wrong method: 405; every one a JSON body."""
    pipe = DemoPipeline.build(2**20)
    with running_server(pipe, demo_generate(pipe), LifecycleController("cpu"),
                        body_limit=1024, upload_limit=4096) as s:
        h = {"content-type": "application/json"}
        cases = [
            (s.client.post("/generate", content=b"{not json", headers=h), 400, "valid JSON"),
            (s.client.post("/generate", content=b"[1, 2]", headers=h), 400, "JSON object"),
            (post(s, "/generate", {"seed": "x"}), 400, "seed must be a integer"),
            (post(s, "/get_weights_checksum", {"module_names": "vae"}), 400, "list of strings"),
            (post(s, "/generate", {"pad": "x" * 2000}), 413, "over the limit"),
            (post(s, "/update_weights_from_tensor",
                  {"serialized_named_tensors": ["x" * 5000]}), 413, "over the limit"),
            (s.client.get("/nowhere"), 404, "Not Found"),
            (s.client.get("/release_memory_occupation"), 405, "Method Not Allowed"),
        ]
        for r, status, text in cases:
            assert r.status_code == status, (r.request.url, r.text)
            assert text in r.json()["message"], r.json()
        assert post(s, "/generate", {"seed": 1}).status_code == 200
        assert s.ctl.phase is Phase.AWAKE and s.ctl.weights_version == 0


def test_metrics_follow_the_lifecycle_in_prometheus_text(served: Served) -> None:
    """/metrics serves the phase, transition counts, bytes and request counts."""
    post(served, "/release_memory_occupation")
    post(served, "/release_memory_occupation")
    text = served.client.get("/metrics").text
    assert 'residency_phase{phase="sleeping"} 1.0' in text
    assert 'residency_transitions_total{outcome="committed",trigger="sleep"} 1.0' in text
    assert 'residency_transitions_total{outcome="noop",trigger="sleep"} 1.0' in text
    assert 'residency_requests_total{path="/release_memory_occupation",status="200"} 2.0' in text
    assert "residency_weights_version 0.0" in text


# -- concurrency ------------------------------------------------------------------------------
def test_a_release_drains_generations_in_flight_and_they_all_succeed(served: Served) -> None:
    """Generations in flight when a release comes finish with 200; the release answers 200
    once they are done; generations after it get the sleeping 400, never a 500."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        slow = [pool.submit(post, served, "/generate", {"seed": i, "delay": 0.5})
                for i in range(3)]
        time.sleep(0.2)
        released = pool.submit(post, served, "/release_memory_occupation")
        statuses = [f.result().status_code for f in slow]
        assert statuses == [200, 200, 200]
        assert released.result().status_code == 200
    late = post(served, "/generate", {"seed": 0})
    assert late.status_code == 400 and late.json()["message"] == SLEEPING_400


def test_a_release_that_cannot_drain_in_time_is_409_and_nothing_moves() -> None:
    """A release waiting longer than the drain timeout answers 409; the generation still
    succeeds and the pipeline stays awake."""
    pipe, generate = factory()
    with running_server(pipe, generate, LifecycleController("cpu", drain_timeout=0.2)) as s, \
            concurrent.futures.ThreadPoolExecutor(2) as pool:
        slow = pool.submit(post, s, "/generate", {"seed": 0, "delay": 1.0})
        time.sleep(0.3)
        r = post(s, "/release_memory_occupation")
        assert r.status_code == 409 and r.json()["success"] is False
        assert slow.result().status_code == 200 and s.ctl.phase is Phase.AWAKE


def test_fsdp_sleep_is_a_400_with_the_reference_message() -> None:
    """sleep/wake of an FSDP pipeline is refused with the reference's message, as a 400 (the
    reference answers 500), and nothing moves."""
    pipe = DemoPipeline.build(2**20)
    ctl = LifecycleController("cpu", use_fsdp_inference=True)
    with running_server(pipe, demo_generate(pipe), ctl) as s:
        r = post(s, "/release_memory_occupation")
        assert r.status_code == 400
        assert r.json() == {"success": False, "sleeping": False,
                            "message": "sleep/wake does not support FSDP inference"}
        assert s.ctl.phase is Phase.AWAKE


def test_a_release_that_fails_midway_is_a_500_saying_it_was_rolled_back() -> None:
    """A copy failing during a release is rolled back: 500 whose body says so, the pipeline
    still awake and serving; the retry succeeds."""
    from tests.helpers import faulty_device

    pipe = DemoPipeline.build(2**20)
    layer = faulty_device()
    layer.place(*pipe.modules.values())  # (from host memory, its first release copies nothing)
    with running_server(pipe, demo_generate(pipe), LifecycleController(device_layer=layer)) as s:
        layer.arm(copy_at=1)
        r = post(s, "/release_memory_occupation")
        assert r.status_code == 500
        body = r.json()
        assert body["success"] is False and body["rolled_back"] is True
        assert "rolled back" in body["message"] and body["sleeping"] is False
        assert post(s, "/generate", {"seed": 0}).status_code == 200
        assert post(s, "/release_memory_occupation").status_code == 200
