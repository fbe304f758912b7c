"""``residency serve --nproc 2``: rank 0 serves HTTP, every call runs on every rank, the
ranks' generations are checked against each other, a dead rank is named, SIGTERM stops all."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def serving(*args: str, env: dict[str, str] | None = None
            ) -> Iterator[tuple[subprocess.Popen[str], httpx.Client]]:
    """``python -m lifecycle serve --nproc 2 --port 0 ...`` and a client on it."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lifecycle", "serve", "--nproc", "2", "--port", "0",
         "--collective-timeout", "5", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert found is not None and "2 ranks" in line, line
        with httpx.Client(base_url=f"http://127.0.0.1:{found.group(1)}", timeout=60) as client:
            yield proc, client
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


def test_every_call_runs_on_every_rank_and_sigterm_stops_them_all() -> None:
    """Generations agree across ranks; release/resume and a tensor update happen on both
    ranks (/state shows each rank); SIGTERM to the server stops every rank, exit 0."""
    with serving("--size", "1MB") as (proc, client):
        gen = client.post("/generate", json={"seed": 2}).json()
        assert gen["ranks_agree"] is True and gen["world_size"] == 2
        assert client.post("/release_memory_occupation", json={}).status_code == 200
        ranks = client.get("/state").json()["ranks"]
        assert {r: s["phase"] for r, s in ranks.items()} == {"0": "sleeping", "1": "sleeping"}
        assert all(s["device_bytes"] == 0 for s in ranks.values())
        assert client.post("/resume_memory_occupation", json={}).status_code == 200
        sums = client.post("/get_weights_checksum", json={}).json()
        assert set(sums) == {"text_encoder", "transformer", "vae"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_ranks_whose_outputs_differ_answer_500() -> None:
    """Rank 1's weights differ from rank 0's: a generation is a 500 saying the ranks'
    outputs differ (a real consistency check, not rank 0's answer alone)."""
    with serving("--pipeline", "tests.http.rank_pipeline:factory",
                 env={"RESIDENCY_TEST_CORRUPT_RANK": "1"}) as (_, client):
        r = client.post("/generate", json={"seed": 0})
        assert r.status_code == 500 and "outputs differ" in r.json()["message"]


def test_a_dead_rank_is_named_by_health_and_control_calls_answer_503() -> None:
    """After rank 1 is killed, /health answers 503 naming it and a release answers 503:
    nothing hangs."""
    with serving("--size", "1MB") as (_, client):
        pid = client.get("/state").json()["ranks"]["1"]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            health = client.get("/health")
            if health.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert health.status_code == 503 and "[1]" in health.json()["reason"]
        t0 = time.monotonic()
        r = client.post("/release_memory_occupation", json={})
        assert r.status_code == 503 and time.monotonic() - t0 < 30
