"""What the strategy suites (test_strategy_selection.py, test_enable_layerwise.py,
test_placement_around_uses.py, test_layerwise_streaming.py, test_sleep_of_every_mode.py,
test_request_prefetch.py, test_placement_faults.py) share: sizes, models, a layer that
tracks its device bytes, controllers serving a layerwise model."""

from __future__ import annotations

import copy
import itertools
import re
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from lifecycle import LifecycleController
from lifecycle.testing import FaultInjection
from strategies import (
    DeviceLayer,
    LayerwiseOffloadStrategy,
    ResidencyConfig,
)
from strategies.devices import Tier
from tests.helpers import SelectedFaultyDevice, faulty_device, small_pipeline

DIM = 16
NONLAYER_BYTES = 2 * (DIM * DIM + DIM) * 4  # DiT.inp and DiT.out: 2176
# one Block at DIM=16, tensors at 256-byte aligned offsets in one buffer:
# 64 | 64 @256 | 2048 @512 | 128 @2560 | 2048 @2816 | 64 @4864 -> 4928 bytes
LAYER_BYTES = 4928
SMALL_TRANSFORMER_BYTES = (16 * 32 + 32 + 32 * 16 + 16) * 4  # helpers' transformer: 4288
# An offloaded component moves as one buffer, each tensor at a 256-byte aligned offset:
# 2048 (w0) | 128 (b0) -> 2304 | 2048 (w2) -> 4352 | 64 (b2) = 4416 bytes.
OFFLOADED_TRANSFORMER_BYTES = 4416
OFFLOADED_MLP_BYTES = 2368  # 1024 | 64 @1024 | 1024 @1280 | 64 @2304


@pytest.fixture(autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    """The CPU copy thread and OpenMP's spinning intra-op workers oversubscribe a small
    machine (single forwards stall for 100+ ms); one intra-op thread keeps this file fast."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def copied_in_bytes(layer: DeviceLayer, *modules: nn.Module) -> int:
    """Bytes of the parameters and buffers of ``modules`` that are not in ``layer``'s device
    memory (``layer.on_device``): those attach copies into device buffers of the layer's own
    (it keeps the module's own storages when they are on the device). None of a CPU-built
    model on the CPU layers; all of it on a GPU whose memory is its own (the simulated GPU
    with ``RESIDENCY_SIM_HOST_MODULES=1``). Ask it of a model before its attach (or of a
    copy placed as it was)."""
    tensors = itertools.chain.from_iterable(
        itertools.chain(m.parameters(), m.buffers()) for m in modules)
    return sum(t.nbytes for t in tensors if not layer.on_device(t))


def raises_exactly(kind: type[Exception], message: str) -> pytest.RaisesExc[Exception]:
    """Expect ``kind`` with exactly ``message``."""
    return pytest.raises(kind, match=f"^{re.escape(message)}$")


class TrackingDevice(SelectedFaultyDevice):
    """Counts the bytes of live device-tier buffers the layer allocated, and their peak
    (checked at every allocation, so buffers of prefetches still in flight count too).

    Each copy batch is emptied once copied: the worker threads (anyio's, the copier's) keep
    their last arguments referenced for a moment after reporting completion, which on the
    CPU stand-in keeps an evicted layer's buffer alive past its eviction."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0

    def alloc(self, nbytes: int, tier: Tier, **kwargs: Any) -> torch.Tensor:
        buf = super().alloc(nbytes, tier, **kwargs)
        if tier == "device":
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(buf, self._freed, nbytes)
        return buf

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def _copy_batch(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super()._copy_batch(pairs)
        pairs.clear()


# The models.


class Block(nn.Module):
    """A DiT-like block: pre-norm MLP with a residual."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))  # type: ignore[no-any-return]


class DiT(nn.Module):
    """Input projection, ``n`` blocks, output projection; ``order`` picks which blocks run."""

    def __init__(self, n: int = 6, dim: int = DIM) -> None:
        super().__init__()
        self.inp = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(n))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, order: Sequence[int] | None = None) -> torch.Tensor:
        h = self.inp(x)
        for i in range(len(self.blocks)) if order is None else order:
            h = self.blocks[i](h)
        return self.out(h)  # type: ignore[no-any-return]


class Counting(nn.Module):
    """A two-layer MLP that counts how often its forward body ran."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, DIM)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.fc2(torch.nn.functional.gelu(self.fc1(x)))  # type: ignore[no-any-return]


class Stack(nn.Module):
    """A holder of one block list (so that its name is dotted)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))


class TwoLists(nn.Module):
    """An encoder and a decoder block list, plus a head."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Stack(2)
        self.decoder = Stack(3)
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.encoder.layers, *self.decoder.layers]:
            x = block(x)
        return self.head(x)  # type: ignore[no-any-return]


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))


def fsdp_managed(module: nn.Module) -> nn.Module:
    """Make ``module`` an FSDP2 module without a process group (class swap)."""
    module.__class__ = type(f"FSDP{type(module).__name__}", (FSDPModule, type(module)), {})
    return module


def pointers(module: nn.Module) -> list[int]:
    return [t.data_ptr() for t in [*module.parameters(), *module.buffers()]]


def x_in(batch: int = 3) -> torch.Tensor:
    return torch.linspace(-2, 2, batch * DIM).reshape(batch, DIM)


def layerwise_config(prefetch: float = 1.0, resident: float = 0.0,
                     policy: str = "leading") -> ResidencyConfig:
    return ResidencyConfig.parse("transformer=layerwise-offload", prefetch={"transformer": prefetch},
                                 resident_layers={"transformer": resident},
                                 policy={"transformer": policy})


async def attach_layerwise(config: ResidencyConfig, n: int = 6, layer: FaultInjection | None = None
                           ) -> tuple[LifecycleController, DiT, DiT, LayerwiseOffloadStrategy]:
    """A controller serving a layerwise DiT, a resident copy of the same weights, the strategy."""
    torch.manual_seed(0)
    model = DiT(n)
    reference = copy.deepcopy(model)
    ctl = LifecycleController(device_layer=layer or faulty_device(), residency=config)
    await ctl.attach({"transformer": model})
    strategy = ctl.strategy("transformer")
    assert isinstance(strategy, LayerwiseOffloadStrategy)
    return ctl, model, reference, strategy


def sample_device_bytes(ctl: LifecycleController, model: DiT, name: str = "transformer") -> list[int]:
    """Pre-hooks registered after attach (so after the library's): the component's device
    bytes as each block starts."""
    samples: list[int] = []

    def hook(module: nn.Module, args: tuple[object, ...]) -> None:
        samples.append(ctl.report().components[name].device_bytes)

    for block in model.blocks:
        block.register_forward_pre_hook(hook)
    return samples


def device_layers(strategy: LayerwiseOffloadStrategy) -> set[int]:
    return {i for i, u in enumerate(strategy.units) if u is not None and u.where == "device"}


async def offload_all(drain_timeout: float = 30.0) -> tuple[LifecycleController, FaultInjection]:
    layer = faulty_device()
    ctl = LifecycleController(device_layer=layer, residency="all=component-offload",
                              drain_timeout=drain_timeout)
    await ctl.attach(small_pipeline())
    return ctl, layer
