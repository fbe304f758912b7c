"""The GPU tests (marked ``cuda``): one suite, two machines.

* In CI, ``--device-layer=cuda-sim``: the CUDA layer's own code (``CudaDevice``) over a
  simulated GPU, at a few megabytes. What is asserted there means something there: exact
  outputs and weights, ordering (the simulator raises on any race), and memory accounting
  through the simulated caching allocator (``layer.runtime.memory()``,
  ``report().reserved_peak_bytes``), which holds a library workspace per thread and stream
  as a GPU's holds cuBLAS's (compare after warming the threads). Timings are recorded, never
  asserted.
* On a GPU, ``--gpu`` (``scripts/gpu_run.py``, ``scripts/test --gpu``): the real layer at
  gigabytes, and the bandwidth and latency targets are asserted too.

tests/conftest.py skips these tests without a CUDA layer and makes the layers (``cuda_layer``).
This file adds:

* ``gpu``: the run's kind (real or simulated), device and the sizes each test uses
  (``RESIDENCY_GPU_MAX_SIZE``, e.g. ``2GiB``, caps the real GPU's sizes for a short run);
* ``record``: numbers a test records (GB/s, ratios, memory) and its targets
  (``record.target``: recorded always, asserted on the real GPU only);
* ``faulty_cuda_layer``: ``FaultyCudaDevice`` layers for the same GPU (closed after);
* ``--gpu-json PATH``: every test's status, seconds, numbers and targets in one JSON document,
  rewritten at each test's start and end (a run cut short leaves what it did, and names the
  test that was running);
* ``--gpu-budget SECONDS``: a test not started when the budget is spent (counted from the
  session's start) is skipped, and reported as ``budget_skipped`` (not passed);
* the tests run in order of importance (correctness first: ``ORDER``), on asyncio only (the
  device layer's ordering does not depend on the event loop, and a GPU's minutes are few).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
import torch

from lifecycle.demo import parse_size
from lifecycle.testing import FaultyCudaDevice, SimCuda
from scripts.gpu_run import strict_json
from strategies import CudaDevice
from strategies.checking import checking_sim
from tests.gpu.helpers import REAL, SIMULATED, GpuRun, Recorder, Sizes

HERE = Path(__file__).resolve().parent
# Modules in the order they run (correctness first; the bandwidth figures last).
ORDER = ("test_gpu_device.py", "test_gpu_updates.py", "test_gpu_ordering.py", "test_gpu_sleep_wake.py",
         "test_gpu_layerwise.py", "test_gpu_planner.py", "test_gpu_concurrency.py", "test_gpu_link.py")


# -- results ------------------------------------------------------------------------------

class Results:
    """Every test's entry of this session, and the JSON document (``--gpu-json``)."""

    def __init__(self, config: pytest.Config) -> None:
        self.t0 = time.monotonic()
        self.path = config.getoption("--gpu-json")
        self.budget: float | None = config.getoption("--gpu-budget")
        self.real = bool(config.getoption("--gpu"))
        self.targets = str(config.getoption("--gpu-targets"))
        self.layer_streams: dict[str, Any] | None = None  # the ``gpu`` fixture's look
        self.tests: dict[str, dict[str, Any]] = {}
        self.running: str | None = None
        self.finished = False

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def entry(self, nodeid: str) -> dict[str, Any]:
        if nodeid not in self.tests:
            self.tests[nodeid] = {"status": "running", "seconds": 0.0, "numbers": {},
                                  "targets": {}}
        return self.tests[nodeid]

    def document(self) -> dict[str, Any]:
        real = self.real and torch.cuda.is_available()
        statuses = {n: e["status"] for n, e in self.tests.items()}
        doc: dict[str, Any] = strict_json({
            "tool": "tests/gpu", "kind": "real" if real else "simulated",
            "device": torch.cuda.get_device_name() if real else "simulated GPU (SimCuda)",
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(), "budget_seconds": self.budget,
            "seconds": self.elapsed(), "finished": self.finished, "running": self.running,
            "sizes": asdict(sizes_for(real)), "targets": self.targets if real else "record",
            "layer_streams": self.layer_streams, "tests": self.tests,
            "summary": {
                "passed": [n for n, s in statuses.items() if s == "pass"],
                "failed": [n for n, s in statuses.items() if s in ("fail", "error")],
                "skipped": [n for n, s in statuses.items() if s == "skip"],
                "budget_skipped": [n for n, e in self.tests.items() if e.get("budget_skipped")]},
        })
        return doc

    def write(self) -> None:
        if not self.path:
            return
        path = Path(self.path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.partial")
        tmp.write_text(json.dumps(self.document(), indent=2, allow_nan=False) + "\n")
        tmp.replace(path)


_RESULTS = pytest.StashKey[Results]()


def sizes_for(real: bool) -> Sizes:
    if not real:
        return SIMULATED
    cap = os.environ.get("RESIDENCY_GPU_MAX_SIZE")
    return REAL.capped(parse_size(cap)) if cap else REAL


_session: list[Results] = []  # this session's results (hooks given only a report read it)


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_RESULTS] = results = Results(config)
    _session.append(results)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """This directory's tests in ``ORDER`` (correctness first), in the slots they had."""
    slots = [i for i, item in enumerate(items) if Path(item.path).parent == HERE]
    rank = {name: i for i, name in enumerate(ORDER)}
    ordered = sorted((items[i] for i in slots), key=lambda it: rank.get(Path(it.path).name,
                                                                       len(ORDER)))
    for i, item in zip(slots, ordered, strict=True):
        items[i] = item


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Open the test's entry; skip it when the budget is spent."""
    results = item.config.stash[_RESULTS]
    entry = results.entry(item.nodeid)
    results.running = item.nodeid
    results.write()
    if results.budget is not None and results.elapsed() >= results.budget:
        entry["budget_skipped"] = True
        pytest.skip(f"budget: the GPU tests' budget of {results.budget:.0f} s was spent "
                    f"({results.elapsed():.0f} s) before this test started")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A phase's outcome into the test's entry (a teardown error fails a passed test)."""
    results = _session[-1] if _session else None
    if results is None:
        return
    entry = results.entry(report.nodeid)
    entry["seconds"] = float(entry["seconds"]) + report.duration
    if report.skipped:
        entry["status"] = "skip"
        longrepr = report.longrepr
        reason = str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)
        entry["reason"] = reason.removeprefix("Skipped: ")
    elif report.failed:
        entry["status"] = "fail" if report.when == "call" or entry["status"] == "pass" \
            else "error"
        crash = getattr(report.longrepr, "reprcrash", None)
        message = getattr(crash, "message", None) or report.longreprtext[-600:]
        entry["error"] = f"{report.when}: {message}"[:1500]
        entry["traceback"] = report.longreprtext[-3000:]
    elif report.when == "call":
        entry["status"] = "pass"
    if report.when == "teardown":
        if entry["status"] == "running":  # passed setup and teardown with no call report
            entry["status"] = "pass"
        results.running = None
        results.write()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    results = session.config.stash.get(_RESULTS, None)
    if results is not None and results.tests:
        results.finished = True
        results.running = None
        results.write()


# -- fixtures -------------------------------------------------------------------------------

@pytest.fixture(params=[pytest.param("asyncio", id="asyncio")])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    """Asyncio only here (see the module doc); in debug mode unless ``--no-asyncio-debug``."""
    return "asyncio", {} if request.config.getoption("--no-asyncio-debug") else {"debug": True}


def streams_of(layer: CudaDevice, real: bool) -> dict[str, Any]:
    """What a layer's copy streams are: its own (created with a priority through the CUDA
    runtime, which torch sees as an ``ExternalStream``) or, the fallback, torch's pool's."""
    return {tier: {"type": type(stream).__name__,
                   "own": isinstance(stream, torch.cuda.ExternalStream) if real else None,
                   "priority": getattr(stream, "priority", None)}
            for tier, stream in layer.streams.items()}


@pytest.fixture(scope="session")
def gpu(pytestconfig: pytest.Config) -> GpuRun:
    """The kind of CUDA layer this session runs on, and the sizes its tests use; the JSON
    says what the layer's streams are (a layer made and closed here)."""
    real = bool(pytestconfig.getoption("--gpu"))
    if real:
        device = torch.device("cuda", torch.cuda.current_device())
        run = GpuRun(True, device, torch.cuda.get_device_name(device), sizes_for(True))
        layer = CudaDevice(device)
    else:
        run = GpuRun(False, torch.device("cpu"), "simulated GPU (SimCuda)", sizes_for(False))
        layer = CudaDevice(run.device, SimCuda(seed=0))  # (not a test's: no seed taken)
    try:
        pytestconfig.stash[_RESULTS].layer_streams = streams_of(layer, real)
    finally:
        layer.close()
    return run


