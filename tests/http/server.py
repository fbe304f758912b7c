"""A real uvicorn server on 127.0.0.1 (an ephemeral port) in a thread of the test process,
serving a controller the test can look at; or ``residency serve --nproc N`` in a subprocess,
stopped as users stop it and checked for what the checking device layers report at exit."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from lifecycle import LifecycleController
from lifecycle.http import Generate, create_app

ROOT = Path(__file__).resolve().parents[2]

#: What the checking device layers (``RESIDENCY_DEVICE_LAYER=ordering`` / ``cuda-sim``) print on
#: stderr as a program exits with violations nobody reported (strategies.checking._ordering,
#: strategies.checking._cudasim): a served rank's violation fails the test that started it.
VIOLATION_MARKERS = ("residency: cuda-sim violations:", "residency: ordering violations:")
# Seconds a server has to stop after SIGTERM (drain, detach on every rank) before SIGKILL.
STOP_TIMEOUT = 60.0


@dataclass
class Served:
    """What a test gets: the base URL, a client on it, the controller and its pipeline."""

    url: str
    client: httpx.Client
    ctl: LifecycleController
    pipe: Any


@contextmanager
def running_server(pipe: Any, generate: Generate | None, ctl: LifecycleController,
                   **app_options: Any) -> Iterator[Served]:
    """Serve ``pipe`` under ``ctl`` until the block ends (attached at startup, detached at
    shutdown, as ``residency serve`` does)."""

    async def startup() -> None:
        await ctl.attach(pipe)

    app = create_app(ctl, generate=generate, on_startup=startup, on_shutdown=ctl.aclose,
                     **app_options)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # TCP_NODELAY
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=url, timeout=30) as client:
            yield Served(url, client, ctl, pipe)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextmanager
def serving_ranks(*args: str, nproc: int = 2, env: dict[str, str] | None = None
                  ) -> Iterator[tuple[subprocess.Popen[str], httpx.Client]]:
    """``python -m lifecycle serve --nproc N --port 0 ARGS...`` (rank 0 serves HTTP, every
    call runs on every rank) and a client on it, until the block ends. Then it is stopped as
    users stop it (SIGTERM to the launcher, which has rank 0 drain and stop every rank; SIGKILL
    to the whole process group only after :data:`STOP_TIMEOUT`), and the test fails if the
    ranks' stderr holds a checking layer's violation report (see :data:`VIOLATION_MARKERS`)."""
    # A file, not a pipe (nobody reads a pipe while the test runs: it would fill), opened to
    # append: the ranks write at its end whatever this process reads meanwhile.
    with tempfile.TemporaryFile("a+", prefix="residency-serve-stderr-") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "lifecycle", "serve", "--nproc", str(nproc), "--port", "0",
             "--device", "cpu", "--collective-timeout", "10", *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr, text=True,
            env={**os.environ, **(env or {})}, start_new_session=True)
        failed = True
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
            assert found is not None and f"{nproc} ranks" in line, (line, _tail(stderr))
            with httpx.Client(base_url=f"http://127.0.0.1:{found.group(1)}", timeout=60) as client:
                _until_listening(client, proc, stderr)
                yield proc, client
            failed = False
        finally:
            stop(proc)
            reports = violations(stderr)
            if reports and failed:  # the test's own failure goes on: show these beside it
                print(reports, file=sys.stderr)
            elif reports:
                pytest.fail(f"a served rank reported violations at exit:\n{reports}",
                            pytrace=False)


def _until_listening(client: httpx.Client, proc: subprocess.Popen[str], stderr: Any,
                     timeout: float = 30.0) -> None:
    """Wait until the server accepts connections (its line can come before its socket
    listens on a loaded machine); fails with the ranks' stderr if it exits or never does."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.get("/health")
            return
        except httpx.ConnectError:
            assert proc.poll() is None and time.monotonic() < deadline, _tail(stderr)
            time.sleep(0.1)


def stop(proc: subprocess.Popen[str], timeout: float = STOP_TIMEOUT) -> None:
    """Stop ``residency serve`` (started in a session of its own) the way ``residency serve``
    stops: SIGTERM to the launcher, which forwards it to rank 0, which drains and stops the
    other ranks (a signal to every rank at once would kill the followers outright, before
    they detach or report). SIGKILL to the process group if that takes over ``timeout``
    seconds, or for the ranks left once the launcher is gone."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        with suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=timeout)
    with suppress(ProcessLookupError):  # anything of the group still alive (a launcher
        os.killpg(proc.pid, signal.SIGKILL)  # that hung, an orphaned rank)
    proc.communicate()


def violations(stderr: Any) -> str:
    """The violation reports (each marker line and the ``- ...`` lines after it) in the
    stderr file ``stderr``, or ""."""
    stderr.flush()
    stderr.seek(0)
    lines = stderr.read().splitlines()
    out: list[str] = []
    for i, line in enumerate(lines):
        if any(marker in line for marker in VIOLATION_MARKERS):
            out.append(line)
            for follow in lines[i + 1:]:
                if not follow.startswith("- "):
                    break
                out.append(follow)
    return "\n".join(out)


def _tail(stderr: Any, chars: int = 4000) -> str:
    stderr.flush()
    stderr.seek(0)
    return str(stderr.read()[-chars:])
