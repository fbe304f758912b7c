"""The RL clients' bodies against a real server on 127.0.0.1 (issue 23): module-keyed buckets
and named-tensor lists (torch's multiprocessing pickler, base64, the metadata class under the
reference's module path), tensor-parallel entries picked by rank or GPU UUID, the reference's
checksum and per-tensor checker, LoRA merges and weight versions on the wire."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save_file

from lifecycle import LifecycleController
from lifecycle.demo import DemoPipeline
from lifecycle.http import create_app
from lifecycle.http._wire import WireRefused, normalize_uuid, pick_entry
from tests.http.clients import (
    bucket_payload,
    reference_checksum,
    serialize,
    tensor_sha256,
)
from tests.http.server import Served, running_server

pytestmark = pytest.mark.service

BIAS = "x_proj.bias"  # the demo transformer's (float32)
LORA_A = "base_model.model.x_proj.lora_A.default.weight"  # PEFT's names of x_proj's adapter
LORA_B = "base_model.model.x_proj.lora_B.default.weight"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """The demo pipeline (256 KB) served once for the module; every test reads the weights
    it starts from."""
    with running_server(DemoPipeline.build(2**18), None, LifecycleController("cpu")) as s:
        yield s


def post(s: Served, path: str, body: Any) -> httpx.Response:
    return s.client.post(path, json=body)


def transformer(s: Served) -> dict[str, torch.Tensor]:
    return dict(s.pipe.modules["transformer"].named_parameters())


def unchanged(s: Served) -> tuple[int, dict[str, str]]:
    """What no refusal may change: the version and every module's checksum."""
    return s.ctl.weights_version, s.ctl.weights_checksum()


def random_like(named: Mapping[str, torch.Tensor], seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(t.shape, generator=gen).to(t.dtype)) for n, t in named.items()]


# -- item 1: payloads keyed by module ----------------------------------------------------------
@pytest.mark.parametrize(("layout", "keyed"), [
    ("uint8 bucket", True), ("one-dtype bucket", False), ("pairs", True), ("pairs", False)])
def test_the_diffusion_clients_uploads_update_the_module_and_label_its_version(
        served: Served, layout: str, keyed: bool) -> None:
    """The newest diffusion client's body (a bucket keyed by module, payload_gpu_uuids naming
    this rank's device, weight_version, fields for the LLM server) and the older bare forms
    answer 200; the weights are exactly the sent ones; the label is in /get_weight_version,
    /state and /metrics."""
    new = random_like(transformer(served), seed=len(layout) + keyed)
    uuid = served.client.get("/state").json()["device_uuid"]
    body: dict[str, Any] = {"target_modules": ["transformer"], "payload_gpu_uuids": [uuid],
                            "weight_version": f"{layout}-{keyed}", "abort_all_requests": False}
    if layout == "pairs":  # "auto" is the LLM server's default: read as sniffed
        body["serialized_named_tensors"] = [serialize({"transformer": new} if keyed else new)]
        body["load_format"] = "auto"
    else:
        body["serialized_named_tensors"] = [bucket_payload(
            new, "transformer" if keyed else None, as_bytes=layout == "uint8 bucket")]
        body["load_format"] = "flattened_bucket"
    r = post(served, "/update_weights_from_tensor", body)
    assert r.status_code == 200, r.text
    assert r.json()["message"] == "Updated 1 modules (transformer)."
    assert all(torch.equal(transformer(served)[n], t) for n, t in new)
    label = body["weight_version"]
    assert served.client.get("/get_weight_version").json() == {"weight_version": label}
    assert served.client.get("/state").json()["weight_version"] == label
    assert f'residency_weight_version_info{{version="{label}"}} 1.0' in \
        served.client.get("/metrics").text


def _keyed(module: str) -> Callable[[list[tuple[str, torch.Tensor]]], str]:
    return lambda new: serialize({module: new})


@pytest.mark.parametrize(("make", "extra", "message"), [
    (_keyed("vae"), {}, "Missing tensor payload for module(s): ['transformer']. Provided modules: "
                        "['vae']"),
    (lambda new: bucket_payload(new, "vae"), {"load_format": "flattened_bucket"},
     "Missing tensor payload for module(s): ['transformer']. Provided modules: ['vae']"),
    (serialize, {"target_modules": ["transformer", "vae"]},
     "Ambiguous tensor payload for multi-module update. Provide a dict mapping module_name -> "
     "module payload, requested modules: ['transformer', 'vae']."),
    (lambda new: serialize({"transformer": new, "vae": []}),
     {"target_modules": ["transformer", "vae"]},
     "serialized_named_tensors[0] holds no tensors for 'vae'; an update writes at least one "
     "per module named, nothing was updated"),
], ids=["missing", "missing-bucket", "ambiguous", "two-modules-one-empty"])
def test_payloads_that_do_not_match_the_target_modules_are_the_references_400s(
        served: Served, make: Callable[[list[tuple[str, torch.Tensor]]], str],
        extra: dict[str, Any], message: str) -> None:
    """A dict lacking a targeted module, a bare payload for two modules, two modules one of
    them empty: 400 with the reference's message (ours for the last); nothing changes."""
    before = unchanged(served)
    new = random_like(transformer(served), seed=5)[:2]
    r = post(served, "/update_weights_from_tensor",
             {"serialized_named_tensors": [make(new)], **extra})
    assert r.status_code == 400 and r.json()["message"] == message, r.text
    assert unchanged(served) == before


