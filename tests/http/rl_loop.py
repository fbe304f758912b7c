"""The RL loop of issue 33 over HTTP, in each client's order, with a trainer process that
broadcasts over gloo, while a client generates all along:

* slime (colocated): ``/pause_generation {}`` -> ``/flush_cache`` -> ``/update_weights_from_
  distributed`` (the trainer broadcasting) -> ``/continue_generation {}``;
* TRL: ``/pause?mode=keep`` -> ``/start_weight_update`` -> ``/update_weights`` ->
  ``/finish_weight_update`` -> ``/resume``;
* verl-omni: ``/sleep?level=1`` (a host copy of every weight) -> ``/wake_up?tags=weights`` ->
  ``/start_weight_update`` -> ``/update_weights`` (the transformer only) ->
  ``/finish_weight_update``.

After every round the server's checksums are the trainer's (the transformer's from the
broadcast tensors, the others unchanged); in round ``kill_round`` the trainer is killed in the
middle of its broadcast: the update is rolled back (the checksums are the last round's), a new
trainer joins and the round is done again. Every generation request gets an answer: a 200, or a
refusal saying why (asleep, paused, aborted); none is lost.

    python -m tests.http.rl_loop --rounds 20 --kill-round 10
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import torch

from lifecycle import LifecycleController
from tests.http.clients import reference_checksum
from tests.http.server import Served, running_server
from tests.http.slow_pipeline import factory
from tests.ranks.trainer import Trainer

__all__ = ["CLIENTS", "run_loop"]

CLIENTS = ("slime", "trl", "verl-omni")
GROUPS = {"slime": "weight_update_group", "trl": "vllm_weight_transfer",
          "verl-omni": "vllm_weight_transfer"}
# The refusals a generation may get while a round runs (a 200 otherwise).
REFUSALS = ("Server is sleeping", "aborted", "paused")


def _ok(r: httpx.Response, what: str) -> dict[str, Any]:
    if r.status_code != 200:
        raise AssertionError(f"{what}: {r.status_code} {r.text[:400]}")
    body: dict[str, Any] = r.json()
    return body


@contextmanager
def generating(url: str) -> Iterator[Counter[str]]:
    """A client generating in a loop until the block ends; counts each answer's kind."""
    seen: Counter[str] = Counter()
    stop = threading.Event()

    def loop() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            seed = 0
            while not stop.is_set():
                seed += 1
                try:
                    r = client.post("/generate", json={"seed": seed, "steps": 1})
                except httpx.HTTPError as exc:
                    seen[f"lost: {type(exc).__name__}"] += 1
                    continue
                if r.status_code == 200:
                    seen["served"] += 1
                else:
                    message = str(r.json().get("message"))
                    kind = next((k for k in REFUSALS if k in message), f"other: {message[:80]}")
                    seen[f"{r.status_code} {kind}"] += 1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(60)


