"""scripts/gpu_run.py (the GPU run, ``scripts/test --gpu``) checked without a GPU through its dry
run: the GPU tests on the simulated GPU and the benchmarks on the CPU, the JSON and the
table, the budgets, failures exiting 1, and a fresh checkout. (tests/gpu itself runs in the
cuda-sim pass of scripts/test.)"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_run.py"
BENCHES = {"bench_sleep_wake", "bench_update", "bench_residency"}


def _run(out: Path, *args: str, env: dict[str, str] | None = None,
         python: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("OUT", "RESIDENCY_DEVICE_LAYER")}
    return subprocess.run([sys.executable, *python, str(SCRIPT), "--out", str(out), *args],
                          cwd=ROOT, env=base | (env or {}), capture_output=True, text=True,
                          timeout=240, check=False)


def _doc(out: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((out / "gpu_run.json").read_text())
    return doc


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_run", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_a_dry_run_passes_the_tests_and_a_benchmark_and_leaves_only_its_json(
        tmp_path: Path) -> None:
    """A dry run of three GPU tests and the residency benchmark exits 0 with all passed in
    its JSON (the simulated GPU named, the tests' numbers kept), prints the table, and
    writes nothing but its two JSON files."""
    before = set(os.listdir(ROOT))
    proc = _run(tmp_path, "--dry-run", "-k", "page_locked or rolls_the_update_back or user_stream",
                "--bench", "bench_residency")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    doc = _doc(tmp_path)
    assert doc["ok"] is True and doc["aborted"] is None and doc["mode"] == "dry-run"
    assert sorted(doc["tests"]) == [
        "device::host_mirrors_are_page_locked_and_counted",
        "ordering::a_forward_under_a_user_stream_is_refused_and_the_next_one_is_exact",
        "updates::a_copy_fault_midway_rolls_the_update_back"]
    assert {e["status"] for e in doc["tests"].values()} == {"pass"}
    assert doc["tests"]["updates::a_copy_fault_midway_rolls_the_update_back"]["numbers"][
        "faults_injected"] == 1
    assert doc["tests_run"]["kind"] == "simulated" and doc["tests_run"]["returncode"] == 0
    assert set(doc["benchmarks"]) == BENCHES
    assert doc["benchmarks"]["bench_residency"]["status"] == "pass"
    assert doc["benchmarks"]["bench_update"]["reason"] == "not selected (--bench)"
    assert "4 passed, 0 failed, 2 skipped" in proc.stdout
    assert "PASS" in proc.stdout and "layerwise_prefetch_fwd_ratio=" in proc.stdout
    assert set(os.listdir(ROOT)) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_run.json", "gpu_tests.json"]


def test_from_a_fresh_checkout_tests_past_the_budget_and_a_slow_benchmark_fail_the_run(
        tmp_path: Path) -> None:
    """Run with site-packages on the path but its .pth files (the editable install) unread,
    so that the run and the processes it starts (pytest collects tests/gpu, whose conftests
    import lifecycle) find the packages at the repository root: a test not started within the
    tests' budget is reported skipped for the budget, a benchmark running past its own
    budget is killed and fails, and the run exits 1 with every reason in its JSON."""
    env = {"PYTHONPATH": sysconfig.get_paths()["purelib"]}
    bare = subprocess.run([sys.executable, "-S", "-c", "import lifecycle"], cwd=tmp_path,
                          env=os.environ | env, capture_output=True, text=True, check=False)
    assert bare.returncode != 0  # so the run's own path entry is what makes it work
    proc = _run(tmp_path, "--dry-run", "--tests-budget", "0", "-k", "page_locked",
                "--bench", "bench_update", "--bench-budget", "bench_update=0.3",
                env=env, python=("-S",))
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-3000:]
    doc = _doc(tmp_path)
    assert doc["ok"] is False and doc["tests_run"]["returncode"] == 0
    test = doc["tests"]["device::host_mirrors_are_page_locked_and_counted"]
    assert test["status"] == "skip" and test["budget_skipped"] is True
    assert test["reason"].startswith("budget:")
    bench = doc["benchmarks"]["bench_update"]
    assert bench["status"] == "fail" and "timed out" in bench["error"]
    assert doc["summary"]["failed"] == ["bench_update"]
    assert doc["summary"]["budget_skipped"] == [
        "device::host_mirrors_are_page_locked_and_counted"]
    assert "SKIP*" in proc.stdout and "NOT OK" in proc.stdout


def test_without_cuda_the_run_asks_for_the_dry_run(tmp_path: Path) -> None:
    """Without --dry-run, on a machine with no GPU, the run exits 1 saying to use it, its
    JSON written."""
    proc = _run(tmp_path, "--skip-bench")
    assert proc.returncode == 1
    doc = _doc(tmp_path)
    assert doc["ok"] is False and "--dry-run" in doc["aborted"]


def test_a_test_left_running_by_a_killed_pytest_fails() -> None:
    """A test the tests' JSON shows still running (pytest killed at the run's time limit, or
    dead) is a failure in the run, named by its short name."""
    tests_of = _script().tests_of
    doc = {"tests": {"tests/gpu/test_x.py::test_a[asyncio]": {"status": "pass"},
                     "tests/gpu/test_x.py::test_b[asyncio-big]": {"status": "running"}}}
    tests = tests_of(doc, killed=True)
    assert tests["x::a"]["status"] == "pass"
    assert tests["x::b[big]"]["status"] == "fail" and "killed" in tests["x::b[big]"]["error"]
    assert "never finished" in tests_of(doc, killed=False)["x::b[big]"]["error"]


def test_nested_failed_target_counts_on_cuda_and_is_waived_on_cpu() -> None:
    """A benchmark JSON with a nested ``pass: false`` fails on CUDA and is waived on the CPU,
    while a non-zero exit code or ``correct: false`` fails it on both."""
    judge = _script().judge_bench
    doc = {"targets": {"wake": {"value": 0.5, "target": 0.8, "pass": False}}, "correct": True}
    assert judge("bench_sleep_wake", 0, doc, "cuda") == (["targets.wake: pass false"], [])
    assert judge("bench_sleep_wake", 0, doc, "cpu") == ([], ["targets.wake: pass false"])
    assert judge("bench_update", 1, {"correct": False}, "cpu")[0] == ["exit code 1",
                                                                      "correct: false"]
    assert judge("bench_update", 0, None, "cuda")[0] == ["no JSON document on stdout"]
    slow = {"targets": {"layerwise_prefetch_fwd_ratio": 1.3, "layerwise_target_applies": True,
                        "offload_use_ms": 1.0, "reference_use_ms": 2.0}, "mismatched": []}
    failed, _ = judge("bench_residency", 0, slow, "cuda")
    assert len(failed) == 1 and "1.30x" in failed[0]
