"""``residency serve`` under attack (issue 22): each payload sent to a real server on 127.0.0.1
gets a 4xx (never a 500, never a hang), changes no weight, version or phase, leaves ``/health``
answering within a second meanwhile, and raises the server's peak RSS by no more than about
the body's size; then random pickles over the opcodes the allow-list admits."""

from __future__ import annotations

import json
import os
import pickle
import select
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import httpx
import pytest
import safetensors.torch
import torch
import torch.multiprocessing
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from lifecycle import LifecycleController
from lifecycle.demo import DemoPipeline
from lifecycle.http import create_app, demo_generate
from lifecycle.payload import ALLOWED_GLOBALS, LOAD_FORMATS, TransportError, decode_named_tensors
from tests.http.attacks import (
    BIAS,
    BIAS_SHAPE,
    MiB,
    Target,
    b64,
    fd_pickle,
    from_bytes,
    health_watch,
    legacy_storage,
    list_flood,
    memo_bomb,
    nested,
    serve,
    shm_pickle,
    upload,
    v2,
    view_past_end,
    zip_bomb,
)
from tests.http.server import running_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

JSON = {"content-type": "application/json"}
# What the server may add to its peak RSS beyond the body's size for anything it refuses:
# Python's and the allocator's own churn, never a payload's declared size.
SLACK = 48 * MiB


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Target]:
    """The demo pipeline (1 MB) served with short limits, so that the slow-client checks
    take about a second each."""
    log = tmp_path_factory.mktemp("serve") / "stderr.log"
    with serve(log, "--header-timeout", "1", "--body-timeout", "1", "--fd-timeout", "1",
               "--max-connections", "16", "--allow-process-groups") as target:
        yield target


def refused(server: Target, path: str, body: Any = None, *, content: bytes | None = None,
            status: int = 400, message: str = "", bound: int | None = None) -> httpx.Response:
    """Post one attack; checks its answer (``status``, ``message`` in the JSON), that nothing
    changed, that /health answered within 1 s throughout, and that the peak RSS rose at most
    ``bound`` (default: twice the body, plus :data:`SLACK`)."""
    data = content if content is not None else json.dumps(body).encode()
    before = server.snapshot()
    with health_watch(server.url) as latencies, server.peak() as peak:
        r = server.client.post(path, content=data, headers=JSON)
    assert r.status_code == status, r.text[:1000]
    assert message in r.json()["message"], r.json()
    assert server.snapshot() == before
    assert latencies and max(latencies) < 1.0, latencies
    limit = 2 * len(data) + SLACK if bound is None else bound
    assert peak[0] <= limit, f"peak RSS rose {peak[0] / MiB:.0f} MiB for a {len(data)}-byte body"
    return r


# -- 1. memory bombs ----------------------------------------------------------------------------
def test_a_storage_declaring_2_gib_in_2_mb_of_deflate_is_refused_without_allocating_it(
        server: Target) -> None:
    """The issue's bomb: a torch.save zip whose one storage declares 2 GiB, deflated to 2 MB,
    behind _rebuild_tensor_v2(_load_from_bytes(...)) for a real tensor name: a 400, and the
    peak RSS grows by about the body, not by gigabytes."""
    payload = pickle.dumps([(BIAS, v2(from_bytes(zip_bomb()), BIAS_SHAPE, (1,)))])
    refused(server, "/update_weights_from_tensor", upload(payload),
            message="not torch's legacy storage format")


@pytest.mark.parametrize(("payload", "message"), [
    (lambda: pickle.dumps([(BIAS, v2(from_bytes(legacy_storage(bytes(16), numel=2**29)),
                                     BIAS_SHAPE, (1,)))]),
     "the storage declares 2147483648 bytes but 16 follow"),
    (memo_bomb, "stores memo entry 134217728 after 0 entries"),
    (list_flood, "would make the unpickler hold over"),
    (lambda: b"\x80\x02\x8e" + struct.pack("<Q", 2**40) + b".", "declares 1099511627776 bytes"),
    (lambda: b"\x80\x04\x95" + struct.pack("<Q", 2**31) + b"N.", "frame of 2147483648 bytes"),
    (lambda: b"\x80\x04\x8f.", "EMPTY_SET"),
], ids=["legacy-storage-lies", "memo-index", "list-flood", "bytes-past-end", "big-frame", "set"])
def test_opcode_and_storage_bombs_are_refused_before_anything_is_allocated(
        server: Target, payload: Any, message: str) -> None:
    """A storage larger than its bytes, a memo index far ahead (9 bytes that would zero 2 GiB),
    millions of empty lists, a byte string or a frame past the end, an opcode torch never
    writes: 400 naming it, no growth."""
    refused(server, "/update_weights_from_tensor", upload(payload()), message=message)


