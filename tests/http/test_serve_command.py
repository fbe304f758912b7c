"""``residency serve`` as users run it: a subprocess on 127.0.0.1, stopped by SIGTERM while a
slow generation is in flight."""

from __future__ import annotations

import concurrent.futures
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.service

ROOT = Path(__file__).resolve().parents[2]


def start(*args: str) -> tuple[subprocess.Popen[str], str]:
    """Start ``python -m lifecycle serve --port 0 ...``; returns it and its base URL."""
    proc = subprocess.Popen([sys.executable, "-m", "lifecycle", "serve", "--port", "0", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # "residency serve: http://127.0.0.1:PORT pipeline ...; ready"
    found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    if found is None:
        proc.kill()
        raise AssertionError(f"no address in {line!r}: {proc.communicate()[1][-2000:]}")
    return proc, f"http://127.0.0.1:{found.group(1)}"


def test_sigterm_drains_a_slow_generation_detaches_and_exits_0() -> None:
    """A generation in flight when SIGTERM comes finishes with 200, new connections are
    refused, and the process exits 0 after detaching."""
    proc, url = start("--pipeline", "tests.http.slow_pipeline:factory", "--drain-timeout", "10")
    try:
        with httpx.Client(base_url=url, timeout=30) as client, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            assert client.get("/health").status_code == 200
            slow = pool.submit(client.post, "/generate", json={"seed": 0, "delay": 1.5})
            time.sleep(0.5)
            proc.send_signal(signal.SIGTERM)
            r = slow.result()
            assert r.status_code == 200 and r.json()["shape"] == [1, 3, 32, 32]
        assert proc.wait(timeout=30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=2)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_serve_refuses_a_bad_pipeline_spec_with_exit_2() -> None:
    """A --pipeline that is neither demo nor MODULE:FACTORY is bad usage: exit 2, a message."""
    done = subprocess.run([sys.executable, "-m", "lifecycle", "serve", "--pipeline", "nope"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "MODULE:FACTORY" in done.stderr


def test_serve_places_the_pipeline_under_a_device_budget() -> None:
    """--device-budget plans the residency at start (printed on the ready line) and serves
    generations; a budget nothing fits exits 2 naming the smallest feasible one."""
    proc, url = start("--device-budget", "70%", "--size", "8MB")
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            r = client.post("/generate", json={"seed": 0})
            assert r.status_code == 200, r.text
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    done = subprocess.run([sys.executable, "-m", "lifecycle", "serve", "--port", "0",
                           "--device-budget", "1000"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "smallest feasible budget" in done.stderr
