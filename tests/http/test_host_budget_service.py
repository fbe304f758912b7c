"""The host budget over HTTP: /state and /metrics show it, a release past it is a 507 with the
numbers and changes nothing, and ``serve --nproc 2 --host-budget`` splits it between ranks."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from lifecycle import LifecycleController
from lifecycle.demo import DemoPipeline
from lifecycle.http import demo_generate
from tests.helpers import faulty_device
from tests.http.server import running_server, serving_ranks

pytestmark = pytest.mark.service


def gauges(text: str, name: str) -> dict[str, float]:
    return {next(iter(s.labels.values())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == name}


def test_a_release_past_the_host_budget_is_507_and_state_and_metrics_show_the_budget() -> None:
    """Offloading the VAE holds its mirror; a budget of exactly that refuses the release of the
    others with 507 and the numbers, the pipeline stays awake; /state and /metrics give the
    budget, the bytes by kind and what is left."""
    pipe = DemoPipeline.build(2**20)
    layer = faulty_device()
    layer.place(*pipe.modules.values())  # (from host memory, attach would keep every mirror)
    ctl = LifecycleController(device_layer=layer, residency="vae=component-offload")
    with running_server(pipe, demo_generate(pipe), ctl) as served:
        held = ctl.report().host_held_bytes
        ctl.set_host_budget(held)
        r = served.client.post("/release_memory_occupation", json={})
        assert r.status_code == 507
        body = r.json()
        assert (body["success"], body["held_bytes"], body["host_budget"]) == (False, held, held)
        assert body["needed_bytes"] > 0 and "refused before allocating" in body["message"]
        state = served.client.get("/state").json()
        assert state["phase"] == "awake"
        host = state["host"]
        assert (host["host_budget"], host["host_left"], host["source"]) == (held, 0, "explicit")
        assert host["held_pinned_bytes"] + host["held_pageable_bytes"] == held
        vae = state["components"]["vae"]
        assert vae["pinned_bytes"] + vae["pageable_bytes"] == held  # footprints, by kind
        metrics = served.client.get("/metrics").text
        assert gauges(metrics, "residency_host_budget_bytes")["host"] == held
        assert gauges(metrics, "residency_host_left_bytes")["host"] == 0
        kinds = gauges(metrics, "residency_host_memory_bytes")
        assert kinds["pinned"] + kinds["pageable"] == held and kinds["file_backed"] == 0


def test_two_ranks_on_one_node_split_the_nodes_host_budget_and_their_sum_holds() -> None:
    """``serve --nproc 2 --host-budget 8MB``: each rank is held to half, the two budgets sum
    to the node's, and a sleep under it succeeds on both ranks."""
    with serving_ranks("--size", "1MB", "--host-budget", "8MB") as (_, client):
        ranks = client.get("/state").json()["ranks"]
        budgets = {r: s["host"]["host_budget"] for r, s in ranks.items()}
        assert budgets == {"0": 4_000_000, "1": 4_000_000}
        assert sum(budgets.values()) == 8_000_000
        assert client.post("/release_memory_occupation", json={}).status_code == 200
        ranks = client.get("/state").json()["ranks"]
        assert all(0 < s["host"]["held_pinned_bytes"] + s["host"]["held_pageable_bytes"]
                   <= 4_000_000 for s in ranks.values())