# -- 3. views ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("payload", "message"), [
    (view_past_end, "past the end of its storage of 0 elements"),
    (lambda: pickle.dumps([(BIAS, v2(from_bytes(legacy_storage(bytes(256))), BIAS_SHAPE, (2,)))]),
     "reaches element 127, past the end of its storage of 64 elements"),
    (lambda: pickle.dumps([(BIAS, v2(from_bytes(legacy_storage(bytes(256))), BIAS_SHAPE, (1,),
                                     offset=2**40))]), "past the end of its storage"),
    (lambda: pickle.dumps([(BIAS, v2(from_bytes(legacy_storage(bytes(4))), BIAS_SHAPE, (0,)))]),
     "overlapping views are not accepted"),
], ids=["offset-2**31-empty-storage", "stride", "offset-v2", "stride-0"])
def test_a_view_past_its_storage_is_refused_before_torch_sees_it(
        server: Target, payload: Any, message: str) -> None:
    """Offsets and strides past a storage (torch would grow an empty one and serve heap
    garbage as weights), and views with more elements than their storage: 400."""
    refused(server, "/update_weights_from_tensor", upload(payload()), message=message)


# -- 4. shared memory ---------------------------------------------------------------------------
def test_shared_memory_segments_are_copied_read_only_and_every_refusal_reads_the_same(
        server: Target) -> None:
    """file_system handles: a regular segment of this user is copied (200, the right values),
    never written or grown, and the manager socket the payload names is never contacted; a
    FIFO, a symlink, a short segment, a missing one (and another user's, as root) are one and
    the same 400."""
    with tempfile.TemporaryDirectory(prefix="torch-shm-dir-") as folder:
        manager_path = os.path.join(folder, "manager.sock")
        manager = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        manager.bind(manager_path)
        manager.listen(8)
        manager.setblocking(False)
        values = torch.arange(64, dtype=torch.float32) / 4
        header = struct.pack("<q", 7) + bytes(56)  # torch's 64-byte header: a refcount of 7
        prefix = f"/torch_{os.getpid()}_attack_"
        made: list[str] = []

        def segment(name: str, data: bytes) -> bytes:
            path = f"/dev/shm{prefix}{name}"
            Path(path).write_bytes(data)
            made.append(path)
            return f"{prefix}{name}".encode()

        try:
            good = segment("good", header + values.numpy().tobytes())
            short = segment("short", header + bytes(100))
            os.mkfifo(f"/dev/shm{prefix}fifo")
            made.append(f"/dev/shm{prefix}fifo")
            os.symlink(f"/dev/shm{prefix}good", f"/dev/shm{prefix}link")
            made.append(f"/dev/shm{prefix}link")
            handles = [short, f"{prefix}fifo".encode(), f"{prefix}link".encode(),
                       f"{prefix}missing".encode()]
            if os.geteuid() == 0:
                foreign = segment("foreign", header + values.numpy().tobytes())
                os.chown(f"/dev/shm{prefix}foreign", 65534, 65534)
                handles.append(foreign)
            messages = {refused(server, "/update_weights_from_tensor",
                                upload(shm_pickle(h, 256, manager_path.encode()))).json()["message"]
                        for h in handles}
            assert len(messages) == 1 and "segment cannot be used" in messages.pop()

            before = Path(f"/dev/shm{prefix}good").read_bytes()
            r = server.client.post("/update_weights_from_tensor",
                                   json=upload(shm_pickle(good, 256, manager_path.encode())))
            assert r.status_code == 200, r.text
            assert Path(f"/dev/shm{prefix}good").read_bytes() == before  # not written, not grown
            with pytest.raises(BlockingIOError):
                manager.accept()  # nobody connected to the manager the payload named
            copied = server.snapshot()
            again = server.client.post("/update_weights_from_tensor", json=upload(
                safetensors.torch.save({BIAS: values}), "safetensors"))
            assert again.status_code == 200 and server.snapshot()[2] == copied[2]
        finally:
            manager.close()
            for path in made:
                os.unlink(path)