@pytest.fixture
def record(request: pytest.FixtureRequest, gpu: GpuRun) -> Recorder:
    """Numbers and targets of this test, into the session's JSON (``--gpu-json``)."""
    results = request.config.stash[_RESULTS]
    return Recorder(results.entry(request.node.nodeid), gpu.real,
                    assert_targets=request.config.getoption("--gpu-targets") == "assert")


@pytest.fixture
def faulty_cuda_layer(gpu: GpuRun) -> Iterator[Callable[..., FaultyCudaDevice]]:
    """Makes ``FaultyCudaDevice`` layers (``faulty_cuda_layer(**faults)``) on this run's GPU,
    real or simulated; every layer made is closed after."""
    made: list[FaultyCudaDevice] = []

    def make(**faults: Any) -> FaultyCudaDevice:
        if gpu.real:
            layer = FaultyCudaDevice(gpu.device, **faults)
        else:
            layer = FaultyCudaDevice(gpu.device, checking_sim(), **faults)
        made.append(layer)
        return layer

    yield make
    for layer in made:
        layer.close()


@pytest.fixture(autouse=True)
def _fresh_device(gpu: GpuRun) -> Iterator[None]:
    """On a GPU, each test starts with nothing cached by the one before (the allocator and
    its peaks are the process's). On the simulated GPU, compute runs on one intra-op thread:
    the host's worker threads (copies, landings) share a small CPU, where OpenMP's barriers
    stall (the simulator is new in every layer: nothing to clean)."""
    threads = torch.get_num_threads()
    if gpu.real:
        gc.collect()
        torch.cuda.synchronize(gpu.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(gpu.device)
    else:
        torch.set_num_threads(1)
    yield
    if gpu.real:
        gc.collect()
        torch.cuda.synchronize(gpu.device)
        torch.cuda.empty_cache()
    else:
        torch.set_num_threads(threads)