class Round:
    """One client's rounds against one server, with one trainer at a time."""

    def __init__(self, s: Served, client: str) -> None:
        self.s, self.client = s, client
        self.http = s.client
        self.trainer: Trainer | None = None
        self.names = [n for n, _ in s.pipe.modules["transformer"].named_parameters()]
        base = dict(s.pipe.modules["transformer"].named_parameters())
        self.base = {n: t.detach().clone() for n, t in base.items()}

    def weights(self, r: int) -> list[tuple[str, torch.Tensor]]:
        return [(n, (self.base[n] + 0.01 * r).contiguous()) for n in self.names]

    def join(self) -> None:
        if self.trainer is not None:
            self.trainer.kill()
        self.trainer = Trainer()
        port = self.trainer.init(world_size=2, group_name=GROUPS[self.client])
        if self.client == "slime":
            self.http.post("/destroy_weights_update_group", json={"group_name": GROUPS["slime"]})
            _ok(self.http.post("/init_weights_update_group", json={
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "group_name": GROUPS["slime"], "backend": "gloo",
                "timeout": 10}), "init group")
        else:
            _ok(self.http.post("/init_weight_transfer_engine", json={"init_info": {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
                "world_size": 2, "timeout": 10}}), "init engine")
        result = self.trainer.result()
        assert result == ("init", "ok"), result

    def metadata(self, named: list[tuple[str, torch.Tensor]], prefix: str) -> dict[str, Any]:
        return {"names": [prefix + n for n, _ in named],
                ("dtypes" if self.client == "slime" else "dtype_names"):
                    [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named]}

    def update(self, r: int, die: bool) -> httpx.Response:
        """The update step of the client's flow (the trainer broadcasting meanwhile)."""
        assert self.trainer is not None
        named = self.weights(r)
        self.trainer.broadcast([t for _, t in named], die_after=len(named) // 2 if die else None)
        if self.client == "slime":
            return self.http.post("/update_weights_from_distributed", json={
                **self.metadata(named, ""), "group_name": GROUPS["slime"],
                "target_modules": ["transformer"], "weight_version": str(r)})
        return self.http.post("/update_weights", json={
            "update_info": self.metadata(named, "transformer.")})

    def round(self, r: int, die: bool) -> bool:
        """One round in the client's order; whether its update was applied."""
        h = self.http
        if self.client == "slime":
            _ok(h.post("/pause_generation", json={}), "pause_generation")
            _ok(h.post("/flush_cache", json={}), "flush_cache")
            done = self.update(r, die)
            _ok(h.post("/continue_generation", json={}), "continue_generation")
        elif self.client == "trl":
            _ok(h.post("/pause", params={"mode": "keep", "clear_cache": "false"}), "pause")
            _ok(h.post("/start_weight_update", json={}), "start")
            done = self.update(r, die)
            if done.status_code == 200:
                _ok(h.post("/finish_weight_update", json={"weight_version": str(r)}), "finish")
            _ok(h.post("/resume", json={}), "resume")
        else:
            _ok(h.post("/sleep", params={"level": 1}), "sleep")
            _ok(h.post("/wake_up", params={"tags": "weights"}), "wake_up")
            _ok(h.post("/start_weight_update", json={}), "start")
            done = self.update(r, die)
            if done.status_code == 200:
                _ok(h.post("/finish_weight_update", json={"weight_version": str(r)}), "finish")
        assert self.trainer is not None
        if not die:
            _ok(done, f"round {r} update")
            assert self.trainer.result()[0] == "broadcast"
            return True
        assert done.status_code == 400 and done.json().get("rolled_back") is True, done.text
        return False

    def checksums(self) -> dict[str, str]:
        sums: dict[str, str] = self.http.post("/get_weights_checksum", json={}).json()
        return sums


def run_loop(client: str, rounds: int, kill_round: int | None,
             report: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """``rounds`` rounds of ``client``'s flow on a fresh server; what happened."""
    pipe, generate = factory()
    ctl = LifecycleController("cpu", admission_timeout=30.0)
    with running_server(pipe, generate, ctl, process_groups=True) as s:  # joins trainers
        loop = Round(s, client)
        loop.join()
        others = {n: v for n, v in loop.checksums().items() if n != "transformer"}
        expected = loop.checksums()
        rolled_back = 0
        t0 = time.perf_counter()
        with generating(s.url) as seen:
            for r in range(1, rounds + 1):
                if r == kill_round:
                    assert not loop.round(r, die=True)
                    assert loop.checksums() == expected, "the killed round was not rolled back"
                    rolled_back += 1
                    loop.join()  # a new trainer; the loop goes on
                assert loop.round(r, die=False)
                expected = {**others, "transformer": reference_checksum(loop.weights(r))}
                assert loop.checksums() == expected, f"round {r}: checksums differ"
                report(f"{client} round {r}: weights equal the trainer's")
        seconds = time.perf_counter() - t0
        if loop.trainer is not None:
            loop.trainer.kill()
    lost = sum(v for k, v in seen.items() if k.startswith(("lost", "other")))
    return {"client": client, "rounds": rounds, "rolled_back": rolled_back,
            "generations": dict(seen), "lost": lost, "seconds": round(seconds, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--kill-round", type=int, default=10)
    ap.add_argument("--clients", nargs="*", default=list(CLIENTS), choices=CLIENTS)
    args = ap.parse_args(argv)
    os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # see tests/ranks/trainer.py
    out = [run_loop(c, args.rounds, args.kill_round, lambda line: print(line, file=sys.stderr))
           for c in args.clients]
    print(json.dumps(out, indent=2))
    return 0 if all(o["lost"] == 0 for o in out) else 1


if __name__ == "__main__":
    sys.exit(main())
