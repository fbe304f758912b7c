"""The root of every error this project raises on purpose, the store's refusal, and what a
failed move does on its way out (:func:`undo_on_failure`)."""

from __future__ import annotations

import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Protocol

__all__ = ["ResidencyError", "StoreError", "forget_locals", "undo_on_failure"]


class ResidencyError(Exception):
    """Base of every error of ``strategies`` and ``lifecycle``: ``except ResidencyError``
    catches each refusal and failure of the library (and nothing else)."""


class StoreError(ResidencyError, ValueError):
    """A module's tensors cannot be managed (meta, sparse, on a foreign device, drifted)."""


def forget_locals(exc: BaseException) -> None:
    """Drop the local variables of the frames ``exc`` passed through (file and line stay).

    A failed copy's traceback holds the frames that held the copy's buffers, and exceptions
    sit in reference cycles (anyio's futures, task groups) that only the cyclic collector
    breaks: without this, device memory a rollback released stays allocated until then."""
    traceback.clear_frames(exc.__traceback__)


class _Scratch(Protocol):
    def clear(self) -> None: ...


@asynccontextmanager
async def undo_on_failure(undo: Callable[[], Awaitable[object]], *scratch: _Scratch
                          ) -> AsyncIterator[None]:
    """Around the preparing of a move. Whatever leaves the block (an error, a cancellation)
    first forgets the locals of the frames it passed through (:func:`forget_locals`: they
    held the move's buffers), then awaits ``undo`` (which drops what the block made, and
    shields what must not be cancelled), then propagates unchanged. ``scratch``: the block's
    lists of copy pairs, emptied on the way out, failure or not (the caller's own frame,
    which a failure's traceback keeps, must not keep their buffers alive)."""
    try:
        yield
    except BaseException as exc:
        forget_locals(exc)
        await undo()
        raise
    finally:
        for pairs in scratch:
            pairs.clear()
