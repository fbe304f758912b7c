"""The GPU run: the GPU tests (tests/gpu) on the real GPU, then the benchmarks, in one budgeted
command, with one JSON document and a table of results and bandwidths.

    python scripts/gpu_run.py [--budget 480] [--tests-budget 270] [--out DIR] [-k EXPR]
        [--max-size SIZE] [--skip-bench] [--bench NAME ...] [--bench-budget NAME=SECONDS ...]
        [--assert-targets] [--wheels DIR]
    scripts/test --gpu [the same arguments]          (the same, before .venv is looked at)

    python scripts/gpu_run.py --dry-run              # no GPU needed (about a minute)

Runs from a fresh checkout, offline, with any Python that has the dependencies (a GPU image's
own python3): the wheels in ``--wheels DIR`` (default .whl, filled by scripts/gpu_wheels.sh)
are installed first, ``--no-index --no-deps``, into a scratch directory put on the path; then
the versions of ``NEEDS`` are checked against pyproject.toml (``importlib.metadata``) and the
environment recorded (:func:`environment`). The repository root goes on the path of
everything it starts.

1. ``pytest tests/gpu --gpu --gpu-json OUT/gpu_tests.json --gpu-budget TESTS_BUDGET`` in a
   subprocess (:func:`pytest_command`: no plugin autoloaded, a fault-handler timeout):
   correctness first, big sizes, bandwidth and latency targets recorded (asserted with
   ``--assert-targets``; see tests/gpu/conftest.py). A test not started when the tests'
   budget is spent is skipped and reported as ``budget_skipped``; a test still running when
   the run's time runs out is killed and fails.
2. The benchmarks, each in a subprocess with its own budget, while the time left allows:
   ``python -m lifecycle bench sleep-wake|update|residency --device cuda --json`` (residency
   twice: ``--compute-heavy``, then the default sizes). One whose budget exceeds the time
   left is skipped (neither passed nor failed); one running past its budget is killed and
   fails; a missed timing target is recorded (``summary.targets_missed``), a failure only
   with ``--assert-targets``.
3. ``gpu_run.json`` (in ``--out DIR``, default ``$OUT``; none when neither is set), written
   after each step and whatever happens, and the table on stdout.

``--dry-run`` runs the same on a machine without a GPU: the tests on the simulated GPU
(``--device-layer=cuda-sim``), the benchmarks on the CPU at tiny sizes (their timing targets
recorded). CI runs it (tests/test_gpu_run.py).

Exit status 0 when every test passed and no benchmark failed; 1 when a test failed, was
skipped for the budget (the run is incomplete) or none ran, a benchmark failed, the Python
lacks what the run needs, or the run was cut short. A watchdog writes the JSON and exits 1 if
anything hangs past the budget.
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The benchmarks in the order they run, and the ``residency bench`` command of each.
BENCHES: tuple[str, ...] = ("bench_sleep_wake", "bench_update", "bench_residency_compute",
                            "bench_residency")
BENCH_COMMANDS = {"bench_sleep_wake": "sleep-wake", "bench_update": "update",
                  "bench_residency_compute": "residency", "bench_residency": "residency"}
# Each benchmark's own time budget in seconds (its subprocess timeout): on a GPU, dry run.
BENCH_BUDGETS: dict[str, dict[str, float]] = {
    "gpu": {"bench_sleep_wake": 90.0, "bench_update": 70.0, "bench_residency_compute": 45.0,
            "bench_residency": 45.0},
    "dry-run": {"bench_sleep_wake": 60.0, "bench_update": 60.0, "bench_residency_compute": 60.0,
                "bench_residency": 60.0},
}
BENCH_ARGS: dict[str, dict[str, list[str]]] = {
    "gpu": {"bench_sleep_wake": ["--size", "2GiB", "--repeats", "3"],
            "bench_update": ["--size", "1GiB", "--repeats", "3"],
            # 12 layers x 2048 x 8192 tokens, bf16: where the layerwise target applies.
            "bench_residency_compute": ["--compute-heavy", "--repeats", "3"],
            "bench_residency": ["--repeats", "5"]},
    "dry-run": {"bench_sleep_wake": ["--size", "1MB", "--repeats", "1"],
                "bench_update": ["--size", "1MB", "--repeats", "1"],
                "bench_residency_compute": ["--compute-heavy", "--layers", "2", "--width", "64",
                                            "--tokens", "32", "--repeats", "1"],
                "bench_residency": ["--layers", "2", "--width", "64", "--tokens", "16",
                                    "--repeats", "1"]},
}
RESIDENCY_FWD_TARGET = 1.15  # the residency benchmark's layerwise forward ratio target
GRACE = 15.0  # seconds past the budget before the watchdog cuts the run short


# -- results -------------------------------------------------------------------------------

def strict_json(value: Any) -> Any:
    """``value`` as strict JSON: non-finite floats become null, floats are rounded."""
    if isinstance(value, float):
        return round(value, 6) if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    if value is None or isinstance(value, bool | int | str):
        return value
    return str(value)


def say(text: str) -> None:
    """Print and flush; a closed stdout (``| head``) never stops the run."""
    with contextlib.suppress(OSError, ValueError):
        print(text, flush=True)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def short_name(nodeid: str) -> str:
    """``tests/gpu/test_gpu_sleep_wake.py::test_x[asyncio-a]`` -> ``sleep_wake::x[a]``."""
    path, _, name = nodeid.partition("::")
    module = Path(path).stem.removeprefix("test_").removeprefix("gpu_")
    name = name.removeprefix("test_").replace("[asyncio-", "[").replace("[asyncio]", "")
    return f"{module}::{name}"


class Run:
    """The run's outcome so far: the tests' results, the benchmarks', the JSON document."""

    def __init__(self, args: argparse.Namespace, out: Path | None) -> None:
        self.t0 = time.monotonic()
        self.args = args
        self.out = out
        self.lock = threading.RLock()  # reentrant: the SIGTERM handler may interrupt a holder
        self.meta: dict[str, Any] = {}
        self.tests: dict[str, dict[str, Any]] = {}
        self.tests_run: dict[str, Any] = {}
        self.benches: dict[str, dict[str, Any]] = {}
        self.running: str | None = None
        self.child: subprocess.Popen[bytes] | subprocess.Popen[str] | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def remaining(self) -> float:
        return float(self.args.budget) - self.elapsed()

    def document(self, aborted: str | None = None) -> dict[str, Any]:
        with self.lock:
            tests = {n: dict(e) for n, e in self.tests.items()}
            benches = {n: dict(self.benches.get(n) or (
                {"status": "fail", "pass": False, "error": aborted} if aborted else
                {"status": "skip", "pass": None, "reason": "not run"})) for n in BENCHES}
        everything = {**tests, **benches}
        failed = [n for n, e in everything.items() if e["status"] in ("fail", "error")]
        budget_skipped = [n for n, e in tests.items() if e.get("budget_skipped")]
        passed_tests = [n for n, e in tests.items() if e["status"] == "pass"]
        problems = [*failed, *budget_skipped]
        if not passed_tests:
            problems.append("no test passed")
        # Timing targets missed: failures under --assert-targets (the tests failed and the
        # benchmarks' failures name them), else recorded here, the run still correct.
        missed = [f"{n}: {k} = {t.get('value')}" for n, e in tests.items()
                  for k, t in (e.get("targets") or {}).items() if t.get("pass") is False]
        missed += [f"{n}: {m}" for n, e in benches.items() for m in e.get("targets_missed") or ()]
        doc: dict[str, Any] = strict_json({
            "tool": "scripts/gpu_run.py", **self.meta, "ok": not problems and aborted is None,
            "aborted": aborted, "seconds": self.elapsed(), "budget_seconds": self.args.budget,
            "tests_budget_seconds": self.args.tests_budget, "tests_run": self.tests_run,
            "tests": tests, "benchmarks": benches,
            "summary": {"passed": [n for n, e in everything.items() if e["status"] == "pass"],
                        "failed": failed, "budget_skipped": budget_skipped,
                        "skipped": [n for n, e in everything.items() if e["status"] == "skip"],
                        "targets_missed": missed,
                        "targets_asserted": self.args.assert_targets and not self.args.dry_run,
                        "problems": problems}})
        return doc

    def write(self, aborted: str | None = None) -> dict[str, Any]:
        doc = self.document(aborted)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
            tmp = self.out / ".gpu_run.json.partial"
            tmp.write_text(json.dumps(doc, indent=2, allow_nan=False) + "\n")
            tmp.replace(self.out / "gpu_run.json")
        return doc