# -- item 2: tensor-parallel entries -----------------------------------------------------------
def test_uuids_compare_without_prefix_or_case_and_entries_are_picked_like_the_references() -> None:
    """GPU-/MIG- prefixes and case do not matter; without UUIDs a rank takes the only entry or
    its own; the reference's three refusals."""
    assert normalize_uuid(" GPU-AB12-cd ") == normalize_uuid("mig-ab12-CD") == "ab12-cd"
    assert pick_entry(1, None, 1, 2, "x") == 0 and pick_entry(2, [], 1, 2, "x") == 1
    assert pick_entry(2, ["GPU-Aa", "gpu-bb"], 0, 2, "BB") == 1
    for args, message in [
            ((3, None, 0, 2, "x"), "serialized_named_tensors size must be 1 or world_size (2), "
                                   "got 3"),
            ((2, ["a"], 0, 2, "a"), "payload_gpu_uuids needs one entry per payload, got 1 for 2 "
                                    "payloads"),
            ((1, ["GPU-a"], 0, 1, "CPU-b"), "no payload was exported from this worker's GPU "
                                            "cpu-b, got ['GPU-a']")]:
        with pytest.raises(WireRefused) as caught:
            pick_entry(*args)
        assert str(caught.value) == message


def test_a_rank_takes_the_entry_exported_from_its_own_device(served: Served) -> None:
    """Two entries with UUIDs: this rank takes the one whose UUID is its own (/state's
    device_uuid, in another case); entry counts and UUIDs that do not fit are the reference's
    400s and change nothing."""
    uuid = served.client.get("/state").json()["device_uuid"]
    size = transformer(served)[BIAS].numel()
    mine, other = torch.linspace(-1, 1, size), torch.full((size,), 7.0)
    entries = [serialize([(BIAS, other)]), serialize([(BIAS, mine)])]
    before = unchanged(served)
    for body, message in [
            ({"serialized_named_tensors": entries},
             "serialized_named_tensors size must be 1 or world_size (1), got 2"),
            ({"serialized_named_tensors": entries, "payload_gpu_uuids": [uuid]},
             "payload_gpu_uuids needs one entry per payload, got 1 for 2 payloads"),
            ({"serialized_named_tensors": entries[:1], "payload_gpu_uuids": ["GPU-0000-aaaa"]},
             f"no payload was exported from this worker's GPU {normalize_uuid(uuid)}, got "
             "['GPU-0000-aaaa']")]:
        r = post(served, "/update_weights_from_tensor", body)
        assert r.status_code == 400 and r.json()["message"] == message, r.text
    assert unchanged(served) == before
    r = post(served, "/update_weights_from_tensor", {
        "serialized_named_tensors": entries, "payload_gpu_uuids": ["GPU-0000-aaaa", uuid.upper()]})
    assert r.status_code == 200, r.text
    assert torch.equal(transformer(served)[BIAS], mine)


# -- item 3: the reference checksum ---------------------------------------------------------------
def test_get_weights_checksum_is_the_clients_computation_asleep_or_awake(served: Served) -> None:
    """/get_weights_checksum answers, per module, what the clients' compute_weights_checksum
    gives over its parameters; the same while the pipeline sleeps."""
    expected = {n: reference_checksum(m.named_parameters()) for n, m in served.pipe.modules.items()}
    assert post(served, "/get_weights_checksum", {}).json() == expected
    assert post(served, "/release_memory_occupation", {}).status_code == 200
    try:
        assert post(served, "/get_weights_checksum", {"module_names": ["transformer"]}).json() \
            == {"transformer": expected["transformer"]}
    finally:
        assert post(served, "/resume_memory_occupation", {}).status_code == 200


