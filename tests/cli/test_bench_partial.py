"""``residency bench partial``: the transformer's release alone against the whole pipeline's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.moves


def test_partial_bench_moves_only_the_transformer_and_keeps_the_weights() -> None:
    """``bench partial --json``: the transformer scope copies and frees fewer bytes than the
    whole pipeline's, every cycle keeps the weights and the image."""
    proc = subprocess.run([sys.executable, "-m", "lifecycle", "bench", "partial", "--size",
                           "4MB", "--device", "cpu", "--repeats", "1", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(proc.stdout)
    whole, alone = doc["scopes"]["whole"], doc["scopes"]["transformer"]
    assert alone["components"] == ["transformer"]
    assert whole["components"] == ["text_encoder", "transformer", "vae"]
    for key in ("release_copied", "release_freed", "resume_copied"):
        assert 0 < alone["bytes"][key] < whole["bytes"][key]
    assert whole["bytes"]["release_freed"] == doc["config"]["nbytes"]
    assert doc["correct"] is True
