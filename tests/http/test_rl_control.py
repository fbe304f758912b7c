"""The RL clients' control routes over a real server on 127.0.0.1 (issue 33), with the bodies
the clients send: slime's and SGLang's tags, pause/continue and aborts, vLLM's sleep levels,
wake tags and pause modes (SkyRL's and TRL's query strings), weight versions, the weights
checker, the world size, and a multi-module tensor upload applied as one update."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import torch

from lifecycle import LifecycleController
from tests.http.clients import parameters, serialize, tensor_sha256
from tests.http.server import Served, running_server
from tests.http.slow_pipeline import factory

pytestmark = pytest.mark.service

ASLEEP = "Server is sleeping. Call resume_memory_occupation first."
UPDATE_WHILE_SLEEPING = ("Cannot update weights while the server is sleeping. "
                         "Call resume_memory_occupation first.")


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """The slow demo pipeline; a generation queued behind a pause waits at most 1 s."""
    pipe, generate = factory()
    ctl = LifecycleController("cpu", admission_timeout=1.0, drain_timeout=10.0)
    with running_server(pipe, generate, ctl) as s:
        yield s


@pytest.fixture(autouse=True)
def unpaused(served: Served) -> Iterator[None]:
    """Every test starts unpaused, whatever the one before it left."""
    yield
    post(served, "/continue_generation")


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as p:
        yield p


def tensors(s: Served) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Every module's parameters and buffers (copies), by module: a trainer's full state."""
    return {n: parameters(m) + [(b, t.clone()) for b, t in m.named_buffers()]
            for n, m in s.pipe.modules.items()}


def post(s: Served, path: str, body: Any = None, **params: Any) -> httpx.Response:
    return s.client.post(path, json={} if body is None else body, params=params)


def generate_later(s: Served, pool: ThreadPoolExecutor, body: dict[str, Any]
                   ) -> Future[httpx.Response]:
    """A generation posted from another thread (its own connection); returns once it is in
    flight."""

    def run() -> httpx.Response:
        with httpx.Client(base_url=s.url, timeout=30) as client:
            return client.post("/generate", json=body)

    before = s.client.get("/is_paused").json()["in_flight"]
    future = pool.submit(run)
    deadline = time.monotonic() + 10
    while s.client.get("/is_paused").json()["in_flight"] <= before:
        assert time.monotonic() < deadline and not future.done(), "it never started"
        time.sleep(0.01)
    return future