def _headline(entry: dict[str, Any], limit: int = 6) -> str:
    """A few scalar numbers of a result, then its targets."""
    numbers = [(k, v) for k, v in (entry.get("numbers") or {}).items()
               if v is None or isinstance(v, bool | int | float | str)]
    text = ", ".join(f"{k}={_fmt(v)}" for k, v in numbers[:limit])
    targets = entry.get("targets") or {}
    if targets:
        text += ("; " if text else "") + "targets: " + ", ".join(
            f"{k}={_fmt(t.get('value'))}"
            f"{'>=' + _fmt(t['at_least']) if t.get('at_least') is not None else ''}"
            f"{'<=' + _fmt(t['at_most']) if t.get('at_most') is not None else ''}"
            f" {'ok' if t.get('pass') else 'MISSED'}{'' if t.get('asserted') else ' (recorded)'}"
            for k, t in targets.items())
    return text


def print_table(doc: dict[str, Any]) -> None:
    rows = [*doc["tests"].items(), *doc["benchmarks"].items()]
    say(f"\n{'result':<6}  {'seconds':>8}  test / benchmark")
    for name, e in rows:
        status = "SKIP*" if e.get("budget_skipped") else str(e["status"]).upper()
        say(f"{status:<6}  {e.get('seconds') or 0:>8.2f}  {name}")
        why = e.get("error") or e.get("reason")
        detail = _headline(e)
        if why:
            say(f"{'':<18}[{str(why).splitlines()[0][:160]}]")
        if detail:
            say(f"{'':<18}{detail[:400]}")
    s = doc["summary"]
    if s["targets_missed"]:
        say(f"\ntargets missed ({'asserted' if s['targets_asserted'] else 'recorded, not asserted'}"
            + ("; a dry run: the simulated GPU's and the CPU's timings" if doc.get("mode") == "dry-run"
               else "") + "):")
        for line in s["targets_missed"]:
            say(f"  {line[:200]}")
    say(f"\n{len(s['passed'])} passed, {len(s['failed'])} failed, {len(s['skipped'])} skipped "
        f"({len(s['budget_skipped'])} for the budget: SKIP*) in {doc['seconds']:.1f} s on "
        f"{doc.get('device', '?')}" + ("" if doc["ok"] else "; NOT OK: " + ", ".join(
            s["problems"][:8]) + (f"; aborted: {doc['aborted']}" if doc["aborted"] else "")))


