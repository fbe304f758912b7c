"""The receiving end of one weight update group, in a process of its own.

:mod:`lifecycle._weight_sync` starts one of these per group (from a fork server: a fresh
interpreter, never a fork of the server with its threads). It joins the trainer's group and
receives each broadcast into the staging buffer it shares with the server (a ``memfd`` passed
over the command connection), so that whatever a trainer sends can at worst end this process:
gloo's ``op.preamble.length <= op.nbytes`` abort on its I/O thread, a store that never answers,
a connection object per rank of a huge ``world_size``. The server sees the connection close
and fails the call with a typed error; its own memory, threads and sockets are untouched.

Commands (tuples over a duplex ``multiprocessing`` connection), each answered once:

* ``("join", address, port, rank, world_size, group_name, backend, timeout, device)`` ->
  ``("joined",)`` or ``("join_failed", category)`` (``refused``, ``timed out`` or ``not a
  store``: never the backend's text, which may quote the peer's bytes);
* ``("buffer", size)`` followed by the memfd -> ``("mapped",)``;
* ``("receive", [(offset, length), ...], timeout)``: one broadcast into each span of the
  buffer, in order -> ``("received",)`` or ``("failed", index, category)``; the count of
  spans received so far is kept in the buffer's first 8 bytes (read after a crash);
* ``("drain", [length, ...], timeout)``: each broadcast into a private scratch buffer of the
  largest length, freed after -> ``("drained",)`` or ``("failed", index, category)``;
* ``("exit",)``: leave the group and exit.
"""

from __future__ import annotations

import mmap
import os
import signal
from datetime import timedelta
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["category", "main"]

_TCPStore: Any = dist.TCPStore  # type: ignore[attr-defined]
_PrefixStore: Any = dist.PrefixStore  # type: ignore[attr-defined]


def category(exc: BaseException) -> str:
    """What went wrong with a join or a broadcast, in a few fixed words (never the backend's
    message, which may hold the peer's first bytes)."""
    text = str(exc).lower()
    if "timed out" in text or "timeout" in text or "deadline" in text:
        return "timed out"
    if "refused" in text:
        return "refused"
    if "closed" in text or "reset" in text or "broken pipe" in text or "eof" in text:
        return "connection closed"
    return "not a store"


def _join(address: str, port: int, rank: int, world_size: int, group_name: str, backend: str,
          timeout: float, device: str) -> tuple[Any, Any]:
    """Join the trainer's group, with the key layout of ``init_custom_process_group``:
    PrefixStore(group_name) around the rendezvous store, then torch's own group prefix and
    device prefix (torch.distributed.distributed_c10d._new_process_group_helper)."""
    td = timedelta(seconds=timeout)
    tcp = _TCPStore(address, port, world_size, False, timeout=td)
    store = _PrefixStore(f"{group_name}/", _PrefixStore(group_name, tcp))
    if backend == "gloo":
        made: Any = dist.ProcessGroupGloo(_PrefixStore("cpu/", store), rank, world_size, td)
    else:
        nccl: Any = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None or not dist.is_nccl_available():
            raise RuntimeError("this torch build has no NCCL")
        torch.cuda.set_device(torch.device(device))
        options = nccl.Options()
        options.is_high_priority_stream = False
        options._timeout = td
        made = nccl(_PrefixStore("cuda/", store), rank, world_size, options)
    made._set_sequence_number_for_group()
    return tcp, made


def _broadcast(group: Any, tensor: torch.Tensor, timeout: float) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    opts.timeout = timedelta(seconds=timeout)
    work = group.broadcast([tensor], opts)
    if not work.wait(timedelta(seconds=timeout)):
        raise RuntimeError("broadcast timed out")


class _Receiving:
    """The joined group and the shared buffer of this process."""

    def __init__(self) -> None:
        self.store: Any = None
        self.group: Any = None
        self.device = "cpu"
        self.buffer: mmap.mmap | None = None
        self.view: torch.Tensor | None = None

    def receive(self, spans: list[tuple[int, int]], timeout: float) -> tuple[Any, ...]:
        assert self.view is not None
        count = self.view[:8].view(torch.int64)
        count.fill_(0)
        for i, (offset, length) in enumerate(spans):
            target = self.view[offset:offset + length]
            try:
                if self.device == "cpu":
                    _broadcast(self.group, target, timeout)
                else:  # NCCL: received on the device, then landed in the shared host buffer
                    staged = target.to(self.device)  # the canaries the server wrote, too
                    _broadcast(self.group, staged, timeout)
                    target.copy_(staged)
            except (RuntimeError, ValueError) as exc:
                return ("failed", i, category(exc))
            count.fill_(i + 1)
        return ("received",)

    def drain(self, lengths: list[int], timeout: float) -> tuple[Any, ...]:
        if not lengths:
            return ("drained",)
        scratch = torch.empty(max(lengths), dtype=torch.uint8, device=self.device)
        try:
            for i, length in enumerate(lengths):
                try:
                    _broadcast(self.group, scratch[:length], timeout)
                except (RuntimeError, ValueError) as exc:
                    return ("failed", i, category(exc))
        finally:
            del scratch
        return ("drained",)

    def map(self, conn: Connection, size: int) -> None:
        fd = reduction.recv_handle(conn)
        try:
            self.view = None
            self.buffer = None  # the old mapping goes first
            self.buffer = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.view = torch.frombuffer(self.buffer, dtype=torch.uint8)


def main(conn: Connection) -> None:
    """Serve the commands of the module doc until ``exit`` or until the server goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is for the server to handle
    torch.set_num_threads(1)
    here = _Receiving()
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the server closed its end or died
            os._exit(0)
        kind = message[0]
        if kind == "join":
            address, port, rank, world_size, group_name, backend, timeout, device = message[1:]
            here.device = "cpu" if backend == "gloo" else device
            try:
                here.store, here.group = _join(address, port, rank, world_size, group_name,
                                               backend, timeout, device)
            except (RuntimeError, ValueError, OSError) as exc:
                conn.send(("join_failed", category(exc)))
                os._exit(0)
            conn.send(("joined",))
        elif kind == "buffer":
            here.map(conn, int(message[1]))
            conn.send(("mapped",))
        elif kind == "receive":
            conn.send(here.receive(message[1], float(message[2])))
        elif kind == "drain":
            conn.send(here.drain(message[1], float(message[2])))
        else:  # exit
            os._exit(0)  # the group's sockets close with the process
