"""``residency bench mirrors``, ``weight-sync`` and ``chunks``, and the rule that every
benchmark is a ``residency bench`` subcommand (none lives in ``scripts/``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lifecycle.cli import parse as cli_parse

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20


def bench(*argv: str) -> dict[str, Any]:
    """``python -m lifecycle bench ARGV --json`` in a fresh interpreter: its JSON document."""
    proc = subprocess.run([sys.executable, "-m", "lifecycle", "bench", *argv, "--json"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


def test_no_benchmark_lives_in_scripts() -> None:
    """Benchmarks have one entry point, ``residency bench``: no ``scripts/bench_*.py``."""
    assert sorted(p.name for p in (ROOT / "scripts").glob("bench_*")) == []


@pytest.mark.parametrize(("which", "defaults"), [
    ("mirrors", {"size": "256MiB", "repeats": 5}),
    ("weight-sync", {"size": "256MiB", "tensors": 64, "repeats": 5,
                     "buckets": "16MiB,64MiB,256MiB", "pause": 0.0}),
    ("chunks", {"size": "1GiB", "repeats": 3, "device": None, "malloc": "keep"})])
def test_each_new_benchmark_has_its_own_defaults(which: str, defaults: dict[str, Any]) -> None:
    """Each subcommand takes its own defaults; the host-only ones have no ``--device``."""
    args = cli_parse(["bench", which])
    assert args.which == which and args.json is False
    assert {k: getattr(args, k) for k in defaults} == defaults
    assert hasattr(args, "device") == (which == "chunks")


def test_mirrors_bench_times_both_mappings() -> None:
    """``bench mirrors --json``: the size asked for, and both mappings' first write and
    rewrite as positive rates."""
    doc = bench("mirrors", "--size", "4MiB", "--repeats", "1")
    assert doc["bytes"] == 4 * MiB
    for name in ("shared", "private_hugepage"):
        assert set(doc[name]) == {"first_write_gbps", "rewrite_gbps"}
        assert all(rate > 0 for rate in doc[name].values())


@pytest.mark.moves
def test_weight_sync_bench_lands_exact_weights_within_the_bucket() -> None:
    """``bench weight-sync --json`` (tiny sizes) compares both paths, lands exact weights and
    keeps staging within the bucket. A fresh interpreter: its trainer is forked from a
    process that has not used torch.distributed yet (a fork of this one, which has, could
    inherit its state half-way)."""
    doc = bench("weight-sync", "--size", "2MiB", "--tensors", "4", "--repeats", "1",
                "--buckets", "1MiB")
    assert doc["exact"] is True and doc["ratio"] > 0
    assert (doc["tensors"], doc["rounds"]) == (8, 1)  # a bias per weight
    assert len(doc["plain_seconds"]) == len(doc["update_seconds"]) == 1
    assert [row["bucket_bytes"] for row in doc["staging"]] == [MiB]
    assert 0 < doc["staging"][0]["peak_staging_bytes"] <= MiB


@pytest.mark.moves
def test_chunks_bench_times_both_copy_loops_on_the_same_bytes() -> None:
    """``bench chunks --json``: both variants' dirty sleep and wake as positive rates over
    the pipeline's device bytes, the ratio two / one of those rates."""
    doc = bench("chunks", "--size", "4MB", "--device", "cpu", "--repeats", "1")
    assert (doc["device"], doc["rounds"], doc["chunk_bytes"]) == ("cpu", 1, 256 * MiB)
    assert 0 < doc["bytes"] < 8 * 10**6
    one, two = doc["gbps"]["one in flight"], doc["gbps"]["two in flight"]
    for what in ("sleep", "wake"):
        assert one[what] > 0 and two[what] > 0
        assert doc["ratio"][what] == pytest.approx(two[what] / one[what])


def test_every_benchmark_subcommand_runs_its_own_module() -> None:
    """``residency bench WHICH`` names one module of lifecycle.cli with a ``run``, for every
    subcommand but ``all`` (sleep-wake, then update)."""
    import importlib

    from lifecycle.cli import BENCHMARKS, _parser

    commands = next(a for a in _parser()._actions if a.dest == "command")
    assert isinstance(commands.choices, dict)
    which = next(a for a in commands.choices["bench"]._actions if a.dest == "which")
    assert isinstance(which.choices, dict) and set(which.choices) == {*BENCHMARKS, "all"}
    for module in BENCHMARKS.values():
        assert callable(importlib.import_module(f"lifecycle.cli.{module}").run)
