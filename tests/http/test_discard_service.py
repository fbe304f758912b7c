"""Discarding releases over HTTP (issue 24): ``--discard-on-release`` and the release body's
``discard`` drop weights without a host copy; after the resume the stale components refuse
``/generate`` (400), checksum as ``"discarded"``, show in ``/state`` and ``/metrics``; update
answers say what is still stale; the full update serves exactly what was served before. A
real server on 127.0.0.1 and a real client (on asyncio and trio), and ``residency serve``
itself, with one rank and with two."""

from __future__ import annotations

import base64
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import save

from lifecycle import LifecycleController
from lifecycle.demo import DemoPipeline
from lifecycle.http import demo_generate
from tests.http.server import ROOT, Served, running_server, serving_ranks

pytestmark = pytest.mark.service

SIZE = 2**20
COMPONENTS = ["text_encoder", "transformer", "vae"]
DISCARDED = "discarded"


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    """The served transformer's state dict as it starts (the demo is built from fixed seeds;
    a copy of each tensor, so that tied ones can be saved apart)."""
    module = DemoPipeline.build(SIZE).modules["transformer"]
    return {k: v.clone() for k, v in module.state_dict().items()}


def upload(named: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """An ``/update_weights_from_tensor`` body writing ``named`` into the transformer."""
    return {"serialized_named_tensors": [base64.b64encode(save(dict(named))).decode()],
            "load_format": "safetensors", "target_modules": ["transformer"]}


@pytest.fixture
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    """The demo pipeline served with ``discard_on_release`` = the test's parameter (None when
    not parametrized: releases keep the weights unless their body says otherwise)."""
    pipe = DemoPipeline.build(SIZE)
    ctl = LifecycleController("cpu", discard_on_release=getattr(request, "param", None))
    with running_server(pipe, demo_generate(pipe), ctl) as s:
        yield s


@asynccontextmanager
async def client(s: Served) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
        yield c


async def expect_stale(c: httpx.AsyncClient, stale: Mapping[str, int]) -> None:
    """/state and /metrics show ``stale`` (component -> stale tensors), the others at 0."""
    state = (await c.get("/state")).json()
    assert state["stale"] == dict(stale)
    assert {n: p["stale_tensors"] for n, p in state["components"].items()} == {
        n: stale.get(n, 0) for n in COMPONENTS}
    metrics = (await c.get("/metrics")).text
    for n in COMPONENTS:
        assert f'residency_stale_tensors{{component="{n}"}} {float(stale.get(n, 0))}' in metrics


async def expect_refused(c: httpx.AsyncClient, stale: Mapping[str, int],
                         sums: Mapping[str, str]) -> None:
    """/generate is a 400 naming the stale components; their checksum is "discarded", the
    others' is ``sums``'."""
    r = await c.post("/generate", json={"seed": 5})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["success"] is False and body["stale"] == dict(stale)
    assert "Update weights first" in body["message"]
    assert all(repr(n) in body["message"] for n in stale)
    got = (await c.post("/get_weights_checksum", json={})).json()
    assert got == {n: DISCARDED if n in stale else sums[n] for n in COMPONENTS}


@pytest.mark.anyio
@pytest.mark.parametrize(("served", "release"), [
    pytest.param(None, {"discard": ["transformer"]}, id="body"),
    pytest.param(["transformer"], {}, id="option"),
], indirect=["served"])
async def test_the_rl_loop_over_http_with_a_discarding_release_serves_exactly_after_the_full_update(
        served: Served, release: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """Release discarding the transformer (the body says so, or the server's option with the
    clients' ``{}``), resume: it is stale (/state, /metrics), /generate is a 400 naming it, its
    checksum "discarded" (the others' unchanged); a partial update answers 200 saying how many
    tensors are still missing and it still refuses; the full update makes it fresh: the same
    output and checksums as before the release."""
    async with client(served) as c:
        before = (await c.post("/generate", json={"seed": 5})).json()
        sums = (await c.post("/get_weights_checksum", json={})).json()
        assert set(sums) == set(COMPONENTS) and DISCARDED not in sums.values()
        r = await c.post("/release_memory_occupation", json=release)
        assert r.status_code == 200 and r.json()["discarded"] == ["transformer"], r.text
        await expect_stale(c, {"transformer": len(state)})  # dropped: stale while asleep too
        assert (await c.post("/resume_memory_occupation", json={})).status_code == 200
        await expect_stale(c, {"transformer": len(state)})
        await expect_refused(c, {"transformer": len(state)}, sums)
        named = await c.post("/get_weights_checksum", json={"module_names": ["transformer", "unet"]})
        assert named.json() == {"transformer": DISCARDED, "unet": "not_found"}

        names = sorted(state)
        half = {n: state[n] for n in names[:len(names) // 2]}
        missing = len(state) - len(half)
        r = await c.post("/update_weights_from_tensor", json=upload(half))
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        assert r.json()["stale"] == {"transformer": missing}
        message = r.json()["message"]
        assert message.startswith("Updated 1 modules (transformer).")
        assert f"still stale (not served until updated): transformer ({missing} tensor(s): " \
            in message
        assert any(n in message for n in names[len(names) // 2:])  # a few missing names
        assert not any(f" {n}," in message or f" {n}..." in message for n in half)
        await expect_stale(c, {"transformer": missing})
        await expect_refused(c, {"transformer": missing}, sums)

        r = await c.post("/update_weights_from_tensor", json=upload(state))
        assert r.status_code == 200 and r.json()["stale"] == {}, r.text
        assert r.json()["message"] == "Updated 1 modules (transformer)."
        await expect_stale(c, {})
        after = await c.post("/generate", json={"seed": 5})
        assert after.status_code == 200, after.text
        assert (after.json()["sha256"], after.json()["shape"]) == (before["sha256"],
                                                                   before["shape"])
        assert (await c.post("/get_weights_checksum", json={})).json() == sums


@pytest.mark.anyio
@pytest.mark.parametrize(("discard", "wrong"), [
    (3, "got int"),
    ({"transformer": True}, "got dict"),
    ([1, "vae"], "got a list holding a non-string"),
    ("nope", "unknown component(s) 'nope';"),
    (["transformer", "unet"], "unknown component(s) 'unet';"),
    ("transformer,", "unknown component(s) '';"),
])
async def test_a_bad_discard_value_is_a_400_naming_it_and_the_valid_values_and_changes_nothing(
        served: Served, discard: Any, wrong: str) -> None:
    """A ``discard`` of the wrong type or naming a component the pipeline lacks is a 400 that
    says what was wrong and lists the valid values; the server stays awake, nothing moved."""
    async with client(served) as c:
        before = (await c.get("/state")).json()
        r = await c.post("/release_memory_occupation", json={"discard": discard})
        assert r.status_code == 400, r.text
        message = r.json()["message"]
        assert r.json()["success"] is False and message.startswith("discard ")
        assert wrong in message
        assert "true (every component), false (none), \"all\", or a list of component names " \
               "from ['text_encoder', 'transformer', 'vae']" in message
        assert (await c.get("/state")).json() == before
        assert (await c.post("/generate", json={"seed": 1})).status_code == 200


@pytest.mark.anyio
@pytest.mark.parametrize(("served", "release", "discarded"), [
    pytest.param("all", {"discard": False}, [], id="option-all-body-false"),
    pytest.param(["transformer"], {"discard": ["vae"]}, ["vae"], id="option-names-body-names"),
    pytest.param(["transformer"], {"discard": None}, ["transformer"], id="body-null-is-option"),
    pytest.param(None, {"discard": True}, COMPONENTS, id="no-option-body-true"),
    pytest.param(None, {"discard": "vae, text_encoder"}, ["text_encoder", "vae"],
                 id="no-option-body-comma-names"),
], indirect=["served"])
async def test_the_release_body_overrides_the_servers_option_both_ways(
        served: Served, release: dict[str, Any], discarded: list[str]) -> None:
    """The body's ``discard`` replaces ``--discard-on-release`` for that call (false keeps every
    weight, names discard exactly those, true all); null means the option. After the resume
    exactly the discarded components are stale, and /generate serves only when none is."""
    async with client(served) as c:
        r = await c.post("/release_memory_occupation", json=release)
        assert r.status_code == 200 and sorted(r.json()["discarded"]) == discarded, r.text
        await c.post("/resume_memory_occupation", json={})
        state = (await c.get("/state")).json()
        assert sorted(state["stale"]) == discarded
        r = await c.post("/generate", json={"seed": 1})
        assert r.status_code == (400 if discarded else 200), r.text
        if discarded:
            assert sorted(r.json()["stale"]) == discarded


def test_serve_refuses_discard_on_release_names_the_pipeline_lacks_with_exit_2() -> None:
    """``--discard-on-release`` naming an unknown component is bad usage (exit 2) naming it and
    the components, before anything is served; an empty name is refused by the parser."""
    done = subprocess.run([sys.executable, "-m", "lifecycle", "serve", "--port", "0",
                           "--size", "1MB", "--discard-on-release", "transformer,unet"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--discard-on-release: discard names unknown components ['unet']" in done.stderr
    assert "'text_encoder', 'transformer', 'vae'" in done.stderr and "ready" not in done.stdout
    done = subprocess.run([sys.executable, "-m", "lifecycle", "serve", "--port", "0",
                           "--discard-on-release", "transformer,,vae"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "must be 'all' or comma-separated component names" \
        in done.stderr, done.stderr[-2000:]


def test_two_ranks_discard_on_the_option_and_on_the_body_and_answer_as_one(
        state: dict[str, torch.Tensor]) -> None:
    """``residency serve --nproc 2 --discard-on-release transformer``: a release with ``{}``
    discards the transformer on both ranks (stale on both after the resume), /generate is a
    400 naming it, its checksum "discarded"; a partial upload leaves both ranks stale (the
    answer says how many are missing), the full one serves exactly the output before; a body
    with ``"discard": false`` then keeps the weights on both ranks."""
    with serving_ranks("--size", "1MiB", "--discard-on-release", "transformer") as (_, c):
        before = c.post("/generate", json={"seed": 2}).json()
        assert before["ranks_agree"] is True
        sums = c.post("/get_weights_checksum", json={}).json()
        r = c.post("/release_memory_occupation", json={})
        assert r.status_code == 200 and r.json()["discarded"] == ["transformer"], r.text
        assert c.post("/resume_memory_occupation", json={}).status_code == 200
        ranks = c.get("/state").json()["ranks"]
        assert {r: s["stale"] for r, s in ranks.items()} == {
            "0": {"transformer": len(state)}, "1": {"transformer": len(state)}}
        r = c.post("/generate", json={"seed": 2})
        assert r.status_code == 400 and "'transformer'" in r.json()["message"], r.text
        assert c.post("/get_weights_checksum", json={}).json() == {**sums, "transformer": DISCARDED}

        names = sorted(state)
        half = {n: state[n] for n in names[:len(names) // 2]}
        r = c.post("/update_weights_from_tensor", json=upload(half))
        missing = len(state) - len(half)
        assert r.status_code == 200 and r.json()["stale"] == {"transformer": missing}, r.text
        assert f"transformer ({missing} tensor(s): " in r.json()["message"]
        ranks = c.get("/state").json()["ranks"]
        assert [ranks[r]["stale"] for r in "01"] == [{"transformer": missing}] * 2
        assert c.post("/generate", json={"seed": 2}).status_code == 400
        r = c.post("/update_weights_from_tensor", json=upload(state))
        assert r.status_code == 200 and r.json()["stale"] == {}, r.text
        after = c.post("/generate", json={"seed": 2}).json()
        assert (after["sha256"], after["ranks_agree"]) == (before["sha256"], True)
        assert c.post("/get_weights_checksum", json={}).json() == sums

        r = c.post("/release_memory_occupation", json={"discard": False})
        assert r.status_code == 200 and r.json()["discarded"] == [], r.text
        c.post("/resume_memory_occupation", json={})
        ranks = c.get("/state").json()["ranks"]
        assert [ranks[r]["stale"] for r in "01"] == [{}, {}]
        assert c.post("/generate", json={"seed": 2}).json()["sha256"] == before["sha256"]
