"""Every wait is load-bearing: a mutation check of the CUDA layer on the simulated GPU.

Each mutant takes one wait, record or synchronization out of ``strategies/devices/_cuda.py`` (or
moves device allocation off the compute stream), and runs the CUDA layer's own suites on the
simulated GPU (``--device-layer=cuda-sim``) against it, stopping at the first failure. A mutant
no test fails ("survived") means that line's ordering is not checked by anything: the
simulator misses the race, or no test reaches it. The check fails for a survivor, and for a
mutant whose anchor no longer matches the source (the list below must follow the code)::

    python scripts/mutate_cuda.py              # every mutant, two at a time (a few minutes)
    python scripts/mutate_cuda.py --list       # the mutants
    python scripts/mutate_cuda.py enqueue-wait-compute drop-record-stream   # some of them

The unmutated code runs first on the same tests (they must pass, or every mutant would be
"killed" for nothing). A mutant's source is put in place by an import hook in the test
process (``strategies.devices._cuda`` loaded from the mutated text): the worktree is never changed.
It prints, per mutant, the test that killed it.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "strategies" / "devices" / "_cuda.py"
MODULE = "strategies.devices._cuda"

#: The tests each mutant runs (stopping at the first failure): the CUDA layer's own suites
#: (about 10 s on one core), not the whole cuda-sim pass, so that every mutant is killed by a
#: test written for what its line orders.
TESTS = ("tests/strategies/test_cuda_ordering.py", "tests/strategies/test_cuda_layer.py")
PYTEST = ("-x", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-k", "not trio",
          "--no-asyncio-debug", "--device-layer=cuda-sim")


@dataclass(frozen=True)
class Mutant:
    name: str
    what: str
    old: str  # must occur exactly once in the file
    new: str
    path: str = "strategies/devices/_cuda.py"

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")


MUTANTS = (
    Mutant("event-wait-compute", "the compute stream does not wait for a copy's event",
           "self._layer._rt.default_stream().wait_event(self._event)", "pass"),
    Mutant("event-wait-host", "wait_host does not wait on the host",
           "    def wait_host(self) -> None:\n        self._layer._host_wait(self._event)",
           "    def wait_host(self) -> None:\n        pass"),
    Mutant("drop-record-stream", "a dropped prefetch's buffers are not recorded on its stream",
           "            self._layer._record_on(t, self._stream)", "            pass"),
    Mutant("enqueue-wait-compute", "a copy does not wait for the compute stream",
           "            stream.wait_stream(self._default)\n"
           "            with self._rt.use_stream(stream):\n                try:",
           "            with self._rt.use_stream(stream):\n                try:"),
    Mutant("enqueue-record", "no event is recorded after a batch of copies",
           "                event = self._rt.event()\n                event.record(stream)",
           "                event = self._rt.event()"),
    Mutant("start-copy-fault-wait", "a failed batch is raised before its queued copies landed",
           "        if error is not None:\n            self._host_wait(event)\n            raise error",
           "        if error is not None:\n            raise error"),
    Mutant("copy-host-wait", "copy() returns before its copies landed",
           "            await to_thread(self._host_wait, event, limiter=self._limiter)",
           "            await anyio.lowlevel.checkpoint()"),
    Mutant("host-wait-sync", "a host wait does not synchronize on the event",
           "        with self._rt.use_device():\n            event.synchronize()",
           "        with self._rt.use_device():\n            pass"),
    Mutant("staged-wait-compute", "staged copies do not wait for the compute stream",
           "            for stream in self._streams.values():\n"
           "                stream.wait_stream(self._default)",
           "            for stream in self._streams.values():\n                pass"),
    Mutant("staged-drain", "a staged batch returns before its last copies landed",
           "                slots.drain()  # every copy", "                pass  # every copy"),
    Mutant("stage-in-later", "the copy into a strided target is not waited for",
           "            slots.later(stream, lambda: None, target)", "            pass"),
    Mutant("slots-put-record", "a staging slot's copy is not recorded",
           "        event = self._layer._rt.event()\n        event.record(stream)\n        self._pending",
           "        event = self._layer._rt.event()\n        self._pending"),
    Mutant("slots-later-record", "work queued outside the slots is not recorded",
           "        event = self._layer._rt.event()\n        event.record(stream)\n        self._later",
           "        event = self._layer._rt.event()\n        self._later"),
    Mutant("slots-finish-wait", "a staging slot is reused before its copy landed",
           "        if entry is not None:\n            self._layer._host_wait(entry[0])",
           "        if entry is not None:\n            pass"),
    Mutant("slots-drain-later-wait", "the host work after a strided copy runs before it landed",
           "        for event, then, _ in later:\n            self._layer._host_wait(event)",
           "        for event, then, _ in later:\n            pass"),
    Mutant("timed-copy-wait-compute", "a timed copy does not wait for the compute stream",
           "        stream.wait_stream(self._default)  # dst was allocated",
           "        pass  # dst was allocated"),
    Mutant("timed-copy-sync", "a timed copy's buffers are freed before it landed",
           "        end.synchronize()  # the host waits", "        pass  # the host waits"),
    Mutant("synchronize", "the layer's synchronize() does nothing",
           "        with self._rt.use_device():\n            self._rt.synchronize()",
           "        with self._rt.use_device():\n            pass"),
    Mutant("event-wait-current", "the current stream, not the compute stream, waits for a copy",
           "self._layer._rt.default_stream().wait_event(self._event)",
           "self._layer._rt.current_stream().wait_event(self._event)"),
    Mutant("stage-in-temporary-wait", "a staged copy's device temporary is not ordered after "
           "compute work queued since the batch's wait",
           "            # batch's wait: the copies into it are ordered after that work too.\n"
           "            stream.wait_stream(self._default)",
           "            # batch's wait: the copies into it are ordered after that work too.\n"
           "            pass"),
    Mutant("stage-out-temporary-wait", "a staged gather's device temporary is not ordered "
           "after compute work queued since the batch's wait",
           "            # the gather into it is ordered after that work too.\n"
           "            stream.wait_stream(self._default)",
           "            # the gather into it is ordered after that work too.\n            pass"),
    Mutant("stream-clear-error", "the error a failed stream creation left is not cleared",
           "        err = self._rt.clear_error()\n        self.own_streams = False",
           "        err = 2\n        self.own_streams = False"),
    Mutant("register-clear-error", "the error a failed registration left is not cleared",
           "        rt.clear_error()\n        del view", "        del view"),
    Mutant("destroy-recorded", "streams are destroyed while a buffer recorded on one lives",
           "            if not self.own_streams or self._recorded or not self._stream_map:",
           "            if not self.own_streams or not self._stream_map:"),
    Mutant("alloc-off-compute", "device buffers are allocated on the copy stream",
           "            with self._rt.use_device(), self._rt.use_stream(self._default):",
           "            with self._rt.use_device(), self._rt.use_stream(self._streams[\"device\"]):"),
)


#: Bugs in the callers of the device layer (the store, writes, layerwise, the controller's
#: gate): the ones a checking layer exists to catch. ``--compare`` runs each on the ordering
#: layer and on the simulated GPU, to tell whether the ordering pass finds anything the
#: cuda-sim pass does not (docs/development.md: it did not, so it was retired). Leaving out
#: ``store.for_compute(buf)`` is no bug to plant: it orders nothing on the CUDA and CPU layers
#: (the buffer was allocated on the compute stream), and the ordering layer only checks there.
PROTOCOL = (
    Mutant("store-complete-wait", "a fetched unit is used without compute waiting for it",
           "            self.handle.wait()\n        finally:", "            pass\n        finally:",
           "strategies/_store.py"),
    Mutant("store-evict-wait-host", "a dirty evict re-points at its mirror before the copy",
           'self.layer.start_copy(self._copy_out_pairs(unit), "host").wait_host()',
           'self.layer.start_copy(self._copy_out_pairs(unit), "host")', "strategies/_store.py"),
    Mutant("write-chunk-wait-host", "a write's chunk copied out is not waited for",
           'self.store.layer.start_copy(pairs, "host").wait_host()',
           'self.store.layer.start_copy(pairs, "host")', "strategies/_write.py"),
    Mutant("layerwise-drop", "an unused prefetch is forgotten, neither dropped nor waited for",
           "        if fetch is not None:\n            fetch.drop()\n            return",
           "        if fetch is not None:\n            return", "strategies/_layerwise.py"),
    Mutant("gate-synchronize", "a transition's gate does not synchronize the device",
           "                await to_thread(self.layer.synchronize, limiter=self.threads)",
           "                await anyio.lowlevel.checkpoint()", "lifecycle/_uses.py"),
)
#: The suites ``--compare`` runs (the ordering pass's kind: the store's and the controller's).
PROTOCOL_TESTS = ("tests/strategies/test_store.py", "tests/strategies/test_write.py",
                  "tests/modes/test_layerwise_streaming.py",
                  "tests/lifecycle/test_sleep_wake.py")


def mutated(mutant: Mutant, source: str) -> str:
    found = source.count(mutant.old)
    if found != 1:
        raise SystemExit(f"mutate_cuda: mutant {mutant.name!r}: its anchor occurs {found} times "
                         f"in {mutant.path} (must be once): update the list")
    return source.replace(mutant.old, mutant.new)


class _Loader(importlib.abc.Loader):
    def __init__(self, source: str) -> None:
        self.source = source

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        origin = module.__spec__.origin if module.__spec__ is not None else None
        exec(compile(self.source, origin or "<mutant>", "exec"), module.__dict__)


class _Finder(importlib.abc.MetaPathFinder):
    """Loads the mutant's module from its mutated source."""

    def __init__(self, mutant: Mutant) -> None:
        self.mutant = mutant
        self.source = mutated(mutant, (ROOT / mutant.path).read_text())

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.mutant.module:
            return None
        origin = str(ROOT / self.mutant.path)
        spec = importlib.util.spec_from_loader(fullname, _Loader(self.source), origin=origin)
        if spec is not None and fullname.count(".") == 1 and fullname.split(".")[1][0] != "_":
            spec.submodule_search_locations = []
        return spec


