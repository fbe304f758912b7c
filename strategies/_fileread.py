"""Checkpoint bytes read straight into the tensors they update: one copy, no mapping.

Loading a safetensors tensor and then copying it into its parameter moves every byte twice
(page cache -> a fresh tensor, which page-faults the file's mapping in; that tensor -> the
parameter). Where the host can write the parameter's memory (the CPU layer, any host-tier
tensor: ``DeviceLayer.host_writes``), the file's bytes are read with ``preadv`` straight into
it instead: the kernel copies page cache -> parameter once. The reads are cut into pieces
and dealt to a few worker threads (one reading thread does not reach the memory bus's speed).

Only an exact match is read this way: same dtype as the file, contiguous, the region's length
equal to the tensor's bytes, a little-endian host. Anything else (a cast, a CUDA tensor)
takes the loader (:class:`~strategies.WriteSource.load`). A file that ends early or fails to
read raises :class:`OSError` naming the file and offset; the write that asked for it restores
what it wrote (``strategies._write``), as for any failed loader.
"""

from __future__ import annotations

import ctypes
import json
import os
import struct
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
import torch

from ._threads import to_thread

__all__ = ["FileRegion", "read_regions", "safetensors_regions"]

# Bytes per piece dealt to a reading thread (small enough to balance, large enough that the
# per-call cost disappears).
PIECE = 16 * 2**20
# Reading threads at most (each ``preadv`` runs without the GIL).
MAX_READERS = 4
_preadv = getattr(os, "preadv", None)  # not on Windows: there, every tensor is loaded
CAN_READ_INTO = _preadv is not None and sys.byteorder == "little"


@dataclass(frozen=True)
class FileRegion:
    """Where one tensor's bytes are in a file: ``nbytes`` from absolute ``offset``, stored
    as ``dtype``."""

    path: str
    offset: int
    nbytes: int
    dtype: torch.dtype

    def fits(self, t: torch.Tensor) -> bool:
        """Whether these bytes are exactly ``t``'s (no cast, no gaps): readable straight in."""
        return CAN_READ_INTO and t.dtype == self.dtype and t.is_contiguous() \
            and int(t.nbytes) == self.nbytes and self.nbytes > 0


def safetensors_regions(path: str | os.PathLike[str]) -> dict[str, tuple[int, int]]:
    """``{key: (absolute offset, nbytes)}`` of every tensor of a safetensors file, from its
    header (8 bytes of little-endian length, then JSON). The caller has opened the file with
    ``safe_open`` already, which validated the header against the file's size."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    start = 8 + length
    return {k: (start + v["data_offsets"][0], v["data_offsets"][1] - v["data_offsets"][0])
            for k, v in header.items() if k != "__metadata__"}


_Piece = tuple[str, int, int, int]  # path, file offset, destination address, bytes


def _lanes(reads: Sequence[tuple[torch.Tensor, FileRegion]], n: int) -> list[list[_Piece]]:
    """Cut every read into pieces of at most :data:`PIECE` bytes and deal them to ``n``
    lanes, each piece to the lane with the fewest bytes so far."""
    lanes: list[list[_Piece]] = [[] for _ in range(n)]
    loads = [0] * n
    for dst, region in reads:
        address = dst.data_ptr()
        for start in range(0, region.nbytes, PIECE):
            size = min(PIECE, region.nbytes - start)
            i = loads.index(min(loads))
            lanes[i].append((region.path, region.offset + start, address + start, size))
            loads[i] += size
    return [lane for lane in lanes if lane]


def _read_lane(lane: Sequence[_Piece]) -> None:
    """Read a lane's pieces (in a worker thread)."""
    fds: dict[str, int] = {}
    try:
        for path, offset, address, nbytes in lane:
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
            done = 0
            while done < nbytes:
                got = _preadv(fd, [view[done:]], offset + done)  # type: ignore[misc]
                if got <= 0:
                    raise OSError(f"{path}: the file ended at byte {offset + done}, "
                                  f"{nbytes - done} bytes short of a tensor's data")
                done += got
    finally:
        for fd in fds.values():
            os.close(fd)


async def read_regions(reads: Sequence[tuple[torch.Tensor, FileRegion]],
                       limiter: anyio.CapacityLimiter | None = None) -> None:
    """Read each region into its tensor (each ``region.fits(tensor)``), in parallel worker
    threads (as many as ``limiter`` allows, at most :data:`MAX_READERS`). Returns once every
    byte is in; the first failure propagates once every thread has stopped (none writes
    after this returns or raises). The caller keeps the tensors alive meanwhile."""
    for dst, region in reads:
        if not region.fits(dst):
            raise ValueError(f"{region.path}: region of {region.nbytes} bytes "
                             f"({region.dtype}) does not fit tensor {tuple(dst.shape)} "
                             f"{dst.dtype}")
    readers = MAX_READERS if limiter is None else max(1, min(MAX_READERS,
                                                             int(limiter.total_tokens)))
    lanes = _lanes(reads, readers)
    errors: list[Exception] = []

    async def run(lane: list[_Piece]) -> None:
        try:
            await to_thread(_read_lane, lane, limiter=limiter)
        except Exception as exc:  # reported as itself below, not as an exception group
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        for lane in lanes:
            tg.start_soon(run, lane)
    if errors:
        raise errors[0]
