"""Bytes into tensors without stalling the event loop: views where possible, copies in pieces."""

from __future__ import annotations

import ctypes

import torch

# Copies and base64 decoding go in pieces of this size, so that the event loop's thread gets the
# GIL between them (a gigabyte in one C call would stall every request for seconds).
PIECE = 4 * 2**20


def writable(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    n = tensor.nbytes
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(tensor.data_ptr())).cast("B")


def tensor_over(data: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` holding ``data``: a view of it when it is writable
    and aligned for the dtype (no copy; the tensor keeps ``data`` alive), else a copy."""
    if len(data) and not data.readonly:
        flat = torch.frombuffer(data, dtype=torch.uint8)
        if flat.data_ptr() % dtype.itemsize == 0:
            return flat.view(dtype).reshape(shape)
    tensor = torch.empty(shape, dtype=dtype)
    _copy_into(tensor, data)
    return tensor


def _copy_into(tensor: torch.Tensor, src: memoryview) -> None:
    """Copy ``src`` into the (contiguous, CPU) ``tensor``'s bytes, in pieces."""
    target = writable(tensor)
    assert len(target) == len(src)
    for i in range(0, len(src), PIECE):
        target[i:i + PIECE] = src[i:i + PIECE]
