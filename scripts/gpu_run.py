"""The GPU run: the GPU tests (tests/gpu) on the real GPU, then the benchmarks, in one budgeted
command, with one JSON document and a table of results and bandwidths.

    python scripts/gpu_run.py [--budget 480] [--tests-budget 270] [--out DIR] [-k EXPR]
        [--max-size SIZE] [--skip-bench] [--bench NAME ...] [--bench-budget NAME=SECONDS ...]
    scripts/test --gpu [the same arguments]          (the same, inside .venv)

    python scripts/gpu_run.py --dry-run              # no GPU needed (about a minute)

Runs from a fresh checkout, with any Python that has the dependencies (``NEEDS``; a GPU
image's own python3, with what it lacks carried as wheels on ``PYTHONPATH``: nothing is
installed, and ``scripts/test --gpu`` would build .venv from the network): the repository root
goes on the path of everything it starts.

1. ``pytest tests/gpu --gpu --gpu-json OUT/gpu_tests.json --gpu-budget TESTS_BUDGET -p no:xdist``
   in a subprocess: correctness first, big sizes, bandwidth and latency targets asserted (see
   tests/gpu/conftest.py). A test not started when the tests' budget is spent is skipped and
   reported as ``budget_skipped``; a test still running when the run's time runs out is killed
   and fails.
2. The benchmarks, each in a subprocess with its own budget, while the time left allows:
   ``python -m lifecycle bench sleep-wake|update|residency --device cuda --json``. One whose
   budget exceeds the time left is skipped (neither passed nor failed); one running past its
   budget is killed and fails.
3. ``gpu_run.json`` (in ``--out DIR``, default ``$OUT``; none when neither is set), written
   after each step and whatever happens, and the table on stdout.

``--dry-run`` runs the same on a machine without a GPU: the tests on the simulated GPU
(``--device-layer=cuda-sim``), the benchmarks on the CPU at tiny sizes (their timing targets
reported but waived). CI runs it (tests/test_gpu_run.py).

Exit status 0 when every test passed and no benchmark failed; 1 when a test failed, was
skipped for the budget (the run is incomplete) or none ran, a benchmark failed, or the run
was cut short. A watchdog writes the JSON and exits 1 if anything hangs past the budget.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCHES: tuple[str, ...] = ("bench_sleep_wake", "bench_update", "bench_residency")
# Each benchmark's own time budget in seconds (its subprocess timeout): on a GPU, dry run.
BENCH_BUDGETS: dict[str, dict[str, float]] = {
    "gpu": {"bench_sleep_wake": 100.0, "bench_update": 80.0, "bench_residency": 60.0},
    "dry-run": {"bench_sleep_wake": 60.0, "bench_update": 60.0, "bench_residency": 60.0},
}
BENCH_ARGS: dict[str, dict[str, list[str]]] = {
    "gpu": {"bench_sleep_wake": ["--size", "2GiB", "--repeats", "3"],
            "bench_update": ["--size", "1GiB", "--repeats", "3"],
            "bench_residency": ["--repeats", "5"]},
    "dry-run": {"bench_sleep_wake": ["--size", "1MB", "--repeats", "1"],
                "bench_update": ["--size", "1MB", "--repeats", "1"],
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
        doc: dict[str, Any] = strict_json({
            "tool": "scripts/gpu_run.py", **self.meta, "ok": not problems and aborted is None,
            "aborted": aborted, "seconds": self.elapsed(), "budget_seconds": self.args.budget,
            "tests_budget_seconds": self.args.tests_budget, "tests_run": self.tests_run,
            "tests": tests, "benchmarks": benches,
            "summary": {"passed": [n for n, e in everything.items() if e["status"] == "pass"],
                        "failed": failed, "budget_skipped": budget_skipped,
                        "skipped": [n for n, e in everything.items() if e["status"] == "skip"],
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
            f" {'ok' if t.get('pass') else 'MISSED'}{'' if t.get('asserted') else ' (waived)'}"
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
    say(f"\n{len(s['passed'])} passed, {len(s['failed'])} failed, {len(s['skipped'])} skipped "
        f"({len(s['budget_skipped'])} for the budget: SKIP*) in {doc['seconds']:.1f} s on "
        f"{doc.get('device', '?')}" + ("" if doc["ok"] else "; NOT OK: " + ", ".join(
            s["problems"][:8]) + (f"; aborted: {doc['aborted']}" if doc["aborted"] else "")))


# -- subprocesses ------------------------------------------------------------------------------

def child_env(tmp: Path) -> dict[str, str]:
    """What every process the run starts gets: the repository root on the path (a fresh
    checkout), scratch files in ``tmp``, no bytecode written into the checkout, and no
    device layer inherited from a test run that started this one."""
    env = {k: v for k, v in os.environ.items() if k != "RESIDENCY_DEVICE_LAYER"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env["TMPDIR"] = str(tmp)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def python() -> list[str]:
    """This interpreter, with this run's ``-S`` if it has one (its children then find the
    repository's packages the same way: through ``PYTHONPATH``)."""
    return [sys.executable, *(["-S"] if sys.flags.no_site else [])]