# -- 5. the fd handshake --------------------------------------------------------------------------
def test_a_listener_that_never_speaks_costs_a_400_after_the_fd_timeout(server: Target) -> None:
    """rebuild_storage_fd naming a listener that accepts and never answers: three at once
    come back 400 after about the server's 1 s handshake timeout, /health answering
    meanwhile."""
    with tempfile.TemporaryDirectory(prefix="pymp-") as folder:
        address = os.path.join(folder, "listener-attack")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(address)
        listener.listen(8)
        held: list[socket.socket] = []
        stop = threading.Event()

        def accept_and_hold() -> None:
            listener.settimeout(0.1)
            while not stop.is_set():
                try:
                    held.append(listener.accept()[0])
                except TimeoutError:
                    continue

        thread = threading.Thread(target=accept_and_hold, daemon=True)
        thread.start()
        try:
            body = json.dumps(upload(fd_pickle(address))).encode()
            t0 = time.monotonic()
            with health_watch(server.url) as latencies:
                answers: list[httpx.Response] = []
                posts = [threading.Thread(target=lambda: answers.append(httpx.post(
                    f"{server.url}/update_weights_from_tensor", content=body, headers=JSON,
                    timeout=30))) for _ in range(3)]
                for p in posts:
                    p.start()
                for p in posts:
                    p.join(30)
            elapsed = time.monotonic() - t0
            assert [a.status_code for a in answers] == [400] * 3
            assert all("did not answer within 1 s" in a.json()["message"] for a in answers)
            assert 1.0 <= elapsed < 10.0 and len(held) == 3  # the listener holds them forever
            assert max(latencies) < 1.0
        finally:
            stop.set()
            thread.join(5)
            for s in held:
                s.close()
            listener.close()


# -- 2. files that block ----------------------------------------------------------------------------
def test_a_fifo_or_device_as_weight_file_is_refused_before_any_reader_opens_it(
        server: Target, tmp_path: Path) -> None:
    """update_weights_from_disk whose weight file is a FIFO (a reader would hang the whole
    process) or a device: 400 naming it at once, /health and /state answering meanwhile."""
    fifo_root, device_root = tmp_path / "fifo", tmp_path / "device"
    (fifo_root / "transformer").mkdir(parents=True)
    (device_root / "transformer").mkdir(parents=True)
    fifo = fifo_root / "transformer" / "model.safetensors"
    os.mkfifo(fifo)
    (device_root / "transformer" / "model.safetensors").symlink_to("/dev/zero")

    def unblock() -> None:  # should the server open the FIFO after all: fail, not hang
        if not done.wait(10):
            with open(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK), "wb"):
                pass

    done = threading.Event()
    threading.Thread(target=unblock, daemon=True).start()
    try:
        for root, kind in ((fifo_root, "is a FIFO"), (device_root, "is a character device")):
            refused(server, "/update_weights_from_disk", {"model_path": str(root),
                                                           "target_modules": ["transformer"]},
                    message=f"model.safetensors {kind}, not a regular file")
        refused(server, "/update_weights_from_disk", {"model_path": str(fifo)},
                message="no weight files under")
    finally:
        done.set()


# -- 6. bodies that used to be 500s -----------------------------------------------------------------
POST_PATHS = ["/release_memory_occupation", "/resume_memory_occupation", "/update_weights_from_disk",
              "/update_weights_from_tensor", "/get_weights_checksum", "/generate", "/flush_cache",
              "/update_weights_from_tensor_checker", "/init_weights_update_group",
              "/update_weights_from_distributed", "/destroy_weights_update_group"]