class _Killer:
    """A pytest plugin: the first test that failed (setup, call or teardown)."""

    def __init__(self) -> None:
        self.failed: str | None = None
        self.message = ""

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed and self.failed is None:
            self.failed = f"{report.nodeid} ({report.when})"
            crash = getattr(report.longrepr, "reprcrash", None)
            text = crash.message if crash is not None else str(report.longrepr)
            self.message = text.strip().splitlines()[0][:300] if text.strip() else ""


def run_one(name: str, layer: str, out: Path) -> int:
    """In a test process: run the tests against mutant ``name`` ("none": the code as it is)
    on device layer ``layer``."""
    import pytest

    mutant = next((m for m in (*MUTANTS, *PROTOCOL) if m.name == name), None)
    if mutant is not None:
        sys.meta_path.insert(0, _Finder(mutant))
    tests = TESTS if layer == "cuda-sim" and mutant not in PROTOCOL else PROTOCOL_TESTS
    args = [*PYTEST[:-1], f"--device-layer={layer}"]
    if tests is PROTOCOL_TESTS:
        args += ["-m", "moves"]
    killer = _Killer()
    code = pytest.main([*args, *tests], plugins=[killer])
    out.write_text(json.dumps({"code": int(code), "failed": killer.failed,
                               "message": killer.message}))
    return 0


