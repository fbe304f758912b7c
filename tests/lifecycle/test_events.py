"""configure_logging: JSON lines for machines, no locals in tracebacks, quiet on import."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import structlog

from lifecycle import LifecycleController, configure_logging
from tests.helpers import small_pipeline

pytestmark = pytest.mark.anyio


def test_importing_the_library_does_not_configure_logging() -> None:
    """A fresh interpreter importing lifecycle keeps structlog's defaults."""
    code = ("import structlog; before = structlog.get_config()['processors'];"
            "import lifecycle, strategies;"
            "assert structlog.get_config()['processors'] == before; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


async def test_json_logging_emits_one_object_per_event(capsys: pytest.CaptureFixture[str]) -> None:
    """With json=True each event is one JSON line with level, timestamp and fields."""
    configure_logging(json=True, level="info")
    ctl = LifecycleController("cpu", rank=1)
    await ctl.attach(small_pipeline())
    await ctl.sleep()
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
    summaries = [e for e in lines if e["event"] == "transition.committed"]
    assert [e["trigger"] for e in summaries] == ["attach", "sleep"]
    assert all(e["level"] == "info" and "timestamp" in e and e["rank"] == 1 for e in summaries)
    assert not [e for e in lines if e["event"] == "move.prepared"]  # debug, filtered out


def test_exception_logs_never_render_local_variables(capsys: pytest.CaptureFixture[str]) -> None:
    """A logged exception shows frames but not locals (a local may hold a freed tensor)."""
    configure_logging(json=True, level="info")
    secret = "local-value-that-must-not-appear"  # noqa: F841
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        structlog.get_logger("t").exception("failed")
    out = capsys.readouterr().err
    assert "boom" in out and "local-value-that-must-not-appear" not in out
