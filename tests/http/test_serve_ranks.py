"""``residency serve --nproc 2``: rank 0 serves HTTP, every call runs on every rank, the
ranks' generations are checked against each other, a dead rank is named, SIGTERM stops all."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from contextlib import AbstractContextManager
from typing import Any

import anyio
import httpx
import pytest

from tests.http.server import serving_ranks

pytestmark = pytest.mark.service



def serving(*args: str, env: dict[str, str] | None = None
            ) -> AbstractContextManager[tuple[subprocess.Popen[str], httpx.Client]]:
    """``residency serve --nproc 2 --port 0 ...`` and a client on it (``serving_ranks``: the
    ranks stopped as users stop them, and their violation reports checked)."""
    return serving_ranks("--collective-timeout", "5", *args, env=env)


def test_every_call_runs_on_every_rank_and_sigterm_stops_them_all() -> None:
    """Generations agree across ranks; release/resume and a tensor update happen on both
    ranks (/state shows each rank); SIGTERM to the server stops every rank, exit 0."""
    with serving("--size", "1MB") as (proc, client):
        gen = client.post("/generate", json={"seed": 2}).json()
        assert gen["ranks_agree"] is True and gen["world_size"] == 2
        assert client.post("/release_memory_occupation", json={}).status_code == 200
        ranks = client.get("/state").json()["ranks"]
        assert {r: s["phase"] for r, s in ranks.items()} == {"0": "sleeping", "1": "sleeping"}
        assert all(s["device_bytes"] == 0 for s in ranks.values())
        assert client.post("/resume_memory_occupation", json={}).status_code == 200
        sums = client.post("/get_weights_checksum", json={}).json()
        assert set(sums) == {"text_encoder", "transformer", "vae"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_ranks_whose_outputs_differ_answer_500() -> None:
    """Rank 1's weights differ from rank 0's: a generation is a 500 saying the ranks'
    outputs differ (a real consistency check, not rank 0's answer alone)."""
    with serving("--pipeline", "tests.http.rank_pipeline:factory",
                 env={"RESIDENCY_TEST_CORRUPT_RANK": "1"}) as (_, client):
        r = client.post("/generate", json={"seed": 0})
        assert r.status_code == 500 and "outputs differ" in r.json()["message"]


def test_a_dead_rank_is_named_by_health_and_control_calls_answer_503() -> None:
    """After rank 1 is killed, /health answers 503 naming it and a release answers 503:
    nothing hangs."""
    with serving("--size", "1MB") as (_, client):
        pid = client.get("/state").json()["ranks"]["1"]["pid"]
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while True:
            health = client.get("/health")
            if health.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert health.status_code == 503 and "[1]" in health.json()["reason"]
        t0 = time.monotonic()
        r = client.post("/release_memory_occupation", json={})
        assert r.status_code == 503 and time.monotonic() - t0 < 30


async def _in_process_ranks() -> tuple[Any, list[Any], list[Any], Any]:
    """Two ranks in this process over one HashStore: the demo pipeline attached on each, and
    rank 0's driver."""
    import torch.distributed as dist

    from lifecycle import LifecycleController
    from lifecycle.demo import DemoPipeline
    from lifecycle.http import demo_generate
    from lifecycle.http._channel import OpChannel
    from lifecycle.http._driver import LocalDriver
    from lifecycle.http._ranks import RankDriver

    store = dist.HashStore()  # type: ignore[attr-defined]
    ctls, locals_ = [], []
    for rank in range(2):
        pipe = DemoPipeline.build(2**18)
        ctl = LifecycleController("cpu", rank=rank)
        await ctl.attach(pipe)
        ctls.append(ctl)
        locals_.append(LocalDriver(ctl, demo_generate(pipe)))
    return store, ctls, locals_, RankDriver(locals_[0], OpChannel(store, 0, 2), timeout=30)


async def _following(tg: Any, store: Any, ctl: Any, local: Any) -> None:
    """Rank 1 following in ``tg``, once its heartbeat is there."""
    from lifecycle.http._channel import OpChannel
    from lifecycle.http._ranks import follow

    tg.start_soon(follow, ctl, local, OpChannel(store, 1, 2))
    while OpChannel(store, 0, 2).silent_ranks():
        await anyio.sleep(0.01)


@pytest.mark.anyio
async def test_a_call_refused_on_rank_0_leaves_no_keys_in_the_ranks_store() -> None:
    """Rank 0 refuses a generation while asleep; the other rank ran the op all the same: its
    answer is collected and the op's keys deleted (a long-lived server refusing generations
    must not grow the store), and the next op runs on both ranks."""
    from lifecycle import ComponentAsleep

    store, ctls, locals_, driver = await _in_process_ranks()
    async with anyio.create_task_group() as tg:
        await _following(tg, store, ctls[1], locals_[1])
        await driver.sleep()
        keys = store.num_keys()
        for _ in range(3):
            with pytest.raises(ComponentAsleep):
                await driver.generate({"seed": 1})
        assert store.num_keys() == keys
        await driver.wake()
        assert (await driver.generate({"seed": 1}))["ranks_agree"] is True
        await driver.stop()
    assert [c.phase.value for c in ctls] == ["uninitialized", "uninitialized"]


@pytest.mark.anyio
async def test_a_rank_answers_an_unexpected_failure_of_an_op_and_keeps_following() -> None:
    """An op that fails on rank 1 with an error no handler expects (a TypeError: arguments
    its dataclass does not take, and a value its run cannot use) is answered with that error,
    and rank 1 goes on following: it runs the next op."""
    from lifecycle.http._channel import OpChannel

    store, ctls, locals_, driver = await _in_process_ranks()
    channel = OpChannel(store, 0, 2)
    async with anyio.create_task_group() as tg:
        await _following(tg, store, ctls[1], locals_[1])
        try:
            for seq, args in enumerate(({"names": 5}, {"names": [], "bogus": 1}), start=1):
                channel.post(seq, {"op": "checksum", "args": args})
                answers = await anyio.to_thread.run_sync(channel.answers, seq, 20.0)
                assert answers[1]["error"] == "TypeError", answers
                channel.forget(seq)
            driver._seq = 2  # the ops posted by hand above
            with anyio.fail_after(30):  # a follower that stopped following: fail, not hang
                state = await driver.state()
            assert state["ranks"]["1"]["phase"] == "awake"
        except BaseException:
            tg.cancel_scope.cancel()  # the follower would wait for rank 0's next op
            raise
        await driver.stop()
    assert [c.phase.value for c in ctls] == ["uninitialized", "uninitialized"]
