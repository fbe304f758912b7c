"""Every async test runs on asyncio (debug mode: flags torch work blocking the loop) and trio.

``--device-layer`` picks the layer every controller and store that makes its own CPU layer
gets, and the fault-injecting layer ``tests.helpers.faulty_device`` makes (with the test
layers derived from ``tests.helpers.SelectedFaultyDevice``): it sets ``RESIDENCY_DEVICE_LAYER``
before the tests are imported, which selects both (see ``lifecycle.testing``), and the
programs tests start get it too:

* ``ordering``: the ordering layer (``lifecycle.testing.OrderingDevice``, and
  ``OrderingFaultyDevice``): copies land late, only when waited for, poison (NaN) until then,
  and any ordering mistake of the CUDA path is reported;
* ``cuda-sim``: the CUDA layer itself (``CudaDevice``, and ``FaultyCudaDevice``) over a
  simulated GPU (``lifecycle.testing.SimCuda``): streams that land late, a lagging compute
  stream, torch's allocator rules, pinned registration, poison.

Whatever the option, a test fails at teardown if a checking layer recorded a violation during
it (even one the code under test swallowed) or holds a copy nobody waited for.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import structlog
import torch

from lifecycle.testing import (
    DEVICE_LAYER_ENV,
    LAYER_KINDS,
    check_cuda_sim,
    check_ordering,
    seed_layers,
)
from strategies import CudaDevice
from strategies.checking import checking_sim
from strategies.devices._device import Worker

# seconds: each copy lands up to this late (the ordering layers' default: keeps the pass fast)
ORDERING_MAX_DELAY = 0.002
_env_before = os.environ.get(DEVICE_LAYER_ENV)  # restored at the end of the session


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device-layer", choices=LAYER_KINDS, default="cpu",
                     help="the CPU device layer tests run on: 'ordering' lands copies late "
                          "and reports ordering mistakes of the CUDA path; 'cuda-sim' runs the "
                          "CUDA layer itself on a simulated GPU (see tests/conftest.py)")
    parser.addoption("--ordering-seed", type=int, default=0,
                     help="seed of the checking layers' copy delays (mixed with each test's id)")
    parser.addoption("--no-asyncio-debug", action="store_true",
                     help="run asyncio without its debug mode (see anyio_backend)")
    parser.addoption("--gpu", action="store_true",
                     help="run the tests marked cuda (tests/gpu) on the real GPU (scripts/test --gpu)")
    parser.addoption("--gpu-json", default=None,
                     help="write what the tests marked cuda record (results, bandwidths) as JSON")
    parser.addoption("--gpu-budget", type=float, default=None,
                     help="seconds for the tests marked cuda; those left when spent are skipped")
    parser.addoption("--gpu-targets", choices=("assert", "record"), default="assert",
                     help="on the real GPU, fail a test whose bandwidth or latency target is "
                          "missed (assert), or record it only (record: scripts/gpu_run.py's "
                          "default); correctness is asserted either way")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` run on a CUDA layer: the real GPU with ``--gpu``, a simulated one
    under ``--device-layer=cuda-sim``; anywhere else they are skipped."""
    if config.getoption("--gpu"):
        if torch.cuda.is_available():
            return
        reason = "--gpu given, but CUDA is not available"
    elif config.getoption("--device-layer") == "cuda-sim":
        return
    else:
        reason = "needs a CUDA layer: --gpu (a GPU) or --device-layer=cuda-sim"
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def cuda_layer(request: pytest.FixtureRequest) -> Iterator[Callable[..., CudaDevice]]:
    """Makes ``CudaDevice`` layers (``cuda_layer(**sim)``): on the real GPU with ``--gpu``,
    over a simulated GPU (``SimCuda(**sim)``, with the checking layers' per-thread library
    workspace unless ``sim`` names one) otherwise; every layer made is closed after."""
    made: list[CudaDevice] = []
    real = bool(request.config.getoption("--gpu"))

    def make(**sim: Any) -> CudaDevice:
        if real:
            layer = CudaDevice(torch.device("cuda", torch.cuda.current_device()))
        else:
            layer = CudaDevice(torch.device("cpu"), checking_sim(**sim))
        made.append(layer)
        return layer

    yield make
    for layer in made:
        layer.close()


