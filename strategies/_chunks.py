"""Cutting a sequence into chunks of about a number of bytes: the one chunker of copies and
reads (progress and cancellation points between chunks, bounded memory per read)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

__all__ = ["chunked"]

T = TypeVar("T")


def chunked(items: Iterable[T], nbytes: Callable[[T], int], limit: int) -> Iterator[list[T]]:
    """Consecutive non-empty chunks of ``items``; a chunk closes once it holds ``limit`` bytes
    or more (so one item larger than ``limit`` is a chunk of its own)."""
    chunk: list[T] = []
    size = 0
    for item in items:
        chunk.append(item)
        size += nbytes(item)
        if size >= limit:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk
