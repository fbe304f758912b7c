"""lifecycle.payload, the decoding of tensor uploads, stands without the HTTP service."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Run in a fresh interpreter: a finder refuses starlette and uvicorn as if they were not
# installed, then the package is imported and used.
_PROBE = textwrap.dedent("""
    import sys

    BLOCKED = ("starlette", "uvicorn")

    class Absent:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None

    sys.meta_path.insert(0, Absent())
    import base64
    import safetensors.torch, torch
    import lifecycle.payload as payload

    data = safetensors.torch.save({"w": torch.arange(6.0).reshape(2, 3)})
    named = payload.decode_named_tensors(base64.b64encode(data).decode(), "safetensors")
    assert [(n, t.tolist()) for n, t in named] == [("w", [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]])]
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    try:
        import starlette  # noqa: F401
    except ModuleNotFoundError:
        print("ok")
""")


def test_payload_decodes_with_starlette_and_uvicorn_absent() -> None:
    """With starlette and uvicorn impossible to import, lifecycle.payload imports and decodes
    an upload, and pulls neither in (the finder proves the block works: starlette fails)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
