"""Load test of ``residency serve`` on loopback: generations from many clients while a trainer
loop releases, resumes and pushes weights, as an RL run does.

    .venv/bin/python scripts/load_http.py [--clients 16] [--cycles 200] [--size 4MB]
        [--max-seconds 600] [--json]

Starts ``python -m lifecycle serve --port 0`` on 127.0.0.1 (nothing else is ever contacted),
then runs ``--clients`` threads posting ``/generate`` in a loop while one trainer thread does
``--cycles`` times: release, resume, push the transformer's weights (base64 safetensors, as
the README's client does) and check ``/get_weights_checksum`` against the checksum of the
pushed weights computed locally. Bounded in count and in time (``--max-seconds``); stops the
server with SIGTERM. Exit 1 on any 5xx, any answer inconsistent with the phase (a generation
refused for another reason than sleeping, a control call not 200) or any checksum mismatch.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import anyio
import httpx
import torch
from safetensors.torch import save

from lifecycle import LifecycleController
from lifecycle._units import parse_size
from lifecycle.demo import DemoPipeline

ROOT = Path(__file__).resolve().parents[1]
SLEEPING = "Server is sleeping. Call resume_memory_occupation first."


def start_server(size: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "lifecycle", "serve", "--port", "0",
                             "--host", "127.0.0.1", "--size", size], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    if found is None:
        proc.kill()
        raise SystemExit(f"server did not start: {line!r}")
    return proc, f"http://127.0.0.1:{found.group(1)}"


def expected_checksum(reference: DemoPipeline, state: dict[str, torch.Tensor]) -> str:
    """The checksum the server must report once ``state`` is its transformer's weights."""
    reference.modules["transformer"].load_state_dict(state, strict=False)

    async def run() -> str:
        async with LifecycleController("cpu") as ctl:
            await ctl.attach({"transformer": reference.modules["transformer"]})
            return ctl.weights_checksum(["transformer"])["transformer"]

    return anyio.run(run)


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--cycles", type=int, default=200)
    ap.add_argument("--size", default="4MB")
    ap.add_argument("--max-seconds", type=float, default=600)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    proc, url = start_server(args.size)
    reference = DemoPipeline.build(parse_size(args.size))  # same seed as the server's
    stop = threading.Event()
    lock = threading.Lock()
    latency: dict[str, list[float]] = defaultdict(list)
    statuses: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    problems: list[str] = []
    t_end = time.monotonic() + args.max_seconds

    def record(name: str, r: httpx.Response, seconds: float) -> None:
        with lock:
            latency[name].append(seconds)
            statuses[name][r.status_code] += 1
            if r.status_code >= 500:
                problems.append(f"{name}: {r.status_code} {r.text[:200]}")

    def client_loop(i: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            seed = i
            while not stop.is_set() and time.monotonic() < t_end:
                t0 = time.perf_counter()
                r = c.post("/generate", json={"seed": seed % 7, "steps": 1})
                record("generate", r, time.perf_counter() - t0)
                if r.status_code == 400 and r.json().get("message") != SLEEPING:
                    with lock:
                        problems.append(f"generate refused: {r.text[:200]}")
                elif r.status_code not in (200, 400):
                    with lock:
                        problems.append(f"generate: {r.status_code} {r.text[:200]}")
                seed += 1

    def control(c: httpx.Client, path: str, body: dict[str, object]) -> httpx.Response:
        t0 = time.perf_counter()
        r = c.post(path, json=body)
        record(path.strip("/"), r, time.perf_counter() - t0)
        if r.status_code != 200:
            with lock:
                problems.append(f"{path}: {r.status_code} {r.text[:200]}")
        return r

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(args.clients)]
    t_start = time.perf_counter()
    for t in threads:
        t.start()
    cycles = 0
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            base = {k: v.clone() for k, v in reference.modules["transformer"].state_dict().items()}
            for k in range(1, args.cycles + 1):
                if time.monotonic() >= t_end:
                    break
                control(c, "/release_memory_occupation", {})
                control(c, "/resume_memory_occupation", {})
                state = {n: (v + 1e-3 * k).contiguous() if v.is_floating_point() else v
                         for n, v in base.items()}
                payload = base64.b64encode(save(state)).decode()
                control(c, "/update_weights_from_tensor",
                        {"serialized_named_tensors": [payload], "load_format": "safetensors",
                         "target_modules": ["transformer"]})
                got = control(c, "/get_weights_checksum", {"module_names": ["transformer"]})
                if got.json().get("transformer") != expected_checksum(reference, state):
                    problems.append(f"cycle {k}: checksum differs from the pushed weights")
                cycles = k
    finally:
        stop.set()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t_start
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    total = sum(len(v) for v in latency.values())
    report = {
        "clients": args.clients, "cycles": cycles, "seconds": round(wall, 2),
        "requests": total, "requests_per_second": round(total / wall, 1),
        "server_exit": code, "problems": problems[:20], "problem_count": len(problems),
        "calls": {name: {"count": len(v), "p50_ms": round(1e3 * statistics.median(v), 2),
                         "p99_ms": round(1e3 * pct(v, 0.99), 2),
                         "statuses": dict(statuses[name])}
                  for name, v in latency.items()}}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{cycles} trainer cycles, {args.clients} clients, {total} requests in {wall:.1f} s "
              f"({report['requests_per_second']} req/s); server exited {code}")
        print(f"{'call':<28}{'count':>8}{'p50 ms':>10}{'p99 ms':>10}  statuses")
        for name, row in report["calls"].items():
            print(f"{name:<28}{row['count']:>8}{row['p50_ms']:>10}{row['p99_ms']:>10}  "
                  f"{row['statuses']}")
        print("PASS: no 5xx, every answer consistent, checksums equal" if not problems
              else f"FAIL: {len(problems)} problem(s): {problems[:5]}")
    return 0 if not problems and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
