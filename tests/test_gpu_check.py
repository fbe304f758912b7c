"""scripts/gpu_check.py dry-runs on the CPU: every check runs, failures exit 1 with the JSON
written, budgets skip benchmarks, and it needs no installed package."""

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
SCRIPT = ROOT / "scripts" / "gpu_check.py"
CHECKS = {"link_bandwidth", "sleep_wake_bandwidth", "memory_release", "empty_cache_timing",
          "layerwise_latency", "layerwise_peak", "update_from_tensors", "update_rollback",
          "update_from_disk", "planner", "concurrent_layerwise", "ordering_user_stream",
          "ordering_update_after_generate", "ordering_sleep_after_generate"}
BENCHES = {"bench_sleep_wake", "bench_update", "bench_residency"}


def _run(out: Path, *args: str, env: dict[str, str] | None = None,
         python: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run([sys.executable, *python, str(SCRIPT), "--device", "cpu", "--size", "4MB",
                           "--out", str(out), *args], cwd=ROOT, env=base | (env or {}),
                          capture_output=True, text=True, timeout=240, check=False)


def _doc(out: Path) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((out / "gpu_check.json").read_text())
    return doc


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being made
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_cpu_dry_run_passes_every_check_and_leaves_no_files(tmp_path: Path) -> None:
    """A CPU dry run at 4 MB exits 0 with every check and benchmark passed in its JSON,
    CUDA-only numbers null, and nothing new in the working directory."""
    before = set(os.listdir(ROOT))
    proc = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    doc = _doc(tmp_path)
    assert set(doc["checks"]) == CHECKS and set(doc["benchmarks"]) == BENCHES
    statuses = {n: e["status"] for n, e in [*doc["checks"].items(), *doc["benchmarks"].items()]}
    assert set(statuses.values()) == {"pass"}, statuses
    assert doc["ok"] is True and doc["aborted"] is None and doc["summary"]["failed"] == []
    assert doc["checks"]["memory_release"]["numbers"]["released_reserved"] is None
    assert doc["checks"]["sleep_wake_bandwidth"]["numbers"]["target"] == "n/a on cpu"
    assert "link_bandwidth" in proc.stdout and "17 passed, 0 failed" in proc.stdout
    assert set(os.listdir(ROOT)) == before
    assert [p.name for p in tmp_path.iterdir()] == ["gpu_check.json"]


def test_forced_failure_and_bench_timeout_exit_1_with_json(tmp_path: Path) -> None:
    """--self-test-fail fails the named check and a benchmark past its own budget is killed
    and fails: exit 1, the JSON still written."""
    proc = _run(tmp_path, "--only", "link_bandwidth,bench_update", "--self-test-fail",
                "link_bandwidth", "--bench-budget", "bench_update=0.3")
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-3000:]
    doc = _doc(tmp_path)
    assert doc["ok"] is False and set(doc["checks"]) == CHECKS
    link = doc["checks"]["link_bandwidth"]
    assert link["status"] == "fail" and "self-test-fail" in link["error"]
    assert link["numbers"]["h2d_pinned_gbps"] > 0
    bench = doc["benchmarks"]["bench_update"]
    assert bench["status"] == "fail" and "timed out" in bench["error"]
    assert sorted(doc["summary"]["failed"]) == ["bench_update", "link_bandwidth"]
    assert doc["checks"]["planner"]["status"] == "skip"


def test_bench_over_the_remaining_budget_is_skipped(tmp_path: Path) -> None:
    """A benchmark whose own budget exceeds the time left is reported as skipped (neither
    passed nor failed) and the run exits 0."""
    proc = _run(tmp_path, "--only", "bench_residency", "--budget-seconds", "5")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    bench = _doc(tmp_path)["benchmarks"]["bench_residency"]
    assert bench["status"] == "skip" and bench["pass"] is None
    assert "exceeds" in bench["reason"]


def test_runs_without_the_package_installed(tmp_path: Path) -> None:
    """With site-packages on the path but its .pth files (the editable install) unread, the
    script still imports lifecycle, from the repository root."""
    env = {"PYTHONPATH": sysconfig.get_paths()["purelib"]}
    bare = subprocess.run([sys.executable, "-S", "-c", "import lifecycle"], cwd=tmp_path,
                          env=os.environ | env, capture_output=True, text=True, check=False)
    assert bare.returncode != 0  # so the script's own sys.path entry is what makes it work
    proc = _run(tmp_path, "--only", "link_bandwidth", "--skip-bench", env=env, python=("-S",))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert _doc(tmp_path)["checks"]["link_bandwidth"]["status"] == "pass"


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
