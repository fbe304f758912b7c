"""``residency bench residency --compute-heavy``: the configuration where the layerwise target
applies on a GPU, run at a tiny size on the CPU: its modes, each layerwise mode's overhead,
and why the target was not judged there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_compute_heavy_run_reports_each_layerwise_overhead_and_why_it_was_not_judged(
        tmp_path: Path) -> None:
    """On the CPU, the compute-heavy run times resident and the two prefetching layerwise
    modes only, with bit-identical outputs, gives each layerwise mode's overhead over
    resident (as a ratio and in percent, consistent with the forward times), and names why
    the 1.15x target was not judged."""
    proc = subprocess.run(
        [sys.executable, "-m", "lifecycle", "bench", "residency", "--compute-heavy", "--layers", "2",
         "--width", "32", "--tokens", "16", "--repeats", "1", "--device", "cpu", "--json"],
        cwd=tmp_path, env=os.environ | {"PYTHONPATH": str(ROOT)}, capture_output=True,
        text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert (doc["profile"], doc["layers"], doc["width"], doc["tokens"]) == ("compute-heavy", 2, 32, 16)
    assert sorted(doc["modes"]) == ["layerwise p1", "layerwise p2", "resident"]
    assert doc["mismatched"] == []
    assert sorted(doc["overhead"]) == ["layerwise p1", "layerwise p2"]
    p1, resident = doc["modes"]["layerwise p1"], doc["modes"]["resident"]
    ratio = p1["fwd_ms"] / resident["fwd_ms"]
    assert abs(doc["overhead"]["layerwise p1"]["fwd_x_resident"] - ratio) < 1e-9
    assert abs(doc["overhead"]["layerwise p1"]["fwd_overhead_pct"] - 100 * (ratio - 1)) < 1e-6
    targets = doc["targets"]
    assert targets["layerwise_target"] == 1.15 and targets["layerwise_target_applies"] is False
    assert targets["layerwise_target_reason"] == "the CPU stand-in: timings are not the target's"
    assert targets["offload_use_ms"] is None and targets["reference_use_ms"] is None
