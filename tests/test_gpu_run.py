"""scripts/gpu_run.py (the GPU run, ``scripts/test --gpu``) checked without a GPU through its dry
run: the GPU tests on the simulated GPU and the benchmarks on the CPU, the JSON and the
table, the budgets, failures exiting 1, and a fresh checkout; and its offline path without
building anything: ``--gpu`` handled before .venv, the carried wheels, the version checks,
the environment record, the pytest command. (tests/gpu itself runs in the cuda-sim pass of
scripts/test.)"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_run.py"
BENCHES = {"bench_sleep_wake", "bench_update", "bench_residency_compute", "bench_residency"}


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
    assert doc["versions"]["torch"] == doc["environment"]["packages"]["torch"]
    assert doc["minimum_versions"]["torch"] == "2.4"
    assert doc["tests_run"]["targets"] == "record"
    assert set(doc["tests_run"]["layer_streams"]) == {"device", "host"}
    assert "4 passed, 0 failed, 3 skipped" in proc.stdout
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
    # SIGABRT first: the fault handler dumps its stack. Killed at 0.3 s the benchmark may
    # still be importing torch, a stack deep enough for faulthandler to cut it at 100 frames
    # before `python -m`'s own; any frame line in faulthandler's format shows the dump.
    assert re.search(r'File "[^"]+", line \d+ in \w+', bench["stderr_tail"]), bench["stderr_tail"]
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


def test_a_missed_target_fails_only_when_targets_are_asserted() -> None:
    """A benchmark JSON with a nested ``pass: false`` fails the benchmark with
    ``--assert-targets`` and is only recorded as missed without it, while a non-zero exit
    code or ``correct: false`` fails it either way; a compute-heavy residency run on CUDA that
    could not judge the layerwise target says so."""
    judge = _script().judge_bench
    doc = {"targets": {"wake": {"value": 0.5, "target": 0.8, "pass": False}}, "correct": True}
    assert judge("bench_sleep_wake", 0, doc, True) == (["targets.wake: pass false"], [])
    assert judge("bench_sleep_wake", 0, doc, False) == ([], ["targets.wake: pass false"])
    reported = {"targets": {"update": {"value": 0.3, "target": 0.9, "pass": None}}}
    assert judge("bench_update", 0, reported, True) == ([], [])
    assert judge("bench_update", 1, {"correct": False}, False)[0] == ["exit code 1",
                                                                      "correct: false"]
    assert judge("bench_update", 0, None, True)[0] == ["no JSON document on stdout"]
    slow = {"targets": {"layerwise_prefetch_fwd_ratio": 1.3, "layerwise_target_applies": True,
                        "offload_use_ms": 1.0, "reference_use_ms": 2.0}, "mismatched": []}
    failed, _ = judge("bench_residency", 0, slow, True)
    assert len(failed) == 1 and "1.30x" in failed[0]
    copy_bound = {"device": "cuda", "profile": "compute-heavy", "mismatched": [], "targets": {
        "layerwise_prefetch_fwd_ratio": 2.0, "layerwise_target_applies": False,
        "layerwise_target_reason": "copy-bound: a layer computes in 1 ms but copies in 2 ms"}}
    assert judge("bench_residency_compute", 0, copy_bound, False) == ([], [
        "layerwise target not judged: copy-bound: a layer computes in 1 ms but copies in 2 ms"])


def _bash_stub(bin_dir: Path, name: str, status: int) -> None:
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / name
    stub.write_text(f"#!/bin/sh\nexit {status}\n")
    stub.chmod(0o755)


def test_scripts_test_gpu_starts_the_run_without_setting_up_a_venv(tmp_path: Path) -> None:
    """``scripts/test --gpu`` runs the GPU run with ``$RESIDENCY_GPU_PYTHON`` before .venv is
    looked at: with a ``python3`` on the path that fails at once (what building .venv runs
    first) and a .venv that does not exist, ``--help`` prints the run's usage and exits 0,
    and no venv is made."""
    _bash_stub(tmp_path / "bin", "python3", 97)
    env = {k: v for k, v in os.environ.items() if k != "OUT"} | {
        "PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "RESIDENCY_VENV": str(tmp_path / "venv"), "RESIDENCY_GPU_PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "test"), "--gpu", "--help"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--assert-targets" in proc.stdout and "--wheels" in proc.stdout
    assert "setting up" not in proc.stderr and not (tmp_path / "venv").exists()


def test_minimum_versions_come_from_pyproject_and_what_is_missing_or_old_is_named() -> None:
    """The run's minimum versions are pyproject.toml's ``>=`` bounds; a missing package and
    one older than its bound are each named with what is needed, a local version suffix
    (``+cu130``) and a newer one pass."""
    script = _script()
    assert script.minimum_versions() == {"torch": "2.4", "anyio": "4.4", "transitions": "0.9.2",
                                         "structlog": "24.1", "safetensors": "0.4", "pytest": "8"}
    assert script.version_key("2.11.0+cu130") == (2, 11, 0)
    assert script.version_key("9.0rc1") == (9, 0)
    installed = {"torch": "2.11.0+cu130", "anyio": "4.3.9", "transitions": "0.9.3",
                 "safetensors": "0.8.0", "pytest": "9.2.0"}
    assert script.check_versions(installed, script.minimum_versions()) == [
        "anyio 4.3.9 is older than the 4.4 pyproject.toml needs",
        "structlog is not installed (needs >= 24.1): carry its wheel (scripts/gpu_wheels.sh), "
        "or run a Python that has it (RESIDENCY_GPU_PYTHON)"]
    assert script.check_versions(installed | {"anyio": "4.16.0", "structlog": "26.1.0"},
                                 script.minimum_versions()) == []


def _wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel of a module ``name`` whose ``VALUE`` is 7."""
    import zipfile

    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {f"{name}/__init__.py": "VALUE = 7\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as zf:
        for f, text in files.items():
            zf.writestr(f, text)
    return path


def test_carried_wheels_are_installed_offline_onto_the_path_of_the_run_and_its_children(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wheel in the wheels folder is installed without an index into the target, which
    goes first on this process's path and on ``PYTHONPATH``: the module imports, its version
    is seen by ``importlib.metadata``, and a child process imports it too; an empty folder
    installs nothing."""
    script = _script()
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    wheels = tmp_path / "whl"
    wheels.mkdir()
    assert script.install_wheels(wheels, tmp_path / "site") == []
    _wheel(wheels, "residency_probe", "1.2")
    names = script.install_wheels(wheels, tmp_path / "site")
    assert names == ["residency_probe-1.2-py3-none-any.whl"]
    assert os.environ["PYTHONPATH"] == f"{tmp_path / 'site'}{os.pathsep}/elsewhere"
    assert sys.path[0] == str(tmp_path / "site")
    assert script.installed_versions()["residency-probe"] == "1.2"
    child = subprocess.run([sys.executable, "-c", "import residency_probe; print(residency_probe.VALUE)"],
                           env=os.environ.copy(), capture_output=True, text=True, timeout=60, check=True)
    assert child.stdout.strip() == "7"
    sys.modules.pop("residency_probe", None)


def test_the_environment_names_packages_limits_and_the_commit_even_without_git(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment record has every package's version, ``ulimit -l`` as the process
    sees it, the huge-page mode, each NVIDIA GPU's PCIe link as sysfs gives it, and the
    commit: git's where there is a history, else the one the wheels folder notes, else
    none."""
    import resource

    script = _script()
    env = script.environment(tmp_path)
    assert env["packages"]["torch"] == importlib.metadata.version("torch")
    assert env["packages"]["pytest"] == importlib.metadata.version("pytest")
    soft = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0]
    assert env["ulimit_l_bytes"]["soft"] == (None if soft == resource.RLIM_INFINITY else soft)
    assert set(env["transparent_hugepages"]) == {"enabled", "defrag"}
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    assert env["commit"]["commit"] == head and env["commit"]["source"] == "git"
    gpu = tmp_path / "devices" / "0000:19:00.0"
    gpu.mkdir(parents=True)
    for name, text in {"vendor": "0x10de", "class": "0x030200", "current_link_speed": "32.0 GT/s PCIe",
                       "current_link_width": "16", "max_link_speed": "32.0 GT/s PCIe",
                       "max_link_width": "16"}.items():
        (gpu / name).write_text(text + "\n")
    (tmp_path / "devices" / "0000:00:01.0").mkdir()  # (not a GPU: no vendor)
    assert script.pci_links(tmp_path / "devices") == {"0000:19:00.0": {
        "current_link_speed": "32.0 GT/s PCIe", "current_link_width": "16",
        "max_link_speed": "32.0 GT/s PCIe", "max_link_width": "16"}}
    monkeypatch.setattr(script, "_command", lambda *cmd: None)  # (no git)
    (tmp_path / "COMMIT").write_text("0123abcd dirty\n")
    assert script.commit(tmp_path) == {"commit": "0123abcd", "dirty": True,
                                       "source": f"{tmp_path.name}/COMMIT"}
    (tmp_path / "COMMIT").unlink()
    monkeypatch.delenv("RESIDENCY_COMMIT", raising=False)
    assert script.commit(tmp_path) == {"commit": None, "dirty": None, "source": None}


def test_pytest_runs_with_only_the_suites_plugin_a_faulthandler_timeout_and_recorded_targets(
        tmp_path: Path) -> None:
    """The tests' command names the one plugin the suite needs, dumps stacks after 120 s,
    records targets unless ``--assert-targets``; its environment turns plugin autoloading
    off and Python's fault handler on for every process the run starts."""
    script = _script()
    args = script.parse_args(["--dry-run"])
    cmd = script.pytest_command(args, tmp_path / "t.json")
    assert cmd[cmd.index("-p") + 1] == "anyio.pytest_plugin"
    assert "faulthandler_timeout=120" in cmd
    assert cmd[cmd.index("--gpu-targets") + 1] == "record"
    strict = script.pytest_command(script.parse_args(["--assert-targets"]), tmp_path / "t.json")
    assert strict[strict.index("--gpu-targets") + 1] == "assert" and "--gpu" in strict
    env = script.child_env(tmp_path)
    assert (env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"], env["PYTHONFAULTHANDLER"]) == ("1", "1")


#: What the GPU machine's offline image lacks (docs/development.md, The GPU run), not carried
#: as wheels either: nothing the GPU suites import at load may need them.
NOT_ON_THE_IMAGE = ("trio", "starlette", "uvicorn", "diffusers", "transformers", "httpx",
                    "hypothesis", "xdist", "pytest_cov")

_WITHOUT = """
import importlib.abc, sys
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not on the GPU image)")
        return None
sys.meta_path.insert(0, Absent())
import pytest
sys.exit(pytest.main(["--collect-only", "-q", "-p", "anyio.pytest_plugin", "-p", "no:cacheprovider",
                      "tests/gpu"]))
"""


def test_the_gpu_suites_load_without_the_packages_the_gpu_image_lacks() -> None:
    """tests/conftest.py, tests/gpu and what they import at load need none of the packages
    the GPU machine's image lacks (a top-level ``import trio`` there stopped the GPU run
    before its first test; the rehearsal on the image's packages found it)."""
    env = {k: v for k, v in os.environ.items() if k != "RESIDENCY_DEVICE_LAYER"}
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    proc = subprocess.run([sys.executable, "-c", _WITHOUT.format(blocked=NOT_ON_THE_IMAGE)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "tests collected" in proc.stdout