@pytest.mark.parametrize("path", POST_PATHS)
def test_json_nested_1000_deep_is_a_400_on_every_route(server: Target, path: str) -> None:
    """A 2 KB body nested 1000 deep: 400 (it was RecursionError, a 500)."""
    refused(server, path, content=nested(1000), message="nested too deeply")


@pytest.mark.parametrize(("path", "content", "message"), [
    ("/generate", b'{"seed": ' + b"9" * 5001 + b"}", "an integer of 5001 digits"),
    ("/generate", b'{"seed": 99999999999999999999999}', "seed must be an integer from"),
    ("/get_weights_checksum", b'{"module_names": ["\\ud800"]}',
     "module_names[0] is not valid Unicode text"),
    ("/update_weights_from_disk", b'{"model_path": "\\udcff/x"}', "model_path is not valid Unicode"),
    ("/update_weights_from_disk", b'{"model_path": "/tmp/\\u0000x"}', "must not contain a NUL"),
    ("/update_weights_from_tensor_checker",
     b'{"target_module": "transformer", "expected_named_tensors_sha256": {"\\ud800": "00"}}',
     "expected_named_tensors_sha256 is not valid Unicode"),
    ("/update_weights_from_distributed",
     b'{"names": ["\\udfff"], "dtypes": ["float32"], "shapes": [[1]]}',
     "names[0] is not valid Unicode"),
    ("/init_weights_update_group", b'{"master_address": "127.0.0.1", "master_port": 1, '
     b'"rank_offset": 1, "world_size": 2, "backend": "gloo", "timeout": NaN}',
     "timeout must be a number of seconds above 0"),
    ("/init_weights_update_group", b'{"master_address": "127.0.0.1", "master_port": 1, '
     b'"rank_offset": 1, "world_size": 2, "backend": "gloo", "timeout": 1e999}',
     "timeout must be a number of seconds above 0"),
    ("/update_weights_from_tensor", b'{"serialized_named_tensors": ["AAAA"], '
     b'"weight_version": true}', "weight_version must be a string, got bool"),
], ids=["5001-digits", "seed-2**76", "surrogate-name", "surrogate-path", "nul-path",
        "surrogate-checker", "surrogate-names", "nan-timeout", "inf-timeout", "bool-version"])
def test_bodies_that_raised_500_are_400s_naming_the_field(
        server: Target, path: str, content: bytes, message: str) -> None:
    """Huge integers, out-of-range seeds, lone surrogates, NULs, NaN and infinite timeouts, a
    weight_version of the wrong type: 400 naming the field."""
    refused(server, path, content=content, message=message)


