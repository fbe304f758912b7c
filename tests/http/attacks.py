"""What the attack suite (tests/http/test_attacks.py) sends, and the server it sends it to:
``residency serve`` in a subprocess on 127.0.0.1, whose peak resident set the tests read from
``/proc/PID/status`` (``VmHWM``, reset by writing 5 to ``/proc/PID/clear_refs``).

Payloads are built with torch's and Python's picklers where they can express them (through
:class:`Call`, which pickles as any call), and opcode by opcode where they cannot.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import io
import math
import pickle
import re
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from torch.multiprocessing import reductions

ROOT = Path(__file__).resolve().parents[2]
MiB = 2**20

# The transformer of `residency serve --size 1MB` (the demo pipeline) has these tensors.
BIAS = "x_proj.bias"  # float32, (64,)
BIAS_SHAPE = (64,)


# -- the server -------------------------------------------------------------------------------
@dataclass
class Target:
    """A ``residency serve`` subprocess: its pid, URL, a client, and where its stderr goes."""

    proc: subprocess.Popen[str]
    url: str
    client: httpx.Client
    log: Path
    options: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def snapshot(self) -> tuple[Any, ...]:
        """What no refusal may change: phase, version, and every module's checksum."""
        state = self.client.get("/state").json()
        sums = self.client.post("/get_weights_checksum", json={}).json()
        return state["phase"], state["weights_version"], sums

    def status(self, field_name: str) -> int:
        """``VmRSS`` / ``VmHWM`` of the server, in bytes."""
        text = Path(f"/proc/{self.pid}/status").read_text()
        found = re.search(rf"^{field_name}:\s+(\d+) kB", text, re.M)
        assert found is not None
        return int(found.group(1)) * 1024

    @contextlib.contextmanager
    def peak(self) -> Iterator[list[int]]:
        """Yields a list that holds, after the block, how far the server's peak RSS rose above
        its RSS at the start (the peak is reset first; without clear_refs, from the old peak)."""
        out: list[int] = []
        try:
            Path(f"/proc/{self.pid}/clear_refs").write_text("5")
            base = self.status("VmRSS")
        except OSError:  # pragma: no cover - clear_refs is Linux >= 4.0, owner only
            base = self.status("VmHWM")
        yield out
        out.append(self.status("VmHWM") - base)


