"""A real uvicorn server on 127.0.0.1 (an ephemeral port) in a thread of the test process,
serving a controller the test can look at; or ``residency serve --nproc N`` in a subprocess."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from lifecycle import LifecycleController
from lifecycle.http import Generate, create_app

ROOT = Path(__file__).resolve().parents[2]


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
    call runs on every rank) and a client on it, until the block ends (then killed)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "lifecycle", "serve", "--nproc", str(nproc), "--port", "0",
         "--device", "cpu", "--collective-timeout", "10", *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, **(env or {})}, start_new_session=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert found is not None and f"{nproc} ranks" in line, line
        with httpx.Client(base_url=f"http://127.0.0.1:{found.group(1)}", timeout=60) as client:
            yield proc, client
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