# -- 7. slow clients ---------------------------------------------------------------------------------
def _read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and when it closed."""
    t0 = time.monotonic()
    data = b""
    sock.settimeout(timeout)
    while True:
        try:
            piece = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not piece:
            break
        data += piece
    return data, time.monotonic() - t0


def _json_answer(raw: bytes, status: int) -> dict[str, Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), raw[:200]
    answer: dict[str, Any] = json.loads(body)
    return answer


@pytest.mark.parametrize("sent", [b"", b"POST /generate HTTP/1.1\r\nHost: x\r\n"],
                         ids=["silent", "half-headers"])
def test_a_connection_that_never_finishes_its_headers_gets_408_and_is_closed(
        server: Target, sent: bytes) -> None:
    """Nothing, or half the headers: a JSON 408 and a close after the 1 s header timeout."""
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(sent)
        raw, elapsed = _read_until_closed(sock, 10)
    assert "headers did not arrive within 1 s" in _json_answer(raw, 408)["message"]
    assert 0.9 <= elapsed < 3.0
    assert server.client.get("/health").status_code == 200


def test_a_body_shorter_than_its_content_length_gets_408_after_the_body_timeout(
        server: Target) -> None:
    """``Content-Length: 100`` then 2 bytes: a JSON 408 after the 1 s body timeout."""
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as sock, \
            health_watch(server.url) as latencies:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{}")
        raw, elapsed = _read_until_closed(sock, 10)
    assert "the request body stopped arriving" in _json_answer(raw, 408)["message"]
    assert 0.9 <= elapsed < 3.0 and max(latencies) < 1.0


def test_connections_past_the_limit_get_a_json_503_and_the_server_keeps_serving(
        server: Target) -> None:
    """With 16 connections open, the next ones are answered 503 (JSON) and closed at once;
    when the idle ones time out, /health answers again."""
    port = int(server.url.rsplit(":", 1)[1])
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
    try:
        time.sleep(0.4)  # refusals are written at once; accepted ones wait for headers (1 s)
        readable, _, _ = select.select(socks, [], [], 0)
        refusals = [_json_answer(_read_until_closed(s, 2)[0], 503) for s in readable]
        assert refusals and all("limit of 16 connections" in a["message"] for a in refusals)
        assert len(socks) - len(refusals) <= 16
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10
    while True:
        try:
            if server.client.get("/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.1)


@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
def test_an_oversized_body_is_answered_413_not_reset(server: Target, chunked: bool) -> None:
    """A client sending 8 MiB to a 1 MiB route reads a 413, not a connection reset."""
    body = b'{"pad": "' + b"x" * (8 * MiB) + b'"}'
    content: Any = iter([body[i:i + MiB] for i in range(0, len(body), MiB)]) if chunked else body
    r = httpx.post(f"{server.url}/generate", content=content, headers=JSON, timeout=30)
    assert r.status_code == 413 and "over the limit" in r.json()["message"]


# -- 8. keys ----------------------------------------------------------------------------------------
def test_two_authorization_headers_are_a_400_and_an_empty_key_is_refused() -> None:
    """Two Authorization headers (which one would count?) are a 400, and create_app refuses an
    empty key, which would admit an empty token."""
    pipe = DemoPipeline.build(2**16)
    with running_server(pipe, demo_generate(pipe), LifecycleController("cpu"), api_key="k") as s:
        headers = [("Authorization", "Bearer k"), ("Authorization", "Bearer x")]
        r = s.client.post("/release_memory_occupation", json={}, headers=headers)
        assert r.status_code == 400 and "2 Authorization headers" in r.json()["message"]
        assert s.client.get("/state", headers={"Authorization": "Bearer"}).status_code == 401
        assert s.client.get("/state", headers={"Authorization": "Bearer k"}).status_code == 200
    with pytest.raises(ValueError, match="api_key is empty"):
        create_app(LifecycleController("cpu"), api_key="")


def test_serve_refuses_an_empty_key_and_warns_about_an_open_address_without_one(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``--api-key ""`` and an empty RESIDENCY_API_KEY exit 2; a non-loopback --host without
    a key prints a warning."""
    from lifecycle.cli import main

    assert main(["serve", "--api-key", "", "--pipeline", "nope"]) == 2
    assert "--api-key (or RESIDENCY_API_KEY) is empty" in capsys.readouterr().err
    monkeypatch.setenv("RESIDENCY_API_KEY", "")
    assert main(["serve", "--pipeline", "nope"]) == 2
    assert "is empty" in capsys.readouterr().err
    monkeypatch.delenv("RESIDENCY_API_KEY")
    assert main(["serve", "--host", "0.0.0.0", "--pipeline", "nope"]) == 2  # bad pipeline
    assert "0.0.0.0 is not a loopback address and there is no --api-key" in capsys.readouterr().err
    assert main(["serve", "--host", "::1", "--pipeline", "nope"]) == 2
    assert "warning" not in capsys.readouterr().err


# -- 9, 10. edges -------------------------------------------------------------------------------------
def _empty_bucket() -> bytes:
    return pickle.dumps({"flattened_tensor": torch.zeros(0), "metadata": []})