@contextlib.contextmanager
def serve(log: Path, *options: str) -> Iterator[Target]:
    """``residency serve --port 0 --device cpu --size 1MB OPTIONS...`` until the block ends."""
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "lifecycle", "serve", "--port", "0",
                                 "--device", "cpu", "--size", "1MB", *options],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        found = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        if found is None:
            proc.kill()
            raise AssertionError(f"no address in {line!r}: {log.read_text()[-3000:]}")
        url = f"http://127.0.0.1:{found.group(1)}"
        with httpx.Client(base_url=url, timeout=30) as client:
            yield Target(proc, url, client, log, dict(zip(options[::2], options[1::2], strict=False)))
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:  # pragma: no cover - a hung server is the test's failure
            proc.kill()
            proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def health_watch(url: str, period: float = 0.1) -> Iterator[list[float]]:
    """Polls ``/health`` (1 s timeout) while the block runs; yields the latencies (inf for a
    failure or a timeout), complete after the block."""
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=1.0) as client:
            while True:  # at least once
                t0 = time.monotonic()
                try:
                    ok = client.get("/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                latencies.append(time.monotonic() - t0 if ok else math.inf)
                if stop.wait(period):
                    break

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield latencies
    finally:
        stop.set()
        thread.join(30)  # each poll times out after 1 s
        assert not thread.is_alive()


# -- pickles ------------------------------------------------------------------------------------
class Call:
    """Pickles as ``fn(*args)``: any call the allow-list admits, with any arguments."""

    def __init__(self, fn: object, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[object, ...]]:
        return self.fn, self.args

    def __call__(self) -> None:  # pickle insists that the reduce function be callable
        raise AssertionError("never called")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def upload(data: bytes, load_format: str | None = None, target: str = "transformer",
           **extra: Any) -> dict[str, Any]:
    """An ``update_weights_from_tensor`` body carrying ``data``."""
    body: dict[str, Any] = {"serialized_named_tensors": [b64(data)], "target_modules": [target],
                            **extra}
    if load_format is not None:
        body["load_format"] = load_format
    return body


def v2(storage: object, size: Sequence[int], stride: Sequence[int], offset: int = 0) -> Call:
    """``torch._utils._rebuild_tensor_v2(storage, ...)``, as ``pickle.dumps(tensor)`` writes it."""
    return Call(torch._utils._rebuild_tensor_v2, storage, offset, tuple(size), tuple(stride),
                False, collections.OrderedDict())


def legacy_storage(data: bytes, *, dtype_class: str = "FloatStorage",
                   numel: int | None = None) -> bytes:
    """torch's legacy storage format (what ``TypedStorage.__reduce__`` writes), by hand:
    ``numel`` may lie about ``data``."""
    itemsize = {"FloatStorage": 4, "ByteStorage": 1}[dtype_class]
    count = len(data) // itemsize if numel is None else numel
    out = io.BytesIO()
    for value in (0x1950A86A20F9469CFC6C, 1001,
                  {"protocol_version": 1001, "little_endian": True,
                   "type_sizes": {"short": 2, "int": 4, "long": 4}}):
        pickle.dump(value, out, protocol=2)
    main = (b"\x80\x02(X\x07\x00\x00\x00storageq\x00ctorch\n" + dtype_class.encode() +
            b"\nq\x01X\x01\x00\x00\x000q\x02X\x03\x00\x00\x00cpuq\x03\x8a\x08" +
            count.to_bytes(8, "little") + b"Ntq\x04Q.")
    out.write(main)
    pickle.dump(["0"], out, protocol=2)
    out.write(count.to_bytes(8, "little") + data)
    return out.getvalue()


def from_bytes(raw: bytes) -> Call:
    return Call(torch.storage._load_from_bytes, raw)


# crc32 of 2 GiB of zeros: zlib.crc32(bytes(2**31)).
_CRC_ZEROS_2GIB = 1304293916


def deflate_zeros(nbytes: int) -> bytes:
    """A raw deflate stream of ``nbytes`` zeros (a multiple of 16 MiB), made fast: one 16 MiB
    segment compressed once and repeated (a full flush makes segments independent)."""
    piece = 16 * MiB
    assert nbytes % piece == 0
    co = zlib.compressobj(9, zlib.DEFLATED, -15)
    segment = co.compress(bytes(piece)) + co.flush(zlib.Z_FULL_FLUSH)
    return segment * (nbytes // piece) + zlib.compressobj(9, zlib.DEFLATED, -15).flush()


def zip_archive(entries: Sequence[tuple[str, bytes, int, int, int]]) -> bytes:
    """A zip archive of ``(name, stored data, method, uncompressed size, crc32)`` entries."""
    out, central = io.BytesIO(), io.BytesIO()
    for name, data, method, size, crc in entries:
        offset = out.tell()
        fields = (20, 0, method, 0, 0x21, crc, len(data), size, len(name.encode()), 0)
        out.write(struct.pack("<IHHHHHIIIHH", 0x04034B50, *fields) + name.encode() + data)
        central.write(struct.pack("<IH", 0x02014B50, 20) +
                      struct.pack("<HHHHHIIIHHHHHII", *fields[:-1], 0, 0, 0, 0, 0, offset) +
                      name.encode())
    where, directory = out.tell(), central.getvalue()
    out.write(directory + struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, len(entries), len(entries),
                                      len(directory), where, 0))
    return out.getvalue()


def zip_bomb() -> bytes:
    """A ``torch.save`` archive of one UntypedStorage declaring 2 GiB, stored deflated (2 MB of
    compressed zeros): what ``torch.load`` would inflate."""
    key = "0"
    data_pkl = (b"\x80\x02(X\x07\x00\x00\x00storageq\x00ctorch.storage\nUntypedStorage\nq\x01X"
                b"\x01\x00\x00\x00" + key.encode() + b"q\x02X\x03\x00\x00\x00cpuq\x03\x8a\x05" +
                (2**31).to_bytes(5, "little") + b"tq\x04Q.")

    def stored(name: str, data: bytes) -> tuple[str, bytes, int, int, int]:
        return name, data, 0, len(data), zlib.crc32(data)

    return zip_archive([stored("archive/data.pkl", data_pkl), stored("archive/byteorder", b"little"),
                        ("archive/data/0", deflate_zeros(2**31), 8, 2**31, _CRC_ZEROS_2GIB),
                        stored("archive/version", b"3\n")])


def memo_bomb() -> bytes:
    """Nine bytes: ``LONG_BINPUT 2**27`` makes CPython's unpickler zero a memo array of 2 GiB."""
    return b"\x80\x02N" + b"r" + struct.pack("<I", 2**27) + b"."


def list_flood(n: int = 2_000_000) -> bytes:
    """``n`` empty lists (1 byte each in the pickle, ~64 bytes each in the unpickler)."""
    return b"\x80\x02(" + b"]" * n + b"l."


def view_past_end(offset: int = 2**31) -> bytes:
    """A view at ``offset`` of an empty, resizable storage (``Tensor.set_`` would grow it)."""
    empty = Call(reductions.rebuild_storage_empty, torch.UntypedStorage)
    typed = Call(reductions.rebuild_typed_storage, empty, torch.float32)
    return pickle.dumps([(BIAS, Call(reductions.rebuild_tensor, torch.Tensor, typed,
                                     (offset, BIAS_SHAPE, (1,), False)))])


def shm_pickle(handle: bytes, nbytes: int, manager: bytes) -> bytes:
    """``rebuild_storage_filename`` of segment ``handle`` (``file_system`` sharing), as a
    tensor of ``nbytes // 4`` floats named :data:`BIAS`."""
    storage = Call(reductions.rebuild_storage_filename, torch.UntypedStorage, manager, handle, nbytes)
    typed = Call(reductions.rebuild_typed_storage, storage, torch.float32)
    return pickle.dumps([(BIAS, Call(reductions.rebuild_tensor, torch.Tensor, typed,
                                     (0, (nbytes // 4,), (1,), False)))])


def fd_pickle(address: str, nbytes: int = 256) -> bytes:
    """``rebuild_storage_fd`` asking the listener at ``address`` for a descriptor."""
    from multiprocessing import resource_sharer

    fd = object.__new__(resource_sharer.DupFd)
    fd._id = (address, 1)  # type: ignore[attr-defined]
    storage = Call(reductions.rebuild_storage_fd, torch.UntypedStorage, fd, nbytes)
    typed = Call(reductions.rebuild_typed_storage, storage, torch.float32)
    return pickle.dumps([(BIAS, Call(reductions.rebuild_tensor, torch.Tensor, typed,
                                     (0, BIAS_SHAPE, (1,), False)))])


def nested(depth: int) -> bytes:
    """A JSON object nested ``depth`` deep (2 bytes a level)."""
    return b'{"a":' * depth + b"1" + b"}" * depth
