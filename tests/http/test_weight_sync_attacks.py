"""The weight update group routes under attack (issue 29): ``residency serve`` in a subprocess
and a real trainer process on gloo (tests/ranks/trainer.py) that broadcasts whatever it is
told, plus stores that misbehave (silent, a banner, a store nobody joins). Each case gets a
4xx, never a 5xx, a hang or a dead server; weights, version and phase stay as they were;
``/health`` answers within a second throughout; the server's RSS and open files stay
bounded; and a broken group is usable again after a destroy and a new init."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import torch.distributed as dist

from lifecycle import LifecycleController
from lifecycle.demo import DemoPipeline
from tests.http.attacks import MiB, Target, b64, health_watch, serve
from tests.http.server import running_server
from tests.ranks.trainer import Trainer, free_port

# Not marked `service` or `moves`: the cuda-sim pass does not rerun the service's attack
# suites (scripts/test); the server's device work here is an update like any other.

GROUP = "weight_update_group"
DNS = {"RES_OPTIONS": "timeout:1 attempts:1"}  # see tests/ranks/trainer.py
BIAS, WEIGHT = "x_proj.bias", "x_proj.weight"  # float32 (64,) and (64, 16) in the demo (1MB)


@pytest.fixture(autouse=True)
def _quick_dns(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in DNS.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """One server for the suite (each test leaves no group behind), group routes opted in,
    a short drain timeout."""
    os.environ.update(DNS)
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with serve(log, "--allow-process-groups", "--drain-timeout", "2") as target:
        yield target


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.fixture
def bounded(server: Target) -> Iterator[None]:
    """Around a test: the server still answers, holds no group, and its open files and RSS
    came back to about where they were."""
    rss, files = server.status("VmRSS"), fds(server.pid)
    yield
    assert server.proc.poll() is None, server.log.read_text()[-3000:]
    server.client.post("/destroy_weights_update_group", json={"group_name": GROUP})
    assert server.client.get("/state").json()["weight_update_groups"] == {}
    deadline = time.monotonic() + 5
    while fds(server.pid) > files + 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # a receiving process being reaped
    assert fds(server.pid) <= files + 2
    assert server.status("VmRSS") - rss < 48 * MiB


def init_body(port: int, **extra: Any) -> dict[str, Any]:
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": GROUP, "backend": "gloo", "timeout": 10, **extra}


def post(server: Target, path: str, body: Any) -> httpx.Response:
    return server.client.post(path, json=body)


@contextmanager
def trainer_in(server: Target) -> Iterator[Trainer]:
    """A trainer process joined with the server in a new group; closed after."""
    trainer = Trainer()
    try:
        port = trainer.init()
        r = post(server, "/init_weights_update_group", init_body(port))
        assert r.status_code == 200, r.text
        assert trainer.result() == ("init", "ok")
        yield trainer
    finally:
        trainer.close()


def announce(specs: list[tuple[str, str, list[int]]], **extra: Any) -> dict[str, Any]:
    return {"names": [n for n, _, _ in specs], "dtypes": [d for _, d, _ in specs],
            "shapes": [s for _, _, s in specs], "group_name": GROUP,
            "target_modules": ["transformer"], **extra}


def attack(server: Target, trainer: Trainer | None, sent: list[torch.Tensor],
           body: dict[str, Any], status: int, message: str, *,
           path: str = "/update_weights_from_distributed") -> httpx.Response:
    """The trainer broadcasts ``sent`` while ``body`` is posted: ``status`` with ``message``
    in the answer, weights, version and phase as before, /health under 1 s meanwhile."""
    before = server.snapshot()
    with health_watch(server.url) as latencies:
        if trainer is not None and sent:
            trainer.broadcast(sent)
        r = post(server, path, body)
    assert r.status_code == status, r.text[:2000]
    assert message in r.json()["message"], r.json()
    assert server.snapshot() == before
    assert latencies and max(latencies) < 1.0, latencies
    return r


def broken(server: Target) -> str:
    reason: str = server.client.get("/state").json()["weight_update_groups"][GROUP]["broken"]
    assert reason is not None
    return reason


def usable_again(server: Target) -> None:
    """Destroy the broken group, init it with a new trainer, and an honest update lands."""
    assert post(server, "/destroy_weights_update_group", {}).status_code == 200
    with trainer_in(server) as trainer:
        value = torch.full((64,), 7.0)
        trainer.broadcast([value])
        r = post(server, "/update_weights_from_distributed",
                 announce([(BIAS, "float32", [64])], weight_version="again"))
        assert r.status_code == 200, r.text
        assert trainer.result()[0] == "broadcast"
        assert server.client.get("/get_weight_version").json() == {"weight_version": "again"}
    assert post(server, "/destroy_weights_update_group", {}).status_code == 200


@pytest.mark.parametrize(("sent", "how"), [
    (torch.zeros(64, dtype=torch.float64), "float64[64] (gloo's abort)"),
    (torch.zeros(72), "float32[72] (32 bytes into the canary slack)")], ids=["double", "long"])
def test_1_a_broadcast_longer_than_announced_breaks_the_group_not_the_server(
        server: Target, bounded: None, sent: torch.Tensor, how: str) -> None:
    """x_proj.bias announced float32[64], broadcast as float64[64] (the receiving process
    aborts) or float32[72]: 400 rolled back, the group broken, the server alive."""
    with trainer_in(server) as trainer:
        r = attack(server, trainer, [sent], announce([(BIAS, "float32", [64])]), 400,
                   "update failed and was rolled back; weights are unchanged: "
                   "WeightSyncTransferFailed")
        assert r.json()["rolled_back"] is True, how
        reason = broken(server)
        assert "tensor 1/1 'x_proj.bias'" in reason
        assert ("longer than announced" in reason) if sent.numel() == 72 else \
            ("died (SIGABRT)" in reason)
    usable_again(server)


def test_2_a_short_broadcast_is_refused_before_anything_is_written(
        server: Target, bounded: None) -> None:
    """float32[56] for a float32[64] target: 400 (it was a 200 with stale bytes), rolled
    back, the group broken."""
    with trainer_in(server) as trainer:
        attack(server, trainer, [torch.ones(56)], announce([(BIAS, "float32", [64])]), 400,
               "was shorter than announced")
        assert "shorter than announced" in broken(server)
    usable_again(server)


class Store:
    """A TCP listener on 127.0.0.1 that misbehaves: ``silent`` accepts and never answers,
    ``banner`` sends an SSH banner and keeps the connection open."""

    def __init__(self, kind: str) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.kind = kind
        self.held: list[socket.socket] = []
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            if self.kind == "banner":
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
            self.held.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@contextmanager
def listening(kind: str) -> Iterator[int]:
    """A port where ``kind`` listens: closed, silent, a banner, or a real store nobody joins
    (it answers the store's handshake; the group never forms)."""
    if kind == "closed":
        yield free_port()
    elif kind == "store":
        store_class: Any = dist.TCPStore  # type: ignore[attr-defined]
        store = store_class("127.0.0.1", 0, 2, True, timedelta(seconds=30),
                            wait_for_workers=False)
        yield int(store.port)
        del store
    else:
        listener = Store(kind)
        try:
            yield listener.port
        finally:
            listener.close()


def test_3_a_join_keeps_its_deadline_holds_no_lock_and_shutdown_keeps_the_drain(
        server: Target, bounded: None) -> None:
    """An init (timeout 1) against a store that accepts and never answers, and one that
    answers the handshake and then nobody joins: 400 after about 1 s (it hung as long as the
    peer held the socket), while /state and a destroy of another group answer at once."""
    for kind in ("silent", "store"):
        with listening(kind) as port:
            answers: list[httpx.Response] = []
            t0 = time.monotonic()
            thread = threading.Thread(target=lambda out=answers, p=port: out.append(post(
                server, "/init_weights_update_group", init_body(p, timeout=1))))
            with health_watch(server.url) as latencies:
                thread.start()
                time.sleep(0.2)
                t1 = time.monotonic()
                other = post(server, "/destroy_weights_update_group", {"group_name": "other"})
                assert other.status_code == 200 and time.monotonic() - t1 < 1.0
                assert server.client.get("/state").status_code == 200
                thread.join(30)
            assert 1.0 <= time.monotonic() - t0 < 5.0, kind
            assert answers[0].status_code == 400
            assert answers[0].json()["message"].endswith("no trainer store completed the "
                                                         "rendezvous there within 1 s")
            assert max(latencies) < 1.0


def test_3b_sigterm_during_a_stalled_broadcast_answers_json_within_the_drain(
        tmp_path: Path) -> None:
    """SIGTERM with --drain-timeout 3 while a trainer stalls mid-broadcast (update timeout
    60): the update answers a JSON 400, rolled back, within the drain, and the server exits
    0 soon after (it took 55 s and answered a non-JSON 500)."""
    with serve(tmp_path / "stderr.log", "--allow-process-groups", "--drain-timeout", "3") \
            as target, trainer_in(target) as trainer:
        trainer.broadcast([torch.zeros(64), torch.zeros(64, 16)], stall_after=1)
        answers: list[httpx.Response] = []
        thread = threading.Thread(target=lambda: answers.append(post(
            target, "/update_weights_from_distributed",
            announce([(BIAS, "float32", [64]), (WEIGHT, "float32", [64, 16])], timeout=60))))
        thread.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        target.proc.send_signal(signal.SIGTERM)
        thread.join(30)
        assert time.monotonic() - t0 < 4.0
        assert answers[0].status_code == 400 and answers[0].json()["rolled_back"] is True
        assert "the server is shutting down" in answers[0].json()["message"]
        assert target.proc.wait(15) == 0


def test_4_world_size_is_bounded_before_anything_is_built(server: Target,
                                                          bounded: None) -> None:
    """world_size 400000 (gloo built a connection object per rank, +557 MiB): 400 naming
    the bound, no growth."""
    with server.peak() as peak:
        attack(server, None, [], init_body(free_port(), world_size=400_000), 400,
               "world_size must be at most 1024 (max_world_size), got 400000",
               path="/init_weights_update_group")
    assert peak[0] < 16 * MiB


def test_5_a_refused_update_is_drained_outside_the_server_and_keeps_nothing(
        server: Target, bounded: None) -> None:
    """An unknown 64 MiB tensor broadcast: 400 naming it; the server's peak RSS does not
    grow by it (it is drained in the group's receiving process, then freed) and its staging
    stays as it was; the group stays usable."""
    with trainer_in(server) as trainer:
        staging = server.client.get("/state").json()["weight_update_groups"][GROUP]
        with server.peak() as peak:
            attack(server, trainer, [torch.zeros(16 * MiB)],
                   announce([("nope", "float32", [16 * MiB])]), 400,
                   "1 name(s) match no parameter or buffer of transformer: ['nope']")
        assert trainer.result()[0] == "broadcast"
        assert peak[0] < 16 * MiB
        after = server.client.get("/state").json()["weight_update_groups"][GROUP]
        assert (after["broken"], after["staging_bytes"]) == (None, staging["staging_bytes"])
        trainer.broadcast([torch.full((64,), 3.0)])
        assert post(server, "/update_weights_from_distributed",
                    announce([(BIAS, "float32", [64])])).status_code == 200


def test_6_groups_are_bounded_and_each_costs_a_few_files(server: Target,
                                                         bounded: None) -> None:
    """Eight joins at once (the bound) against silent stores, then a ninth: 400 naming
    max_groups at once; the server holds a few files per group (the listener kept
    working), and none after the joins ended."""
    files = fds(server.pid)
    with listening("silent") as port:
        answers: list[httpx.Response] = []
        threads = [threading.Thread(target=lambda i=i: answers.append(post(
            server, "/init_weights_update_group",
            init_body(port, group_name=f"g{i}", timeout=5)))) for i in range(8)]
        for t in threads:
            t.start()
        time.sleep(1.5)  # the eight are reserved (each joins for 5 s)
        t0 = time.monotonic()
        r = post(server, "/init_weights_update_group",
                 init_body(port, group_name="ninth", timeout=3))
        assert r.status_code == 400 and time.monotonic() - t0 < 1.0
        assert r.json()["message"] == "this server rank holds 8 weight update group(s), its " \
                                      "bound (max_groups): destroy one first"
        assert fds(server.pid) <= files + 8 * 4
        for t in threads:
            t.join(30)
    assert [a.status_code for a in answers] == [400] * 8


@pytest.mark.parametrize("kind", ["closed", "silent", "banner", "store"])
def test_7_a_join_tells_nothing_of_what_listens_there(server: Target, bounded: None,
                                                      kind: str) -> None:
    """Closed, silent, banner and real-store ports answer the same message after the same
    time (about the timeout): no port scan, no echo of the peer's bytes or of a PID."""
    with listening(kind) as port:
        t0 = time.monotonic()
        r = attack(server, None, [], init_body(port, timeout=1), 400,
                   "", path="/init_weights_update_group")
        assert 1.0 <= time.monotonic() - t0 < 4.0
    assert r.json()["message"] == (
        f"Failed to initialize weight update group 'weight_update_group' at 127.0.0.1:{port} "
        f"as rank 1 of 2: no trainer store completed the rendezvous there within 1 s")


@pytest.mark.parametrize(("address", "message"), [
    ("127.0.0.1\u0000.evil", "master_address must be an IP address such as '127.0.0.1'"),
    ("10.0.0.1", "master_address 10.0.0.1 is not in the trainer networks this server accepts "
                 "['127.0.0.0/8', '::1/128']"),
    ("example.com", "(host names are not resolved)")], ids=["nul", "not-loopback", "name"])
def test_7b_master_address_is_an_allowed_ip_address(server: Target, bounded: None,
                                                    address: str, message: str) -> None:
    """A NUL inside the address (it connected to 127.0.0.1 while /state showed the whole
    string), an address outside the allow list, a host name: 400 at once."""
    body = {**init_body(free_port()), "master_address": address}
    attack(server, None, [], body, 400, message, path="/init_weights_update_group")


def test_8_a_lora_rank_past_the_weight_and_an_infinite_merge_are_400s(
        server: Target, bounded: None) -> None:
    """lora_rank 2**30 (a 500 that broke the group) is refused naming min(out, in); the
    adapter cannot be drained, so the group breaks. lora_alpha=1e308 with a real adapter:
    rolled back (it committed inf weights), a 400, the group still usable."""
    a, b = "x_proj.lora_A.weight", "x_proj.lora_B.weight"
    with trainer_in(server) as trainer:
        attack(server, trainer, [torch.ones(4, 16), torch.ones(64, 4)],
               announce([(a, "float32", [4, 16]), (b, "float32", [64, 4])],
                        weight_update_mode="lora_merge", lora_alpha=1e308, lora_rank=4), 400,
               "LoraMergeNotFinite: the merge (scale 2.5e+307) makes values that are not "
               "finite in torch.float32")
        assert trainer.result()[0] == "broadcast"
        assert server.client.get("/state").json()["weight_update_groups"][GROUP]["broken"] \
            is None
        attack(server, trainer, [], announce(
            [(a, "float32", [2**30, 16]), (b, "float32", [64, 2**30])],
            weight_update_mode="lora_merge", lora_rank=2**30), 400,
            "x_proj: the adapter's rank 1073741824 is over min(out, in) = 16 of W [64, 16]")
        assert "cannot be received here" in broken(server)
    usable_again(server)


@pytest.mark.parametrize("path", ["/update_weights_from_tensor",
                                  "/update_weights_from_distributed",
                                  "/update_weights_from_disk"])
def test_9_a_weight_version_over_the_cap_is_refused_on_every_route(
        server: Target, bounded: None, path: str) -> None:
    """A 5000-character weight_version (silently replaced by the parser's placeholder on
    tensor uploads): 400 naming the cap on every update route."""
    bodies = {"/update_weights_from_tensor": {"serialized_named_tensors": [b64(b"x" * 3000)]},
              "/update_weights_from_distributed": announce([(BIAS, "float32", [64])]),
              "/update_weights_from_disk": {"model_path": "/nonexistent"}}
    attack(server, None, [], {**bodies[path], "weight_version": "v" * 5000}, 400,
           "weight_version is 5000 ", path=path)


def test_9b_a_weight_version_at_the_cap_is_kept_as_sent(server: Target,
                                                       bounded: None) -> None:
    """1024 characters, the cap: kept exactly."""
    version = "é" + "v" * 1023
    with trainer_in(server) as trainer:
        trainer.broadcast([torch.full((64,), 2.0)])
        r = post(server, "/update_weights_from_distributed",
                 announce([(BIAS, "float32", [64])], weight_version=version))
        assert r.status_code == 200, r.text
    assert server.client.get("/get_weight_version").json() == {"weight_version": version}


def test_10_a_trickling_trainer_holds_a_release_no_longer_than_the_drain(
        server: Target, bounded: None) -> None:
    """A trainer that stalls after one tensor (update timeout 4, the whole update's): a
    release meanwhile answers 409 after the drain timeout (2 s; it waited 44 s), the update a
    400 rolled back at its deadline, the phase unchanged."""
    with trainer_in(server) as trainer:
        trainer.broadcast([torch.zeros(64), torch.zeros(64, 16)], stall_after=1)
        answers: list[httpx.Response] = []
        t0 = time.monotonic()
        thread = threading.Thread(target=lambda: answers.append(post(
            server, "/update_weights_from_distributed",
            announce([(BIAS, "float32", [64]), (WEIGHT, "float32", [64, 16])], timeout=4))))
        with health_watch(server.url) as latencies:
            thread.start()
            time.sleep(0.3)
            release = post(server, "/release_memory_occupation", {})
            assert release.status_code == 409 and time.monotonic() - t0 < 3.5, release.text
            thread.join(30)
        assert 3.9 < time.monotonic() - t0 < 7.0
        assert answers[0].status_code == 400 and "deadline passed at tensor 2/2" in \
            answers[0].json()["message"]
        assert server.client.get("/state").json()["phase"] == "awake"
        assert max(latencies) < 1.0
    usable_again(server)


@pytest.mark.parametrize("case", ["extra", "reordered"])
def test_10b_extra_and_reordered_broadcasts_are_refused(server: Target, bounded: None,
                                                        case: str) -> None:
    """An extra broadcast after an update (it shifted the next update's weights) is caught
    by the next update's first receive; a reordered pair of different sizes by its own:
    400, rolled back, the group broken."""
    bias, weight = torch.full((64,), 5.0), torch.full((64, 16), 5.0)
    with trainer_in(server) as trainer:
        if case == "extra":
            trainer.broadcast([bias, weight])  # one more than the update announces
            r = post(server, "/update_weights_from_distributed",
                     announce([(BIAS, "float32", [64])]))
            assert r.status_code == 200, r.text
            sent, specs = [bias], [(BIAS, "float32", [64])]
        else:
            sent, specs = [bias, weight], [(WEIGHT, "float32", [64, 16]), (BIAS, "float32", [64])]
        attack(server, trainer, sent, announce(specs), 400, "WeightSyncTransferFailed")
        assert "x_proj." in broken(server)
    usable_again(server)


def test_routes_are_off_without_a_key_or_the_flag() -> None:
    """An app with neither an API key nor process_groups: the three group routes answer 403
    (before the body is looked at); with a key they are served, and need it (401 without)."""
    paths = ("/init_weights_update_group", "/update_weights_from_distributed",
             "/destroy_weights_update_group")
    with running_server(DemoPipeline.build(2**16), None, LifecycleController("cpu")) as s:
        for path in paths:
            r = s.client.post(path, json={})
            assert r.status_code == 403 and "--allow-process-groups" in r.json()["message"]
    with running_server(DemoPipeline.build(2**16), None, LifecycleController("cpu"),
                        api_key="k") as s:
        assert s.client.post(paths[2], json={}).status_code == 401
        r = s.client.post(paths[2], json={}, headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and "does not exist" in r.json()["message"]