@pytest.mark.parametrize(("body", "message"), [
    (upload(pickle.dumps([])), "holds no tensors"),
    (upload(_empty_bucket(), "flattened_bucket"), "holds no tensors"),
    (upload(safetensors.torch.save({}), "safetensors"), "holds no tensors"),
    (upload(safetensors.torch.save({f"transformer.{BIAS}": torch.ones(64)})),
     f"relative to module 'transformer': ['transformer.{BIAS}'] name no tensor of it; send them "
     f"without the 'transformer.' prefix (e.g. '{BIAS}')"),
    (upload(safetensors.torch.save({BIAS: torch.ones(64)}), weight_update_mode="lora_merge"),
     "weight_update_mode='lora_merge' takes only LoRA tensors named"),
    (upload(pickle.dumps([(BIAS, torch.ones(64))], protocol=2)), "_codecs.encode"),
], ids=["empty-list", "empty-bucket", "empty-safetensors", "prefixed-name", "lora-merge",
        "protocol-2"])
def test_uploads_that_would_write_nothing_or_the_wrong_thing_are_refused(
        server: Target, body: dict[str, Any], message: str) -> None:
    """An update that writes nothing, names given with the module's prefix, a LoRA merge of a
    base weight's name (it was once applied as a replacement): 400 saying so; nothing changes."""
    r = refused(server, "/update_weights_from_tensor", body, message=message)
    assert "transformer.transformer." not in r.json()["message"]


def test_an_upload_with_megabytes_of_json_around_its_base64_is_a_413(server: Target) -> None:
    """Only the base64 strings of an upload may be large: the JSON around them is parsed (the
    GIL held throughout), so it gets the ordinary 1 MiB limit."""
    body = upload(safetensors.torch.save({BIAS: torch.ones(64)}), pad=list(range(300_000)))
    refused(server, "/update_weights_from_tensor", body, status=413,
            message="outside its long strings")


def test_a_disk_update_in_an_unsupported_mode_is_refused(server: Target, tmp_path: Path) -> None:
    """weight_update_mode on a disk update is checked too."""
    refused(server, "/update_weights_from_disk",
            {"model_path": str(tmp_path), "weight_update_mode": "lora_merge"},
            message="weight_update_mode 'lora_merge' is not supported")


@pytest.mark.parametrize(("fmt", "ratio"), [("safetensors", 1.25), ("pickle", 2.0)])
def test_a_32_mib_upload_peaks_at_about_its_body_size(server: Target, fmt: str,
                                                        ratio: float) -> None:
    """A 32 MiB upload (decoded in full, then refused: the name matches nothing) raises the
    peak RSS by at most 1.25 times the body for safetensors (decoded in place, tensors are
    views) and twice for a plain pickle (its storage is copied when misaligned); it was 3-4x."""
    tensor = torch.ones(8 * MiB)
    data = (safetensors.torch.save({"no_such_tensor": tensor}) if fmt == "safetensors"
            else pickle.dumps([("no_such_tensor", tensor)]))
    body = json.dumps(upload(data)).encode()
    refused(server, "/update_weights_from_tensor", content=body,
            message="match no parameter or buffer", bound=int(ratio * len(body)) + 16 * MiB)


# -- the fuzz ---------------------------------------------------------------------------------------
_NAMES = [*sorted(ALLOWED_GLOBALS), "os.system", "builtins.eval", "torch.load"]


def _global(qualname: str) -> bytes:
    module, _, name = qualname.rpartition(".")
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _stack_global(qualname: str) -> bytes:
    module, _, name = (part.encode() for part in qualname.rpartition("."))
    return b"\x8c" + bytes([len(module)]) + module + b"\x8c" + bytes([len(name)]) + name + b"\x93"


