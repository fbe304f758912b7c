"""A trainer process for the weight-sync tests: forked (from a fork server), it joins a weight
update group as rank 0 the way RL trainers do (``init_custom_process_group``: the ``TCPStore``
a ``tcp://`` rendezvous serves, a ``PrefixStore`` of the group's name, torch's group helper),
then broadcasts the tensors it is sent, one ``broadcast`` each in list order, as the
reference's clients do.

The store is made before the group (as ``init_custom_process_group(store=...)`` takes it), so
that the test learns its port once it listens: a server joining before then would wait for the
store client's retry (tenths of a second, sometimes seconds)."""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_module
import signal
import socket
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["Trainer", "free_port"]


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _pack(t: torch.Tensor) -> tuple[bytes, str, tuple[int, ...]]:
    """A tensor as plain bytes (pickled by value: torch's shared-memory reducer, with its
    file-descriptor passing, stays out of the test)."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return data, str(t.dtype).removeprefix("torch."), tuple(t.shape)


def _unpack(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _serve_store(port: int, world_size: int, timeout: float) -> Any:
    """The group's store, served by the trainer (rank 0) on ``port`` (0: any free port), as a
    ``tcp://`` rendezvous makes it; returned at once (its clients join later)."""
    store_class: Any = dist.TCPStore  # type: ignore[attr-defined]
    return store_class("127.0.0.1", port, world_size, True, timedelta(seconds=timeout),
                       wait_for_workers=False, multi_tenant=True)


def _join(store: Any, world_size: int, group_name: str, timeout: float) -> Any:
    """init_custom_process_group's recipe over ``store``: a PrefixStore of the group's name,
    then torch's group helper (every rank must join; this blocks until they have)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        GroupName,
        PrefixStore,
        _new_process_group_helper,
        _world,
    )
    group, _ = _new_process_group_helper(world_size, 0, [], Backend("gloo"),
                                         PrefixStore(group_name, store),
                                         group_name=GroupName(group_name),
                                         timeout=timedelta(seconds=timeout),
                                         group_desc=group_name)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def _main(commands: Any, results: Any) -> None:
    torch.set_num_threads(1)
    # The store looks up each client's host name when it connects; a DNS server that drops a
    # query makes that take glibc's 5 s timeout (a sandbox's resolver did, 1 in ~15).
    os.environ["RES_OPTIONS"] = "timeout:1 attempts:1"
    group: Any = None
    store: Any = None
    while True:
        command, args = commands.get()
        try:
            if command == "init":
                port, world_size, group_name, timeout = args
                store = _serve_store(port, world_size, timeout)
                results.put(("listening", store.port))
                group = _join(store, world_size, group_name, timeout)
                results.put(("init", "ok"))
            elif command == "broadcast":
                packed, die_after, stall_after = args
                tensors = [_unpack(*p) for p in packed]
                t0 = time.perf_counter()
                for k, t in enumerate(tensors):
                    if k == die_after:
                        os.kill(os.getpid(), signal.SIGKILL)  # killed mid-broadcast
                    if k == stall_after:
                        time.sleep(3600)  # stalled: the test kills it
                    dist.broadcast(t, src=0, group=group)
                results.put(("broadcast", time.perf_counter() - t0))
            elif command == "destroy":
                dist.destroy_process_group(group)
                group = store = None
                results.put(("destroy", "ok"))
            elif command == "exit":
                break
        except Exception as exc:  # reported to the test
            results.put((command, f"{type(exc).__name__}: {exc}"))
    results.close()
    results.join_thread()
    os._exit(0)


def _context() -> Any:
    """Trainers are forked from a fork server (a fresh interpreter that imported torch, made
    once per test process): a fork of the test process itself, which has used
    torch.distributed (stores, gloo threads), could inherit its state half-way and hang or die
    in its first collective."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "tests.ranks.trainer"])
    return ctx


class Trainer:
    """Drives one trainer process; each call sends a command and returns at once (the server
    joins and receives meanwhile); :meth:`result` waits for the answer of the oldest one."""

    def __init__(self) -> None:
        ctx = _context()
        self._commands = ctx.Queue()
        self._results = ctx.Queue()
        self.process = ctx.Process(target=_main, args=(self._commands, self._results),
                                   daemon=True)
        self.process.start()

    def init(self, world_size: int = 2, group_name: str = "weight_update_group",
             timeout: float = 10.0, port: int = 0) -> int:
        """Start joining as rank 0; returns the port its store listens on (``port``, or a
        free one) once it does, so that the server's join does not race its start."""
        self._commands.put(("init", (port, world_size, group_name, timeout)))
        answer, listening = self.result()
        assert answer == "listening", (answer, listening)
        return int(listening)

    def broadcast(self, tensors: list[torch.Tensor], *, die_after: int | None = None,
                  stall_after: int | None = None) -> None:
        self._commands.put(("broadcast", ([_pack(t) for t in tensors], die_after, stall_after)))

    def destroy(self) -> None:
        self._commands.put(("destroy", None))

    def result(self, timeout: float = 30.0) -> tuple[str, Any]:
        """The oldest command's answer: ``(command, "ok" or seconds or "Error: ...")``."""
        try:
            answer: tuple[str, Any] = self._results.get(timeout=timeout)
        except queue_module.Empty:
            return ("timeout", None)
        return answer

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():  # a stalled trainer does not read it: killed after
            self._commands.put(("exit", None))
            self.process.join(2)
        self.kill()
        self._commands.close()
        self._results.close()
