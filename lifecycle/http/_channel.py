"""The ranks' op channel: numbered ops and per-rank answers in a torch.distributed store
(the TCPStore that ``init_process_group`` uses, under its own prefix; JSON, no pickles), the
votes of a step (``agree``), relayed payloads in pieces, heartbeats (see
lifecycle.http._ranks)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["HEARTBEAT_S", "STALE_S", "OpChannel", "describe"]

HEARTBEAT_S = 1.0
STALE_S = 5.0
_POLL_S = 0.005
# The largest value put in the store at once: its server refuses values over 8 MiB (an upload
# is relayed in pieces of this size).
_PIECE = 4 * 2**20


class OpChannel:
    """Numbered ops and per-rank answers in a torch.distributed store (see module doc)."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size

    def _put(self, key: str, value: Mapping[str, Any]) -> None:
        self.store.set(key, json.dumps(value))

    def _get(self, key: str) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(bytes(self.store.get(key)).decode())
        return value

    def _has(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def post(self, seq: int, op: Mapping[str, Any]) -> None:
        self._put(f"op/{seq}", op)

    def next_op(self, seq: int) -> dict[str, Any]:
        """Wait (polling) for op ``seq``."""
        while not self._has(f"op/{seq}"):
            time.sleep(_POLL_S)
        return self._get(f"op/{seq}")

    def answer(self, seq: int, value: Mapping[str, Any]) -> None:
        self._put(f"answer/{seq}/{self.rank}", value)

    def answers(self, seq: int, timeout: float) -> dict[int, dict[str, Any]]:
        """Every other rank's answer to op ``seq``; a rank that did not answer in time is
        missing from the result."""
        deadline = time.monotonic() + timeout
        pending = set(range(1, self.world_size))
        out: dict[int, dict[str, Any]] = {}
        while pending and time.monotonic() < deadline:
            for r in sorted(pending):
                if self._has(f"answer/{seq}/{r}"):
                    out[r] = self._get(f"answer/{seq}/{r}")
                    pending.discard(r)
            if pending:
                time.sleep(_POLL_S)
        return out

    def agree(self, seq: int, error: str | None, timeout: float) -> dict[int, str]:
        """Post this rank's outcome of a step of op ``seq`` (None: ready) and wait for every
        rank's; returns rank -> reason for each rank that is not ready (a rank silent for
        ``timeout`` seconds included). Every rank gets the same answer."""
        self._put(f"agree/{seq}/{self.rank}", {"error": error})
        deadline = time.monotonic() + timeout
        pending = set(range(self.world_size))
        failures: dict[int, str] = {}
        while pending:
            for r in sorted(pending):
                if self._has(f"agree/{seq}/{r}"):
                    reason = self._get(f"agree/{seq}/{r}")["error"]
                    if reason is not None:
                        failures[r] = str(reason)
                    pending.discard(r)
            if pending:
                if time.monotonic() > deadline:
                    failures.update({r: f"did not answer within {timeout:g} s" for r in pending})
                    break
                time.sleep(_POLL_S)
        return dict(sorted(failures.items()))

    def abort(self, seq: int) -> None:
        """Mark op ``seq`` (a generation) aborted: every rank ends its part of it."""
        self.store.set(f"abort/{seq}", "1")

    def aborted(self, seq: int) -> bool:
        return self._has(f"abort/{seq}")

    def forget(self, seq: int) -> None:
        """Delete op ``seq``'s keys (every rank has answered it)."""
        keys = [f"op/{seq}", f"abort/{seq}", *(f"{kind}/{seq}/{r}" for kind in ("answer", "agree")
                                               for r in range(self.world_size))]
        for key in keys:
            with contextlib.suppress(RuntimeError):
                self.store.delete_key(key)

    def put_raw(self, key: str, data: str | memoryview) -> list[str]:
        """Put ``data`` under ``key`` in pieces of at most :data:`_PIECE` bytes (the store
        refuses values over 8 MiB); returns every key used (to delete them)."""
        view = memoryview(data.encode()) if isinstance(data, str) else data.cast("B")
        keys = []
        for i, start in enumerate(range(0, len(view), _PIECE)):
            keys.append(f"{key}/{i}")
            self.store.set(keys[-1], bytes(view[start:start + _PIECE]))
        self.store.set(key, str(len(keys)))  # last: once it is there, every piece is
        return [*keys, key]

    def get_raw(self, key: str) -> memoryview:
        """The bytes :meth:`put_raw` put under ``key`` (waiting for them at most the store's
        timeout), writable."""
        count = int(bytes(self.store.get(key)).decode())
        out = bytearray()
        for i in range(count):
            out += self.store.get(f"{key}/{i}")
        return memoryview(out)

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            with contextlib.suppress(RuntimeError):
                self.store.delete_key(key)

    def publish_uuid(self, uuid: str) -> None:
        self.store.set(f"device/{self.rank}", uuid)

    def uuid_of(self, rank: int) -> str:
        """Rank ``rank``'s published device UUID (waits for it at most the store's timeout)."""
        return bytes(self.store.get(f"device/{rank}")).decode()

    def beat(self) -> None:
        self.store.set(f"heartbeat/{self.rank}", str(time.time()))

    def silent_ranks(self) -> list[int]:
        """Ranks whose last heartbeat is older than :data:`STALE_S` (or missing)."""
        now = time.time()
        out = []
        for r in range(1, self.world_size):
            key = f"heartbeat/{r}"
            if not self._has(key) or now - float(bytes(self.store.get(key)).decode()) > STALE_S:
                out.append(r)
        return out



def describe(failures: Mapping[int, str], world_size: int) -> str:
    """One message for the ranks that failed: the reason alone when every rank gave it."""
    reasons = set(failures.values())
    if len(failures) == world_size and len(reasons) == 1:
        return next(iter(reasons))
    return "; ".join(f"rank {r}: {why}" for r, why in sorted(failures.items()))