# -- subprocesses ------------------------------------------------------------------------------

def child_env(tmp: Path) -> dict[str, str]:
    """What every process the run starts gets: the repository root on the path (a fresh
    checkout), scratch files in ``tmp``, no bytecode written into the checkout, no device
    layer inherited from a test run that started this one, no pytest plugin loaded that the
    command line does not name, and Python's fault handler on (a fatal signal, or the
    SIGABRT :func:`kill` sends first, dumps every thread's stack into the log)."""
    env = {k: v for k, v in os.environ.items() if k != "RESIDENCY_DEVICE_LAYER"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["TMPDIR"] = str(tmp)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


def python() -> list[str]:
    """This interpreter, with this run's ``-S`` if it has one (its children then find the
    repository's packages the same way: through ``PYTHONPATH``)."""
    return [sys.executable, *(["-S"] if sys.flags.no_site else [])]


def kill(proc: subprocess.Popen[Any], dump_wait: float = 5.0) -> None:
    """End ``proc`` and its process group: SIGABRT first, so that its fault handler dumps
    every thread's stack (what hung, in the log), then SIGKILL."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(proc.pid, signal.SIGABRT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=dump_wait)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def pytest_command(args: argparse.Namespace, tests_json: Path) -> list[str]:
    """The tests' command line: only the plugins the suite needs (with ``child_env``'s
    ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``), a fault-handler timeout, targets recorded or
    asserted."""
    plugins = [arg for name in PYTEST_PLUGINS for arg in ("-p", name)]
    return [*python(), "-m", "pytest", "tests/gpu",
            "--device-layer=cuda-sim" if args.dry_run else "--gpu",
            "--gpu-json", str(tests_json), "--gpu-budget", f"{args.tests_budget:g}",
            "--gpu-targets", "assert" if args.assert_targets else "record",
            *plugins, "-p", "no:cacheprovider", "-o", f"faulthandler_timeout={FAULTHANDLER_TIMEOUT}",
            "-q", "-rfEs", *(["-k", args.k] if args.k else [])]


def run_tests(run: Run, tmp: Path, tests_json: Path) -> None:
    """pytest tests/gpu in a subprocess; its JSON becomes the run's tests."""
    args = run.args
    cmd = pytest_command(args, tests_json)
    # The last test may start just before the tests' budget ends: it may finish, within the
    # run's budget (what the benchmarks need is theirs to lose).
    timeout = max(1.0, min(args.tests_budget + 120.0, run.remaining() - 5.0))
    say(f"gpu_run: {' '.join(cmd[1:])} (killed after {timeout:.0f} s)")
    t0 = time.monotonic()
    run.running = "tests"
    env = child_env(tmp)
    if args.max_size:
        env["RESIDENCY_GPU_MAX_SIZE"] = args.max_size  # read by tests/gpu/conftest.py
    if args.dry_run:  # the simulated GPU's device memory its own, as in the cuda-sim pass
        env["RESIDENCY_SIM_HOST_MODULES"] = "1"  # (strategies.checking._cudasim)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    run.child = proc
    killed = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        killed = True
        kill(proc)
        proc.wait()
    finally:
        run.child = None
        run.running = None
    doc: dict[str, Any] = {}
    with contextlib.suppress(OSError, json.JSONDecodeError):
        doc = json.loads(tests_json.read_text())
    with run.lock:
        run.tests = tests_of(doc, killed)
        run.tests_run = {"command": " ".join(cmd[1:]), "returncode": proc.returncode,
                         "killed": killed, "seconds": time.monotonic() - t0,
                         "json": str(tests_json), "kind": doc.get("kind"),
                         "device": doc.get("device"), "torch": doc.get("torch"),
                         "cuda": doc.get("cuda"), "sizes": doc.get("sizes"),
                         "targets": doc.get("targets"), "layer_streams": doc.get("layer_streams")}
        if doc.get("device"):
            run.meta["device"] = doc["device"]
        if proc.returncode not in (0, 1) and not killed:
            # 2-4: interrupted, internal or usage error (collection failed); 5: nothing ran.
            run.tests["pytest"] = {"status": "fail", "seconds": 0.0,
                                   "error": f"pytest exited {proc.returncode} (collection or "
                                            "usage error, or no tests ran): see its output"}


