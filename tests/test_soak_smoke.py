"""A 30-cycle run of scripts/soak.py with injected faults: every integrity check passes.

The RSS growth target is not checked here: soak.py applies it only from 1000 cycles on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


def test_soak_smoke_with_faults_keeps_integrity() -> None:
    """A 30-cycle soak with a fault every 7 cycles exits 0 with every integrity check passing and the
    faults counted."""
    proc = subprocess.run([sys.executable, str(SOAK), "--cycles", "30", "--size", "4MB", "--json",
                           "--fault-every", "7", "--device", "cpu"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    res = json.loads(proc.stdout)
    assert res["ok"] is True
    assert res["integrity"] and all(res["integrity"].values()), res["failures"]
    assert set(res["integrity"]) >= {"outputs", "phases", "device_bytes", "checksums", "in_flight",
                                     "faults"}
    assert res["failures"] == []
    # cycles 7 and 21 fail a sleep, 14 and 28 an update (which may absorb a fault after its commit)
    assert res["faults"]["sleep"] == 2 and sum(res["faults"].values()) == 4
    assert res["growth_check"].startswith("skipped")
    assert res["host_bytes"] >= res["config"]["nbytes"] and res["pinned_bytes"] == 0
    assert res["cycles_per_second"] > 0
    assert all(v is not None and v > 0 for v in res["phase_ms"].values())