def pytest_configure(config: pytest.Config) -> None:
    kind = config.getoption("--device-layer")
    if kind != "cpu":
        # Before collection: tests.helpers derives SelectedFaultyDevice, the base of the
        # tests' own layers, from the variable when the test modules import it. Every layer
        # the library makes for a CPU device (controllers, strategies), and the programs the
        # tests start (`residency serve`, drills, rank workers), use it too.
        os.environ[DEVICE_LAYER_ENV] = kind


def pytest_unconfigure(config: pytest.Config) -> None:
    if _env_before is None:
        os.environ.pop(DEVICE_LAYER_ENV, None)
    else:
        os.environ[DEVICE_LAYER_ENV] = _env_before


def pytest_report_header(config: pytest.Config) -> str | None:
    kind = config.getoption("--device-layer")
    seed = config.getoption("--ordering-seed")
    if kind == "ordering":
        return (f"device layer: ordering (seed {seed}, copies land up to "
                f"{ORDERING_MAX_DELAY * 1e3:g} ms late, when waited for)")
    if kind == "cuda-sim":
        return f"device layer: CudaDevice on a simulated GPU (seed {seed})"
    return None


@pytest.fixture(autouse=True)
def _ordering_checks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Seeds the checking layers made in this test; at teardown, fails the test for every
    violation they recorded (raised and swallowed, or only recorded by a finalizer) and
    every copy still in flight that nobody waited for."""
    seed_layers(zlib.crc32(request.node.nodeid.encode()) ^ request.config.getoption(
        "--ordering-seed"))
    yield
    # A controller the test left attached (a module's server) may still refresh mirrors in
    # the background: the refresh waits for its own copies, so it finishes first.
    Worker.drain("residency-refresh")
    found = {"ordering": check_ordering(), "cuda-sim": check_cuda_sim()}
    if any(found.values()):
        pytest.fail("\n".join(f"{layer} violations:\n- " + "\n- ".join(problems)
                              for layer, problems in found.items() if problems), pytrace=False)


@pytest.fixture(params=[pytest.param(("asyncio", {"debug": True}), id="asyncio"),
                        pytest.param(("trio", {}), id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    """Both loops; asyncio in debug mode (it flags callbacks that block the loop), except with
    ``--no-asyncio-debug`` (the checking passes: their layers check ordering, not the loop, and
    debug mode's stack captures at every callback cost them a third of their time)."""
    name, options = request.param
    if name == "asyncio" and request.config.getoption("--no-asyncio-debug"):
        options = {}
    return name, options


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()


#: How long a worker thread pauses after handing back, under ``slow_handback``.
HANDBACK_PAUSE_S = 0.01


@pytest.fixture
def slow_handback(monkeypatch: pytest.MonkeyPatch) -> float:
    """Every worker thread pauses right after it hands a result back, to the event loop
    (asyncio's ``call_soon_threadsafe``, trio's ``run_sync_soon``) or to a future
    (``set_result``, ``set_exception``), before it drops its own references: what a loaded
    machine does to it now and then, here every time. Returns the pause (seconds)."""
    main = threading.main_thread()

    def pausing(original: Callable[..., Any]) -> Callable[..., Any]:
        def handback(*args: Any, **kwargs: Any) -> Any:
            out = original(*args, **kwargs)
            if threading.current_thread() is not main:
                time.sleep(HANDBACK_PAUSE_S)
            return out
        return handback

    # (trio imported here: the GPU run's image has no trio, and loads this file too)
    import trio

    for owner, name in [(asyncio.BaseEventLoop, "call_soon_threadsafe"),
                        (trio.lowlevel.TrioToken, "run_sync_soon"),
                        (concurrent.futures.Future, "set_result"),
                        (concurrent.futures.Future, "set_exception")]:
        monkeypatch.setattr(owner, name, pausing(getattr(owner, name)))
    return HANDBACK_PAUSE_S