def tests_of(doc: dict[str, Any], killed: bool) -> dict[str, dict[str, Any]]:
    """The tests of the pytest JSON (tests/gpu/conftest.py), by short name; a test left
    running (pytest was killed, or died) fails."""
    tests: dict[str, dict[str, Any]] = {}
    for nodeid, entry in (doc.get("tests") or {}).items():
        entry = dict(entry, nodeid=nodeid)
        if entry.get("status") == "running":
            entry["status"] = "fail"
            entry["error"] = ("killed: still running when the run's time ran out" if killed
                              else "never finished (pytest exited during it)")
        tests[short_name(nodeid)] = entry
    return tests


def _failed_passes(doc: Any, path: str = "") -> Iterator[str]:
    """Every ``"pass": false`` anywhere in ``doc``, by its path."""
    if isinstance(doc, dict):
        if doc.get("pass") is False:
            yield path or "(top)"
        for k, v in doc.items():
            yield from _failed_passes(v, f"{path}.{k}" if path else str(k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _failed_passes(v, f"{path}[{i}]")


def judge_bench(name: str, returncode: int | None, doc: Any, assert_targets: bool
                ) -> tuple[list[str], list[str]]:
    """``(failures, missed)`` of one benchmark run: failures are what is wrong (exit code, no
    JSON, ``correct: false``, mismatches), and missed timing targets too when
    ``assert_targets`` (a GPU run with ``--assert-targets``); else those are ``missed``,
    recorded and reported, not failed."""
    failures: list[str] = []
    targets: list[str] = []
    if returncode != 0:
        failures.append(f"exit code {returncode}")
    if not isinstance(doc, dict):
        failures.append("no JSON document on stdout")
        return failures, []
    if doc.get("correct") is False:
        failures.append("correct: false")
    if doc.get("mismatched"):
        failures.append(f"outputs differ from resident: {doc['mismatched']}")
    targets += [f"{p}: pass false" for p in _failed_passes(doc)]
    if name.startswith("bench_residency") and isinstance(doc.get("targets"), dict):
        t = doc["targets"]
        fwd = t.get("layerwise_prefetch_fwd_ratio")
        if t.get("layerwise_target_applies") and isinstance(fwd, int | float) \
                and fwd > RESIDENCY_FWD_TARGET:
            targets.append(f"layerwise prefetch forward {fwd:.2f}x resident > "
                           f"{RESIDENCY_FWD_TARGET}x")
        if doc.get("profile") == "compute-heavy" and str(doc.get("device")).startswith("cuda") \
                and not t.get("layerwise_target_applies"):
            # The one configuration meant to judge the target: never waived silently.
            targets.append(f"layerwise target not judged: {t.get('layerwise_target_reason')}")
        ours, theirs = t.get("offload_use_ms"), t.get("reference_use_ms")
        if isinstance(ours, int | float) and isinstance(theirs, int | float) and ours >= theirs:
            targets.append(f"component-offload use {ours:.2f} ms not faster than the "
                           f"reference's {theirs:.2f} ms")
    if assert_targets:
        return failures + targets, []
    return failures, targets


def _parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        start = text.find("{")
        if start < 0:
            return None
        try:
            return json.loads(text[start:])
        except json.JSONDecodeError:
            return None


def _bench_numbers(name: str, doc: Any) -> dict[str, Any]:
    """A few headline numbers of a benchmark's JSON for the table."""
    if not isinstance(doc, dict):
        return {}
    if name.startswith("bench_residency"):
        t = doc.get("targets") or {}
        out = {k: t[k] for k in ("layerwise_prefetch_fwd_ratio", "layerwise_target_applies",
                                 "offload_use_ms", "reference_use_ms") if t.get(k) is not None}
        out.update({f"{mode.replace(' ', '_')}_fwd_overhead_pct": o.get("fwd_overhead_pct")
                    for mode, o in (doc.get("overhead") or {}).items()})
        if t.get("layerwise_target_reason"):
            out["layerwise_target_not_judged"] = t["layerwise_target_reason"]
        return out
    results = doc.get("results") or {}
    out = {f"{k}_gbps": v.get("gbps") for k, v in results.items()
           if isinstance(v, dict) and k.startswith("ours")}
    out.update(dict((doc.get("ratios") or {}).items()))
    return out


def run_bench(run: Run, tmp: Path, name: str, budget: float) -> None:
    device = "cpu" if run.args.dry_run else "cuda"
    remaining = run.remaining()
    if remaining < budget:
        run.benches[name] = {"status": "skip", "pass": None, "seconds": 0.0, "numbers": {},
                             "reason": f"its budget of {budget:.0f} s exceeds the "
                                       f"{max(remaining, 0):.0f} s left of the run's budget"}
        return
    argv = BENCH_ARGS[run.meta["mode"]][name]
    cmd = [*python(), "-m", "lifecycle", "bench", BENCH_COMMANDS[name], *argv, "--device", device,
           "--json"]
    say(f"gpu_run: {' '.join(cmd[1:])} (budget {budget:.0f} s)")
    t0 = time.monotonic()
    run.running = name
    proc = subprocess.Popen(cmd, cwd=tmp, env=child_env(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    run.child = proc
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        timed_out = True
        kill(proc)
        stdout, stderr = proc.communicate()
    finally:
        run.child = None
        run.running = None
    doc = None if timed_out else _parse_json(stdout or "")
    # (The CPU's timings of a dry run are never the targets': recorded only.)
    asserted = run.args.assert_targets and not run.args.dry_run
    failures, missed = judge_bench(name, proc.returncode, doc, asserted)
    if timed_out:
        failures = [f"timed out after its budget of {budget:.0f} s (killed)"]
    entry: dict[str, Any] = {
        "status": "fail" if failures else "pass", "pass": not failures,
        "seconds": time.monotonic() - t0, "returncode": proc.returncode,
        "command": " ".join(cmd[1:]), "budget_seconds": budget, "failures": failures,
        "targets_missed": missed, "targets_asserted": asserted, "result": doc,
        "error": "; ".join(failures) or None,
        "numbers": _bench_numbers(name, doc)}
    if failures:
        entry["stdout_tail"] = (stdout or "")[-2000:]
        entry["stderr_tail"] = (stderr or "")[-2000:]
    with run.lock:
        run.benches[name] = entry


# -- main --------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: the tests on the simulated GPU, the benchmarks on the CPU")
    ap.add_argument("--out", default=os.environ.get("OUT") or None,
                    help="directory for gpu_run.json and gpu_tests.json (default $OUT)")
    ap.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run")
    ap.add_argument("--tests-budget", type=float, default=None,
                    help="seconds in which the tests may start (default: 9/16 of the budget, "
                         "270 of 480; the rest is the benchmarks')")
    ap.add_argument("-k", default=None, help="select tests (pytest -k)")
    ap.add_argument("--max-size", default=None, metavar="SIZE",
                    help="cap every test pipeline at SIZE (e.g. 2GiB; default: 8GiB for the "
                         "bandwidth test, 2GiB and 1GiB for the others)")
    ap.add_argument("--skip-bench", action="store_true", help="run the tests only")
    ap.add_argument("--assert-targets", action="store_true",
                    help="fail the run on a missed bandwidth or latency target (default: "
                         "recorded and reported, only correctness fails the run)")
    ap.add_argument("--wheels", default=str(WHEELS), metavar="DIR",
                    help="install the wheels in DIR first, offline, into a scratch directory "
                         "put on the path (default: .whl, where scripts/gpu_wheels.sh puts "
                         "them; nothing when it holds none)")
    ap.add_argument("--bench", action="append", default=[], choices=BENCHES,
                    help="run only this benchmark (repeatable; default: all)")
    ap.add_argument("--bench-budget", action="append", default=[], metavar="NAME=SECONDS",
                    help="override a benchmark's own time budget")
    args = ap.parse_args(argv)
    if args.tests_budget is None:
        args.tests_budget = args.budget * 9 / 16
    budgets: dict[str, float] = {}
    for item in args.bench_budget:
        key, _, value = item.partition("=")
        if key not in BENCHES:
            ap.error(f"--bench-budget {item!r}: not a benchmark ({', '.join(BENCHES)})")
        try:
            budgets[key] = float(value)
        except ValueError:
            ap.error(f"--bench-budget {item!r}: SECONDS must be a number")
    args.bench_budgets = budgets
    return args


# What the tests and the benchmarks import (a GPU image may lack some: carry them as wheels,
# ``scripts/gpu_wheels.sh``): the distributions, with their minimum versions read from
# pyproject.toml (the project's dependencies and its test extra).
NEEDS = ("torch", "anyio", "transitions", "structlog", "safetensors", "pytest")
# The pytest plugins the suite uses: the rest are not loaded (PYTEST_DISABLE_PLUGIN_AUTOLOAD),
# as a GPU image's own (pytest-benchmark, pytest-mock, ...) may warn, and warnings are errors.
PYTEST_PLUGINS = ("anyio.pytest_plugin",)
FAULTHANDLER_TIMEOUT = 120  # seconds: a test running longer dumps every thread's stack
WHEELS = ROOT / ".whl"  # scripts/gpu_wheels.sh downloads here (ignored by git)


def minimum_versions(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """``{distribution: minimum version}`` of ``NEEDS``, from pyproject.toml's ``>=`` bounds."""
    import tomllib

    project = tomllib.loads(pyproject.read_text())["project"]
    found: dict[str, str] = {}
    for spec in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*>=\s*([0-9][^,;\s]*)", spec)
        if match and match[1].lower() in NEEDS:
            found[match[1].lower()] = match[2]
    return found


def version_key(version: str) -> tuple[int, ...]:
    """The release numbers of a version (``2.11.0+cu130`` -> ``(2, 11, 0)``; ``9.0rc1`` ->
    ``(9, 0)``): enough to compare against a minimum."""
    release = re.match(r"[0-9]+(\.[0-9]+)*", version)
    return tuple(int(x) for x in release[0].split(".")) if release else ()


def check_versions(installed: Mapping[str, str | None], minimums: Mapping[str, str]) -> list[str]:
    """What is missing or too old, one line each, naming the version found and the one
    needed (empty when the run can start)."""
    problems = []
    for name in NEEDS:
        have, need = installed.get(name), minimums.get(name)
        if have is None:
            problems.append(f"{name} is not installed (needs >= {need or 'any'}): carry its wheel "
                            "(scripts/gpu_wheels.sh), or run a Python that has it "
                            "(RESIDENCY_GPU_PYTHON)")
        elif need is not None and version_key(have) < version_key(need):
            problems.append(f"{name} {have} is older than the {need} pyproject.toml needs")
    return problems


def installed_versions() -> dict[str, str]:
    """Every distribution this Python sees (the carried wheels included), by lowercase name;
    the first on the path wins, as for imports."""
    versions: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name:
            versions.setdefault(name, dist.version)
    return dict(sorted(versions.items()))


def install_wheels(wheels: Path, target: Path) -> list[str]:
    """Install every wheel in ``wheels`` into ``target`` offline (``--no-index --no-deps``)
    and put ``target`` first on this process's path and its children's (``PYTHONPATH``);
    returns the wheels' file names (none: nothing done)."""
    files = sorted(wheels.glob("*.whl")) if wheels.is_dir() else []
    if not files:
        return []
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
           "--no-compile", "--no-cache-dir", "--disable-pip-version-check", "--upgrade",
           "--target", str(target), *map(str, files)]
    say(f"gpu_run: installing {len(files)} carried wheels from {wheels} into {target}")
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"installing the carried wheels failed (pip exited {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout)[-1500:]}")
    sys.path.insert(0, str(target))
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(target), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])
    return [f.name for f in files]


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _command(*cmd: str) -> str | None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def commit(wheels: Path = WHEELS) -> dict[str, Any]:
    """The checkout's commit: ``git`` where the checkout has its history, else the one
    ``scripts/gpu_wheels.sh`` wrote beside the wheels (a copied working tree has no .git),
    else ``$RESIDENCY_COMMIT``."""
    head = _command("git", "-C", str(ROOT), "rev-parse", "HEAD")
    if head:
        dirty = _command("git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no")
        return {"commit": head, "dirty": bool(dirty), "source": "git"}
    noted = _read(str(wheels / "COMMIT"))
    if noted:
        head, _, state = noted.partition(" ")
        return {"commit": head, "dirty": state == "dirty", "source": f"{wheels.name}/COMMIT"}
    return {"commit": os.environ.get("RESIDENCY_COMMIT"), "dirty": None,
            "source": "RESIDENCY_COMMIT" if os.environ.get("RESIDENCY_COMMIT") else None}


def _cuda_driver_version() -> int | None:
    """``cuDriverGetVersion`` (e.g. 13000), through the driver library; None without one."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        return version.value if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 else None
    except (OSError, AttributeError):
        return None


def pci_links(devices: Path = Path("/sys/bus/pci/devices")) -> dict[str, dict[str, str | None]]:
    """The PCIe link of each NVIDIA display or 3D controller as the kernel reports it (speed,
    which names the generation, and width; current and maximum): the record where nvidia-smi
    is missing or answers nothing. Empty where sysfs has no such device."""
    links: dict[str, dict[str, str | None]] = {}
    for dev in sorted(devices.glob("*")) if devices.is_dir() else []:
        if _read(str(dev / "vendor")) == "0x10de" and (_read(str(dev / "class")) or "").startswith("0x03"):
            links[dev.name] = {k: _read(str(dev / k)) for k in (
                "current_link_speed", "current_link_width", "max_link_speed", "max_link_width")}
    return links


def environment(wheels: Path = WHEELS) -> dict[str, Any]:
    """What the run ran on, for its JSON: every package's version, the GPU's driver and
    runtime, the PCIe link, transparent huge pages, the page-lock limit, the commit."""
    import resource

    import torch

    smi_fields = ("name", "driver_version", "pcie.link.gen.current", "pcie.link.gen.max",
                  "pcie.link.width.current", "pcie.link.width.max", "memory.total")
    smi = _command("nvidia-smi", f"--query-gpu={','.join(smi_fields)}",
                   "--format=csv,noheader,nounits")
    gpus = [dict(zip(smi_fields, (v.strip() for v in line.split(",")), strict=False))
            for line in (smi or "").splitlines() if line.strip()]
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    limit = {"soft": None if soft == resource.RLIM_INFINITY else soft,
             "hard": None if hard == resource.RLIM_INFINITY else hard,
             "unlimited": soft == resource.RLIM_INFINITY}
    cudnn = torch.backends.cudnn
    cudnn_version = cudnn.version() if cudnn.is_available() else None  # type: ignore[no-untyped-call]
    return {"python": sys.version.split()[0], "executable": sys.executable,
            "platform": platform.platform(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "torch_cuda_runtime": torch.version.cuda,
            "cudnn": cudnn_version, "cuda_driver_api_version": _cuda_driver_version(),
            "gpus": gpus, "nvidia_smi": smi is not None, "pci_links": pci_links(),
            "transparent_hugepages": {
                "enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
                "defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag")},
            "ulimit_l_bytes": limit, "commit": commit(wheels),
            "packages": installed_versions()}


def cuda_device() -> str | None:
    """The GPU's name, or None without CUDA (torch imported here only: the tests and the
    benchmarks run in processes of their own)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return str(torch.cuda.get_device_name())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out) if args.out else None
    run = Run(args, out)
    tmp = Path(tempfile.mkdtemp(prefix="gpu-run-"))
    tests_json = (out if out is not None else tmp) / "gpu_tests.json"
    mode = "dry-run" if args.dry_run else "gpu"
    run.meta = {"mode": mode, "python": sys.version.split()[0],
                "config": {"budget": args.budget, "tests_budget": args.tests_budget, "k": args.k,
                           "max_size": args.max_size, "assert_targets": args.assert_targets,
                           "skip_bench": args.skip_bench, "bench": args.bench or None,
                           "bench_budgets": args.bench_budgets, "wheels": args.wheels}}

    def hard_stop(why: str) -> None:
        """Cut the run short (hung past the budget, or terminated): kill what runs, write the
        JSON (what did not finish fails), clean up, exit 1."""
        why = f"{why} while running {run.running or 'nothing'}"
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)  # this process's, too
        child = run.child
        if child is not None:
            kill(child)
        try:
            print_table(run.write(aborted=why))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
            print(why, file=sys.stderr, flush=True)
            os._exit(1)

    watchdog = threading.Timer(args.budget + GRACE, hard_stop, [
        f"hard stop: {GRACE:.0f} s past the budget of {args.budget:.0f} s"])
    watchdog.daemon = True
    watchdog.start()
    # A runner's own timeout (``timeout`` sends SIGTERM first) still gets the JSON.
    signal.signal(signal.SIGTERM, lambda signum, frame: hard_stop(f"terminated by signal {signum}"))
    try:
        run.meta["wheels_installed"] = install_wheels(Path(args.wheels), tmp / "site")
        installed = installed_versions()
        run.meta["versions"] = {name: installed.get(name) for name in NEEDS}
        run.meta["minimum_versions"] = minimums = minimum_versions()
        problems = check_versions(installed, minimums)
        if problems:
            run.meta["environment"] = {"python": sys.version.split()[0],
                                       "executable": sys.executable, "packages": installed}
            raise RuntimeError(f"this Python ({sys.executable}) cannot run the GPU run: "
                               + "; ".join(problems))
        run.meta["environment"] = environment(Path(args.wheels))
        if args.dry_run:
            run.meta["device"] = "simulated GPU (SimCuda); benchmarks on the CPU"
        else:
            name = cuda_device()
            if name is None:
                raise RuntimeError("CUDA is not available here: run with --dry-run to check "
                                   "the harness on the simulated GPU")
            run.meta["device"] = name
        say(f"gpu_run ({mode}) on {run.meta['device']}: budget {args.budget:.0f} s, tests may "
            f"start for {args.tests_budget:.0f} s")
        run.write(aborted="incomplete: written while the run was in progress")
        run_tests(run, tmp, tests_json)
        run.write(aborted="incomplete: written while the run was in progress")
        budgets = BENCH_BUDGETS[mode] | args.bench_budgets
        for name in BENCHES:
            if args.skip_bench or (args.bench and name not in args.bench):
                run.benches[name] = {"status": "skip", "pass": None, "seconds": 0.0,
                                     "numbers": {}, "reason": "--skip-bench" if args.skip_bench
                                     else "not selected (--bench)"}
                continue
            run_bench(run, tmp, name, budgets[name])
            run.write(aborted="incomplete: written while the run was in progress")
        doc = run.write()
    except Exception as exc:  # a setup error: still a JSON document, and exit 1
        traceback.print_exc()
        doc = run.write(aborted=f"{type(exc).__name__}: {exc}")
    finally:
        watchdog.cancel()
        shutil.rmtree(tmp, ignore_errors=True)
    print_table(doc)
    if out is not None:
        say(f"results: {out / 'gpu_run.json'} (tests: {tests_json})")
    return 0 if doc["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