# -- item 5: LoRA merges on the wire ---------------------------------------------------------------
@pytest.mark.parametrize("layout", ["pairs", "bucket"])
def test_lora_merges_over_http_are_exact_and_start_from_the_pristine_base(
        served: Served, layout: str) -> None:
    """A full update sets x_proj's base; two LoRA merges (PEFT names, lora_alpha and
    lora_rank on the wire) each give base + alpha/rank * B @ A in fp32 exactly, the second
    from the base, not from the first merge; a zero adapter gives the base back bit for bit;
    an unknown mode is a 400 naming the accepted ones."""
    out, in_ = transformer(served)["x_proj.weight"].shape
    base = torch.randn(out, in_, generator=torch.Generator().manual_seed(1))
    assert post(served, "/update_weights_from_tensor", {
        "serialized_named_tensors": [serialize([("x_proj.weight", base)])]}).status_code == 200
    gen = torch.Generator().manual_seed(2)

    def merge(a: torch.Tensor, b: torch.Tensor, **extra: Any) -> httpx.Response:
        named = [(LORA_A, a), (LORA_B, b)]
        body: dict[str, Any] = {"weight_update_mode": "lora_merge", "lora_rank": 4, **extra}
        if layout == "bucket":
            body |= {"serialized_named_tensors": [bucket_payload(named)],
                     "load_format": "flattened_bucket"}
        else:
            body["serialized_named_tensors"] = [serialize(named)]
        return post(served, "/update_weights_from_tensor", body)

    for alpha in (16, None):
        a, b = torch.randn(4, in_, generator=gen), torch.randn(out, 4, generator=gen)
        r = merge(a, b, **({} if alpha is None else {"lora_alpha": alpha}))
        assert r.status_code == 200, r.text
        scale = 1.0 if alpha is None else alpha / 4  # a missing alpha is the rank: scale 1
        assert torch.equal(transformer(served)["x_proj.weight"], base + scale * (b @ a))
    assert merge(torch.zeros(4, in_), torch.zeros(out, 4), lora_alpha=16).status_code == 200
    assert torch.equal(transformer(served)["x_proj.weight"], base)
    r = merge(a, b, weight_update_mode="dora")
    assert r.status_code == 400 and r.json()["message"].startswith(
        "weight_update_mode 'dora' is not supported; accepted: 'full'")
    assert "'lora_merge'" in r.json()["message"]


# -- item 7: the per-tensor checker -------------------------------------------------------------------
def test_the_tensor_checker_names_every_mismatched_and_missing_tensor(served: Served) -> None:
    """The clients' per-tensor SHA-256s of the module's tensors: 200 success; a wrong hash and
    an unknown name: 400 naming both; the reference's messages for missing fields."""
    good = {n: tensor_sha256(t) for n, t in transformer(served).items()}
    r = post(served, "/update_weights_from_tensor_checker",
             {"target_module": "transformer", "expected_named_tensors_sha256": good})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    bad = {**good, BIAS: "0" * 64, "nope.weight": good[BIAS]}
    r = post(served, "/update_weights_from_tensor_checker",
             {"target_module": "transformer", "expected_named_tensors_sha256": bad})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "1 mismatched: ['x_proj.bias']" in r.json()["message"]
    assert "1 missing from transformer: ['nope.weight']" in r.json()["message"]
    for body, message in [
            ({}, "target_module is required"),
            ({"target_module": "transformer"}, "expected_named_tensors_sha256 is required"),
            ({"target_module": "transformer", "expected_named_tensors_sha256": {}},
             "expected_named_tensors_sha256 is required"),
            ({"target_module": "unet", "expected_named_tensors_sha256": good},
             "Module(s) requested not found in pipeline: ['unet']")]:
        r = post(served, "/update_weights_from_tensor_checker", body)
        assert r.status_code == 400 and r.json()["message"].startswith(message), r.text


# -- item 6: weight versions from every route, in process on both loops -------------------------------
@pytest.mark.anyio
async def test_every_update_route_labels_the_weights_and_a_failed_one_keeps_the_label(
        tmp_path: Path) -> None:
    """Before any update the version is null; a tensor upload (an integer label), a disk update
    (with the LLM server's load_format "auto") set it; a refused update keeps it."""
    pipe = DemoPipeline.build(2**16)
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(pipe)
        app = create_app(ctl)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            assert (await client.get("/get_weight_version")).json() == {"weight_version": None}
            new = random_like(dict(pipe.modules["transformer"].named_parameters()), seed=9)
            r = await client.post("/update_weights_from_tensor", json={
                "serialized_named_tensors": [bucket_payload(new)], "load_format": "flattened_bucket",
                "target_modules": ["transformer"], "weight_version": 7})
            assert r.status_code == 200 and r.json()["weight_version"] == "7", r.text
            (tmp_path / "vae").mkdir()
            save_file(dict(random_like(dict(pipe.modules["vae"].named_parameters()), seed=3)),
                      str(tmp_path / "vae" / "w.safetensors"))
            r = await client.post("/update_weights_from_disk", json={
                "model_path": str(tmp_path), "target_modules": ["vae"], "weight_version": "disk-1",
                "load_format": "auto", "abort_all_requests": True, "flush_cache": True})
            assert r.status_code == 200, r.text
            r = await client.post("/update_weights_from_tensor", json={
                "serialized_named_tensors": [serialize([("nope", torch.ones(1))])],
                "weight_version": "lost"})
            assert r.status_code == 400 and r.json()["weight_version"] == "disk-1"
            assert (await client.get("/get_weight_version")).json() == {"weight_version": "disk-1"}
            state = (await client.get("/state")).json()
            assert (state["weight_version"], state["weights_version"]) == ("disk-1", 2)
            r = await client.post("/update_weights_from_tensor", content=json.dumps({
                "serialized_named_tensors": [serialize(new)], "weight_version": [1]}),
                headers={"content-type": "application/json"})
            assert r.status_code == 400 and r.json()["message"] == \
                "weight_version must be a string, got list"