def kill(proc: subprocess.Popen[Any]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_tests(run: Run, tmp: Path, tests_json: Path) -> None:
    """pytest tests/gpu in a subprocess; its JSON becomes the run's tests."""
    args = run.args
    cmd = [*python(), "-m", "pytest", "tests/gpu",
           "--device-layer=cuda-sim" if args.dry_run else "--gpu",
           "--gpu-json", str(tests_json), "--gpu-budget", f"{args.tests_budget:g}",
           "-p", "no:xdist", "-p", "no:cacheprovider", "-q", "-rfEs",
           *(["-k", args.k] if args.k else [])]
    # The last test may start just before the tests' budget ends: it may finish, within the
    # run's budget (what the benchmarks need is theirs to lose).
    timeout = max(1.0, min(args.tests_budget + 120.0, run.remaining() - 5.0))
    say(f"gpu_run: {' '.join(cmd[1:])} (killed after {timeout:.0f} s)")
    t0 = time.monotonic()
    run.running = "tests"
    env = child_env(tmp)
    if args.max_size:
        env["RESIDENCY_GPU_MAX_SIZE"] = args.max_size  # read by tests/gpu/conftest.py
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
                         "cuda": doc.get("cuda"), "sizes": doc.get("sizes")}
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


def judge_bench(name: str, returncode: int | None, doc: Any, device_type: str
                ) -> tuple[list[str], list[str]]:
    """``(failures, waived)`` of one benchmark run: failures count everywhere (exit code, no
    JSON, ``correct: false``, mismatches); timing targets count on CUDA and are waived on
    the CPU."""
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
    if name == "bench_residency" and isinstance(doc.get("targets"), dict):
        t = doc["targets"]
        fwd = t.get("layerwise_prefetch_fwd_ratio")
        if t.get("layerwise_target_applies") and isinstance(fwd, int | float) \
                and fwd > RESIDENCY_FWD_TARGET:
            targets.append(f"layerwise prefetch forward {fwd:.2f}x resident > "
                           f"{RESIDENCY_FWD_TARGET}x")
        ours, theirs = t.get("offload_use_ms"), t.get("reference_use_ms")
        if isinstance(ours, int | float) and isinstance(theirs, int | float) and ours >= theirs:
            targets.append(f"component-offload use {ours:.2f} ms not faster than the "
                           f"reference's {theirs:.2f} ms")
    if device_type == "cuda":
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
    if name == "bench_residency":
        t = doc.get("targets") or {}
        return {k: t.get(k) for k in ("layerwise_prefetch_fwd_ratio", "offload_use_ms",
                                      "reference_use_ms")}
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
    which = name.removeprefix("bench_").replace("_", "-")
    argv = BENCH_ARGS[run.meta["mode"]][name]
    cmd = [*python(), "-m", "lifecycle", "bench", which, *argv, "--device", device, "--json"]
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
    failures, waived = judge_bench(name, proc.returncode, doc, device)
    if timed_out:
        failures = [f"timed out after its budget of {budget:.0f} s (killed)"]
    entry: dict[str, Any] = {
        "status": "fail" if failures else "pass", "pass": not failures,
        "seconds": time.monotonic() - t0, "returncode": proc.returncode,
        "command": " ".join(cmd[1:]), "budget_seconds": budget, "failures": failures,
        "waived_targets_cpu": waived, "result": doc, "error": "; ".join(failures) or None,
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


# What the tests and the benchmarks import (a GPU image may lack some: carry them as wheels).
NEEDS = ("torch", "anyio", "transitions", "structlog", "safetensors", "pytest")


def missing_modules() -> list[str]:
    """The modules of ``NEEDS`` this Python cannot import (looked up, not imported)."""
    return [name for name in NEEDS if importlib.util.find_spec(name) is None]


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
                           "max_size": args.max_size,
                           "skip_bench": args.skip_bench, "bench": args.bench or None,
                           "bench_budgets": args.bench_budgets}}

    def hard_stop(why: str) -> None:
        """Cut the run short (hung past the budget, or terminated): kill what runs, write the
        JSON (what did not finish fails), clean up, exit 1."""
        why = f"{why} while running {run.running or 'nothing'}"
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
        missing = missing_modules()
        if missing:
            raise RuntimeError(f"this Python ({sys.executable}) cannot import {', '.join(missing)}: "
                               "install them, or carry their wheels onto the path (PYTHONPATH)")
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