def spawn(name: str, layer: str = "cuda-sim") -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mutate-cuda-") as tmp:
        out = Path(tmp) / "result.json"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "RESIDENCY_DEVICE_LAYER": "cpu"}
        start = time.monotonic()
        done = subprocess.run([sys.executable, __file__, "--run", name, layer, str(out)],
                              cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=900)
        if not out.exists():  # the run itself broke (not a test failing): never a kill
            raise SystemExit(f"mutate_cuda: mutant {name!r}: the test process failed "
                             f"(exit {done.returncode}):\n{done.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(out.read_text())
        result["seconds"] = round(time.monotonic() - start, 1)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mutants", nargs="*", help="names (default: every mutant)")
    parser.add_argument("--list", action="store_true", help="list the mutants")
    parser.add_argument("--jobs", type=int, default=2, help="test processes at once (2)")
    parser.add_argument("--compare", action="store_true",
                        help="the callers' bugs on the ordering layer and on the simulated GPU")
    parser.add_argument("--run", nargs=3, metavar=("MUTANT", "LAYER", "OUT"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run:
        return run_one(args.run[0], args.run[1], Path(args.run[2]))
    for m in (*MUTANTS, *PROTOCOL):
        mutated(m, (ROOT / m.path).read_text())  # every anchor matches, before anything runs
    if args.compare:
        return compare(args.jobs)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:26} {m.what}")
        return 0
    unknown = sorted(set(args.mutants) - {m.name for m in MUTANTS})
    if unknown:
        valid = ", ".join(m.name for m in MUTANTS)
        parser.error(f"unknown mutants {unknown}: valid are {valid}")
    chosen = [m for m in MUTANTS if not args.mutants or m.name in args.mutants]
    base = spawn("none")
    if base["code"] != 0:
        print(f"mutate_cuda: the unmutated code fails {base['failed']}: {base['message']}",
              file=sys.stderr)
        return 2
    print(f"unmutated: passes ({base['seconds']} s)", flush=True)
    survivors = []
    with ThreadPoolExecutor(max_workers=max(1, min(args.jobs, 2))) as pool:
        for m, result in zip(chosen, pool.map(lambda m: spawn(m.name), chosen), strict=True):
            if result["code"] == 0:
                survivors.append(m.name)
                print(f"SURVIVED {m.name:26} {m.what}", flush=True)
            else:
                print(f"killed   {m.name:26} by {result['failed']} ({result['seconds']} s)\n"
                      f"         {result['message']}", flush=True)
    if survivors:
        print(f"mutate_cuda: {len(survivors)} of {len(chosen)} mutants survived: "
              f"{', '.join(survivors)}", file=sys.stderr)
        return 1
    print(f"mutate_cuda: all {len(chosen)} mutants killed")
    return 0


def compare(jobs: int) -> int:
    """Each of :data:`PROTOCOL` on both checking layers: which one fails the suites."""
    runs = [(m, layer) for m in PROTOCOL for layer in ("ordering", "cuda-sim")]
    for layer in ("ordering", "cuda-sim"):
        base = spawn("none", layer)
        if base["code"] != 0:
            print(f"mutate_cuda: unmutated, {layer} fails {base['failed']}", file=sys.stderr)
            return 2
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, 2))) as pool:
        results = list(pool.map(lambda r: spawn(r[0].name, r[1]), runs))
    for (m, layer), result in zip(runs, results, strict=True):
        verdict = f"killed by {result['failed']}" if result["code"] else "SURVIVED"
        print(f"{m.name:24} {layer:9} {verdict} ({result['seconds']} s)\n"
              f"{'':34} {result['message']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