_STORAGE = legacy_storage(torch.ones(64).numpy().tobytes())
_INSTRUCTIONS = st.one_of(
    st.sampled_from([b"N", b"\x88", b"\x89", b"(", b"]", b"}", b")", b"l", b"d", b"t", b"\x85",
                     b"\x86", b"\x87", b"a", b"e", b"s", b"u", b"\x94", b"R", b"b", b"\x81",
                     b"0", b"1", b"\x93"]),
    st.integers(0, 255).map(lambda i: b"K" + bytes([i])),
    st.integers(0, 2**31 - 1).map(lambda i: b"J" + struct.pack("<i", i)),
    st.integers(0, 30).map(lambda i: b"q" + bytes([i])),
    st.integers(0, 30).map(lambda i: b"h" + bytes([i])),
    st.integers(0, 2**32 - 1).map(lambda i: b"r" + struct.pack("<I", i)),
    st.sampled_from(_NAMES).map(_global),
    st.sampled_from(_NAMES).map(_stack_global),
    st.binary(max_size=32).map(lambda b: b"C" + bytes([len(b)]) + b),
    st.text(max_size=12).map(lambda t: b"X" + struct.pack("<I", len(t.encode("utf-8", "surrogatepass")))
                             + t.encode("utf-8", "surrogatepass")),
    st.integers(0, 2**40).map(lambda n: b"\x8e" + struct.pack("<Q", n)),
    st.integers(0, 2**24).map(lambda n: b"\x95" + struct.pack("<Q", n)),
    st.just(b"B" + struct.pack("<I", len(_STORAGE)) + _STORAGE),
    st.sampled_from([(0, BIAS_SHAPE, (1,)), (2**31, (64,), (1,)), (0, (64,), (0,)),
                     (0, (8, 8), (8, 1)), (0, (65,), (1,))]).map(
        lambda m: pickle.dumps((m[0], tuple(m[1]), tuple(m[2]), False), protocol=4)[2:-1]),
)


@st.composite
def _programs(draw: st.DrawFn) -> bytes:
    """A pickle of random admitted (and a few refused) opcodes and arguments."""
    body = b"".join(draw(st.lists(_INSTRUCTIONS, max_size=40)))
    return bytes([0x80, draw(st.integers(2, 5))]) + body + b"."


def _templates() -> list[bytes]:
    """Valid payloads for the transformer's x_proj.bias, as each client builds them."""
    values = torch.linspace(-1, 1, 64)
    return [pickle.dumps([(BIAS, values)]), pickle.dumps([(BIAS, values)], protocol=3),
            bytes(ForkingPickler.dumps([(BIAS, values)])),
            pickle.dumps([(BIAS, v2(from_bytes(_STORAGE), BIAS_SHAPE, (1,)))])]


_TEMPLATES = _templates()


@st.composite
def _mutants(draw: st.DrawFn) -> bytes:
    """A valid payload with a few bytes replaced, inserted or cut."""
    data = bytearray(draw(st.sampled_from(_TEMPLATES)))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data) - 1))
        kind = draw(st.sampled_from(["replace", "insert", "delete", "truncate"]))
        byte = draw(st.integers(0, 255))
        if kind == "replace":
            data[at] = byte
        elif kind == "insert":
            data.insert(at, byte)
        elif kind == "delete":
            del data[at]
        else:
            del data[at:]
        if not data:
            data = bytearray(b".")
    return bytes(data)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.one_of(_programs(), _mutants()), load_format=st.sampled_from(LOAD_FORMATS))
def test_random_pickles_of_admitted_opcodes_get_a_4xx_or_a_correct_update_in_bounded_memory(
        server: Target, data: bytes, load_format: str | None) -> None:
    """Whatever the opcodes and arguments: 400, or a 200 whose effect is exactly that of the
    tensors the payload decodes to; never a 500; the peak RSS grows by at most twice the body
    plus a constant."""
    body = json.dumps(upload(data, load_format)).encode()
    with server.peak() as peak:
        r = server.client.post("/update_weights_from_tensor", content=body, headers=JSON)
    assert r.status_code in (200, 400), r.text[:1000]
    event(f"status {r.status_code}")
    assert peak[0] <= 2 * len(body) + SLACK, peak[0]
    if r.status_code == 400:
        return
    after = server.snapshot()
    # The server decoded it; so does this process: the same tensors, sent as safetensors,
    # must leave the weights exactly as they are.
    try:
        decoded = decode_named_tensors(b64(data), load_format)
    except TransportError as exc:  # pragma: no cover - a disagreement is the failure
        raise AssertionError(f"the server accepted what the decoder refuses: {exc}") from None
    same = {name: t.contiguous().clone() for name, t in decoded}
    again = server.client.post("/update_weights_from_tensor",
                               json=upload(safetensors.torch.save(same), "safetensors"))
    assert again.status_code == 200, again.text
    assert server.snapshot()[2] == after[2]
