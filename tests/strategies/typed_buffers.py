"""A module of buffers of one dtype in every layout an update must write (0-d, 1-d, 2-d, a
non-contiguous one, and optionally a big one spanning several staging buffers), and new
values for it: shared by the CUDA layer's tests on the simulated GPU and on a real one."""

from __future__ import annotations

import torch
from torch import nn

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


def values(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g, dtype=dtype)


class Typed(nn.Module):
    """Buffers of one dtype: 0-d, 1-d, 2-d, a non-contiguous (transposed) 2-d one, and with
    ``big`` a big one (several staging buffers' bytes)."""

    scalar: torch.Tensor
    vector: torch.Tensor
    matrix: torch.Tensor
    strided: torch.Tensor
    big: torch.Tensor

    def __init__(self, dtype: torch.dtype, big: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.register_buffer("scalar", values(dtype, (), 1))
        self.register_buffer("vector", values(dtype, (7,), 2))
        self.register_buffer("matrix", values(dtype, (5, 6), 3))
        self.register_buffer("strided", values(dtype, (6, 4), 4).t())
        if big is not None:
            self.register_buffer("big", values(dtype, big, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scalar.float() + self.vector.float().sum() + self.strided.float().sum()


def new_values(dtype: torch.dtype, big: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    """New host values for :class:`Typed`: contiguous and non-contiguous sources, and a
    float32 source for a narrower float target (the update casts it)."""
    source = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
    new = {"scalar": values(source, (), 11), "vector": values(dtype, (7,), 12),
           "matrix": values(dtype, (6, 5), 13).t(), "strided": values(dtype, (6, 4), 14).t()}
    if big is not None:
        new["big"] = values(dtype, big, 15)
    return new
