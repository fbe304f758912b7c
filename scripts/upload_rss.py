"""Peak memory of ``residency serve`` per tensor upload: the request body's size against the
growth of the server process's peak resident set (``VmHWM``, reset before each upload by
writing 5 to ``/proc/PID/clear_refs``; Linux only).

    python scripts/upload_rss.py [--size 160MB] [--formats safetensors,pickle]

Starts ``residency serve`` on 127.0.0.1 with the demo pipeline of ``--size``, then uploads the
transformer's whole state (a real update: the peak includes the weights it replaces) in each
format, and a tensor of the transformer's size under a name that matches nothing (decoded,
then refused: the decoding alone). Prints one line per upload.
"""

from __future__ import annotations

import argparse
import base64
import pickle
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import safetensors.torch
import torch

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20


def status(pid: int, field: str) -> int:
    """``VmRSS`` / ``VmHWM`` of ``pid`` in bytes."""
    text = Path(f"/proc/{pid}/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert found is not None, field
    return int(found.group(1)) * 1024


def reset_peak(pid: int) -> int:
    """Reset ``pid``'s peak RSS to its current RSS; returns that RSS."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return status(pid, "VmRSS")


def encode(tensors: dict[str, torch.Tensor], fmt: str) -> bytes:
    if fmt == "safetensors":
        return safetensors.torch.save(tensors)
    return pickle.dumps(list(tensors.items()))  # plain pickle: the data travels in the payload


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="160MB", help="demo pipeline size (the transformer is ~90%%)")
    ap.add_argument("--formats", default="safetensors,pickle")
    args = ap.parse_args()
    proc = subprocess.Popen([sys.executable, "-m", "lifecycle", "serve", "--port", "0",
                             "--device", "cpu", "--size", args.size],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert proc.stdout is not None
        found = re.search(r"http://127\.0\.0\.1:(\d+)", proc.stdout.readline())
        assert found is not None, "the server did not start"
        url = f"http://127.0.0.1:{found.group(1)}"
        with httpx.Client(base_url=url, timeout=600) as client:
            from lifecycle._units import parse_size
            from lifecycle.demo import DemoPipeline

            state = {k: v + 0.5 for k, v in DemoPipeline.build(parse_size(args.size))
                     .modules["transformer"].state_dict().items()}
            nbytes = sum(t.nbytes for t in state.values())
            probe = {"no_such_tensor": torch.ones(nbytes // 4)}
            print(f"server pid {proc.pid}; transformer {nbytes / MiB:.1f} MiB")
            print(f"{'upload':<34} {'status':>6} {'body MiB':>9} {'peak growth MiB':>16} "
                  f"{'x body':>7}")
            for fmt in args.formats.split(","):
                for label, tensors in ((f"{fmt}, whole transformer", state),
                                       (f"{fmt}, unknown name (decode only)", probe)):
                    body = b'{"serialized_named_tensors": ["' + base64.b64encode(
                        encode(tensors, fmt)) + b'"], "target_modules": ["transformer"]}'
                    base = reset_peak(proc.pid)
                    t0 = time.perf_counter()
                    r = client.post("/update_weights_from_tensor", content=body,
                                    headers={"content-type": "application/json"})
                    seconds = time.perf_counter() - t0
                    growth = status(proc.pid, "VmHWM") - base
                    print(f"{label:<34} {r.status_code:>6} {len(body) / MiB:>9.1f} "
                          f"{growth / MiB:>16.1f} {growth / len(body):>7.2f}  ({seconds:.1f} s)")
                    del body
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
