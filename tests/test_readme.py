"""The README stays true: its example runs, its diagram is current, its commands exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_embedded_example_runs_as_written() -> None:
    """The Python block of the README runs to completion in a fresh interpreter."""
    code = re.search(r"```python\n(.*?)```", README, re.S)
    assert code is not None
    done = subprocess.run([sys.executable, "-c", code.group(1)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "success=True" in done.stdout


def test_state_diagram_is_generated_from_the_transition_table() -> None:
    """scripts/gen_diagram.py --check passes: the diagram matches lifecycle._phase."""
    done = subprocess.run([sys.executable, "scripts/gen_diagram.py", "--check"], cwd=ROOT,
                          timeout=60)
    assert done.returncode == 0, "run: python scripts/gen_diagram.py"


def test_every_script_and_file_the_readme_names_exists() -> None:
    """Commands and paths in the README point at files that exist."""
    pattern = r"(?<![\w/])((?:scripts|lifecycle|tests)/[\w./-]+\.(?:py|toml)|scripts/\w+)"
    for path in set(re.findall(pattern, README)):
        assert (ROOT / path).exists(), path