# -- partial release by tags -----------------------------------------------------------------
def test_tags_release_and_resume_the_components_they_name(served: Served) -> None:
    """{"tags": ["transformer"]} releases the transformer alone (the answer lists it; the
    phase stays awake; a generation is the reference's asleep 400; an update of it the
    reference's refusal); {"tags": ["dit"]} resumes it."""
    r = post(served, "/release_memory_occupation", {"tags": ["transformer"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert (body["sleeping"], body["phase"], body["moved"], body["asleep"]) == (
        False, "awake", ["transformer"], ["transformer"])
    assert served.client.get("/is_sleeping").json() == {
        "is_sleeping": False,
        "components": {"text_encoder": False, "transformer": True, "vae": False}}
    r = post(served, "/generate", {"seed": 1})
    assert (r.status_code, r.json()["message"]) == (400, ASLEEP)
    new = parameters(served.pipe.modules["transformer"], 1.0)
    r = post(served, "/update_weights_from_tensor", {"serialized_named_tensors": [serialize(new)]})
    assert (r.status_code, r.json()["message"]) == (400, UPDATE_WHILE_SLEEPING)
    r = post(served, "/resume_memory_occupation", {"tags": ["dit"]})
    assert (r.status_code, r.json()["moved"], r.json()["asleep"]) == (200, ["transformer"], [])
    assert post(served, "/generate", {"seed": 1}).status_code == 200


@pytest.mark.parametrize("tags", [["weights"], ["kv_cache", "cuda_graph"], ["kv_cache"],
                                  ["weights", "kv_cache"], []])
def test_tags_naming_the_llm_servers_memory_move_the_whole_pipeline(
        served: Served, tags: list[str]) -> None:
    """slime's and SGLang's tags ("weights", "kv_cache", "cuda_graph") and an empty list:
    the whole pipeline, as the reference's diffusion server does."""
    r = post(served, "/release_memory_occupation", {"tags": tags})
    assert r.status_code == 200 and r.json()["sleeping"] is True, r.text
    assert r.json()["moved"] == ["text_encoder", "transformer", "vae"]
    r = post(served, "/resume_memory_occupation", {"tags": tags})
    assert r.status_code == 200 and r.json()["asleep"] == [], r.text


@pytest.mark.parametrize(("tags", "words"), [
    (["transfromer"], "tags 'transfromer' name(s) nothing this pipeline holds"),
    (["image_encoder"], "tags 'image_encoder' name(s) nothing this pipeline holds"),
    ("weights", "tags must be a list of strings"),
    ([1], "tags must be a list of strings")])
def test_tags_naming_nothing_known_are_400_and_nothing_moves(
        served: Served, tags: Any, words: str) -> None:
    """A misspelled component, a group the pipeline lacks, tags not a list: 400 naming what
    is valid; every component stays awake."""
    r = post(served, "/release_memory_occupation", {"tags": tags})
    assert r.status_code == 400 and words in r.json()["message"], r.text
    assert served.ctl.asleep == frozenset() and served.ctl.phase.value == "awake"


def test_vllm_sleep_levels_and_wake_tags(served: Served) -> None:
    """POST /sleep?level=1 sleeps keeping a host copy; /wake_up?tags=vae wakes the VAE;
    /wake_up wakes the rest bit for bit; level=2 discards (stale until updated); bad levels
    and modes are 400s that move nothing."""
    sums, full = served.ctl.weights_checksum(), tensors(served)
    r = post(served, "/sleep", level=1, mode="wait")
    assert r.status_code == 200 and r.json()["sleeping"] is True, r.text
    assert served.client.get("/is_sleeping").json()["is_sleeping"] is True
    r = post(served, "/wake_up", tags="vae")
    assert (r.json()["moved"], r.json()["asleep"]) == (["vae"], ["text_encoder", "transformer"])
    assert post(served, "/wake_up").json()["asleep"] == []
    assert served.ctl.weights_checksum() == sums
    for params, words in [({"level": "3"}, "level must be 1"), ({"mode": "drop"}, "mode must be"),
                          ({"tags": "nope"}, "tags 'nope' name(s) nothing")]:
        r = post(served, "/sleep", **params)
        assert r.status_code == 400 and words in r.json()["message"], r.text
    assert served.ctl.asleep == frozenset()
    r = post(served, "/sleep", level=2)
    assert r.json()["discarded"] == ["text_encoder", "transformer", "vae"], r.text
    assert post(served, "/wake_up", tags=["weights", "kv_cache"]).json()["asleep"] == []
    assert set(served.ctl.stale) == {"text_encoder", "transformer", "vae"}
    r = post(served, "/update_weights_from_tensor", {
        "serialized_named_tensors": [serialize(full)], "target_modules": list(full)})
    assert r.status_code == 200 and r.json()["stale"] == {}, r.text
    assert post(served, "/sleep", level=1).status_code == 200  # lands the update's refresh
    assert post(served, "/wake_up").status_code == 200
    assert served.ctl.weights_checksum() == sums


# -- generation control ------------------------------------------------------------------------
def test_pause_with_abort_ends_generations_in_flight_and_refuses_new_ones(
        served: Served, pool: ThreadPoolExecutor) -> None:
    """slime's /pause_generation {} (mode abort): the generation in flight ends at once with a
    503 saying it was aborted; a new one is refused until /continue_generation {}."""
    running = generate_later(served, pool, {"delay": 20, "rid": "slow-1"})
    t0 = time.monotonic()
    r = post(served, "/pause_generation", {})
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok",
                        "mode": "abort", "aborted": 1}
    done = running.result(timeout=10)
    assert time.monotonic() - t0 < 10
    assert done.status_code == 503 and done.json()["rid"] == "slow-1", done.text
    assert done.json()["finish_reason"] == {"type": "abort", "message": "paused with mode 'abort'"}
    r = post(served, "/generate", {"seed": 2})
    assert r.status_code == 503 and "paused (mode 'abort')" in r.json()["message"]
    assert served.client.get("/is_paused").json()["is_paused"] is True
    assert post(served, "/continue_generation", {}).json() == {
        "message": "Generation continued successfully.", "status": "ok"}
    assert post(served, "/generate", {"seed": 2}).status_code == 200


def test_pause_in_place_lets_generations_finish_and_queues_new_ones(
        served: Served, pool: ThreadPoolExecutor) -> None:
    """/pause_generation {"mode": "in_place"}: the generation in flight completes; a release
    while paused has nothing left to drain; a new generation waits for the continue (and one
    that waits past the admission timeout is a 503)."""
    running = generate_later(served, pool, {"delay": 0.5})
    assert post(served, "/pause_generation", {"mode": "in_place"}).status_code == 200
    assert running.result(timeout=10).status_code == 200
    assert post(served, "/release_memory_occupation", {}).status_code == 200
    assert post(served, "/resume_memory_occupation", {}).status_code == 200
    r = post(served, "/generate", {"seed": 3})
    assert r.status_code == 503 and "was not continued within 1 s" in r.json()["message"], r.text
    queued = pool.submit(lambda: httpx.post(f"{served.url}/generate", json={"seed": 3},
                                            timeout=30))
    time.sleep(0.2)
    assert not queued.done()
    post(served, "/continue_generation", {})
    assert queued.result(timeout=10).status_code == 200
    # Paused again, then to abort: the one queued meanwhile is refused at once.
    post(served, "/pause_generation", {"mode": "retract"})
    queued = pool.submit(lambda: httpx.post(f"{served.url}/generate", json={"seed": 3},
                                            timeout=30))
    time.sleep(0.2)
    t0 = time.monotonic()
    post(served, "/pause_generation", {"mode": "abort"})
    r = queued.result(timeout=10)
    assert (r.status_code, r.json()["message"]) == (503, "generation is paused (mode 'abort'); "
                                                    "call /continue_generation (or /resume) first")
    assert time.monotonic() - t0 < 0.7  # not at the admission timeout (1 s)


def test_vllm_pause_modes_resume_and_is_paused(served: Served, pool: ThreadPoolExecutor) -> None:
    """SkyRL's /pause?mode=keep&clear_cache=false and /resume; mode=wait answers once the
    generation in flight finished; a bad mode is vLLM's 400 {"error"}."""
    r = post(served, "/pause", mode="keep", clear_cache="false")
    assert r.json() == {"status": "paused"}
    assert served.client.get("/is_paused").json()["mode"] == "keep"
    assert post(served, "/resume").json() == {"status": "resumed"}
    running = generate_later(served, pool, {"delay": 0.5})
    assert post(served, "/pause", mode="wait").status_code == 200
    assert served.client.get("/is_paused").json() == {"is_paused": True, "mode": "wait",
                                                      "in_flight": 0}
    assert running.result(timeout=10).status_code == 200
    r = post(served, "/pause", mode="drop")
    assert r.status_code == 400 and r.json() == {
        "error": "mode must be one of ['abort', 'wait', 'keep'], got 'drop'"}
    r = post(served, "/pause_generation", {"mode": "freeze"})
    assert r.status_code == 400 and r.json()["message"] == (
        "Invalid mode: 'freeze'. Expected one of ['abort', 'retract', 'in_place'].")
    post(served, "/resume")
    assert served.client.get("/is_paused").json()["is_paused"] is False


def test_abort_request_ends_one_generation_by_id_or_all(
        served: Served, pool: ThreadPoolExecutor) -> None:
    """/abort_request {"rid"} ends that generation only (a 503 naming it); vLLM's
    /abort_requests {}, SGLang's {"abort_all": true} and /update_weight_version (its
    abort_all_requests defaults to true) end every one; generation goes on unpaused after."""
    first = generate_later(served, pool, {"delay": 20, "rid": "a"})
    assert post(served, "/abort_request", {"rid": "b"}).json() == {"success": True, "aborted": 0}
    assert post(served, "/abort_request", {"rid": "a"}).json() == {"success": True, "aborted": 1}
    assert first.result(timeout=10).json()["rid"] == "a"
    second = generate_later(served, pool, {"delay": 20})
    assert post(served, "/abort_requests", {}).json() == {"status": "aborted", "aborted": 1}
    assert second.result(timeout=10).status_code == 503
    third = generate_later(served, pool, {"delay": 20})
    assert post(served, "/abort_request", {"abort_all": True}).json() == {
        "success": True, "aborted": 1}
    assert third.result(timeout=10).json()["finish_reason"]["message"] == \
        "aborted by /abort_request"
    fourth = generate_later(served, pool, {"delay": 20})
    post(served, "/update_weight_version", {"new_version": "v9"})  # abort_all_requests: true
    assert fourth.result(timeout=10).json()["finish_reason"]["message"] == \
        "the weight version changed to 'v9'"
    assert post(served, "/generate", {"seed": 4}).status_code == 200


# -- versions, checks, world size ---------------------------------------------------------------
def test_update_weight_version_names_the_weights_and_refuses_bad_bodies(served: Served) -> None:
    """/update_weight_version {"new_version", "abort_all_requests"}: the reference's answer,
    /get_weight_version follows; a missing or non-string version is a 400."""
    r = post(served, "/update_weight_version", {"new_version": "v7", "abort_all_requests": False})
    assert r.json() == {"success": True, "message": "Weight version updated to v7",
                        "new_version": "v7"}
    assert served.client.get("/get_weight_version").json() == {"weight_version": "v7"}
    for body, message in [({}, "new_version is required"),
                          ({"new_version": 7}, "new_version must be a string, got int")]:
        r = post(served, "/update_weight_version", body)
        assert (r.status_code, r.json()["message"]) == (400, message)
    assert served.client.get("/get_weight_version").json() == {"weight_version": "v7"}
    assert served.client.get("/get_world_size").json() == {"world_size": 1}


def test_the_weights_checker_names_every_tensor_a_reset_changed_until_a_sync_restores_them(
        served: Served) -> None:
    """snapshot, reset_tensors, compare (400 naming every tensor), a multi-module upload of
    the snapshotted weights (one update), compare (200); an unknown action is a 400."""
    full = tensors(served)
    assert post(served, "/weights_checker", {"action": "snapshot"}).json()["success"] is True
    assert post(served, "/weights_checker", {"action": "compare"}).json()["success"] is True
    r = post(served, "/weights_checker", {"action": "reset_tensors"})
    assert r.status_code == 200, r.text
    r = post(served, "/weights_checker", {"action": "compare"})
    count = sum(len(list(m.named_parameters(remove_duplicate=False)))  # tied: each name
                + len(list(m.named_buffers(remove_duplicate=False)))
                for m in served.pipe.modules.values())
    assert r.status_code == 400 and r.json()["message"].startswith(
        f"{count} of {count} tensor(s) differ from the snapshot: ['text_encoder."), r.text
    r = post(served, "/update_weights_from_tensor", {
        "serialized_named_tensors": [serialize(full)], "target_modules": list(full)})
    assert r.status_code == 200 and r.json()["message"] == \
        "Updated 3 modules (text_encoder, transformer, vae).", r.text
    assert post(served, "/weights_checker", {"action": "compare"}).json() == {
        "success": True, "message": f"all {count} tensor(s) match the snapshot"}
    # A release after the sync (it waits for the update's mirror refresh) keeps them.
    assert post(served, "/release_memory_occupation", {}).status_code == 200
    assert post(served, "/resume_memory_occupation", {}).status_code == 200
    assert post(served, "/weights_checker", {"action": "compare"}).json()["success"] is True
    r = post(served, "/weights_checker", {"action": "checksum_all"})
    assert r.status_code == 400 and r.json()["message"].startswith("Unsupported action=")


def test_vllms_weight_checker_compares_with_the_callers_baseline(served: Served) -> None:
    """vLLM's /weight_checker: checksum gives every tensor's hash; compare with it matches,
    with one hash changed names that tensor; a bad action is a 400, a paused engine a 409."""
    sums = post(served, "/weight_checker", {"action": "checksum"}).json()["checksums"]
    assert {n.partition(".")[0] for n in sums} == {"text_encoder", "transformer", "vae"}
    assert sums["transformer.x_proj.bias"] == tensor_sha256(
        served.pipe.modules["transformer"].get_parameter("x_proj.bias"))
    r = post(served, "/weight_checker", {"action": "compare", "baseline": sums})
    assert r.json() == {"match": True, "mismatches": []}
    changed = {**sums, "transformer.x_proj.bias": "0" * 64}
    r = post(served, "/weight_checker", {"action": "compare", "baseline": changed})
    assert r.json() == {"match": False, "mismatches": ["transformer.x_proj.bias"]}
    r = post(served, "/weight_checker", {"action": "snapshot"})
    assert r.status_code == 400 and r.json()["detail"] == \
        "action must be one of checksum|reset|compare, got 'snapshot'"
    r = post(served, "/weight_checker", {"action": "compare"})
    assert (r.status_code, r.json()["detail"]) == (400, "action='compare' requires a 'baseline' "
                                                        "object")
    post(served, "/pause", mode="keep")
    r = post(served, "/weight_checker", {"action": "checksum"})
    assert (r.status_code, r.json()["detail"]) == (
        409, "weight_checker requires an awake, unpaused engine")


def test_a_multi_module_upload_with_one_bad_tensor_changes_no_module(served: Served) -> None:
    """A payload keyed by module for two modules, one tensor of the VAE of a wrong shape:
    400 with the reference's shape message; neither module changed."""
    sums = served.ctl.weights_checksum()
    version = served.ctl.weights_version
    payload = {"transformer": parameters(served.pipe.modules["transformer"], 2.0),
               "vae": [(n, torch.zeros(1)) for n, _ in
                       served.pipe.modules["vae"].named_parameters()][:1]}
    r = post(served, "/update_weights_from_tensor", {
        "serialized_named_tensors": [serialize(payload)], "target_modules": ["transformer", "vae"]})
    assert r.status_code == 400 and r.json()["message"].startswith("Shape mismatch for "), r.text
    assert (served.ctl.weights_checksum(), served.ctl.weights_version) == (sums, version)
