"""Fault-injecting device layers, beside the device layer they wrap: for testing code that
uses this library (and for this library's own tests). Private: :mod:`lifecycle.testing`, the
one public testing entry, re-exports them.

:class:`FaultInjection` makes a device layer fail the k-th copy or allocation, or slow every
copy down, so that rollback and cancellation paths run for real; :class:`FaultyDevice` is
the CPU layer with it, :func:`faulty_device_layer` the right one for any device. It counts
every copy and allocation so a test can enumerate every failure point::

    probe = FaultyDevice()
    ... run the operation once with probe, note probe.copies ...
    for k in range(1, probe.copies + 1):
        layer = FaultyDevice(fail_copy_at=k)
        ...

:class:`OrderingDevice` (and :class:`OrderingFaultyDevice`, the same with fault injection)
runs the CUDA path's ordering on CPU: copies land late and only when waited for, poison (NaN)
until then, and a buffer freed, overwritten or read out of order is reported
(:class:`OrderingViolation`); see :mod:`strategies.checking._ordering`.
"""

from __future__ import annotations

import random
import time
import weakref
from collections.abc import Sequence
from typing import Any

import anyio
import torch

from .._fileread import FileRegion
from .._threads import to_thread
from ..devices import (
    CpuDevice,
    CudaDevice,
    CudaRuntime,
    DeviceLayer,
    Tier,
    cpu_layer_kind,
    layer_seed,
    resolve_device,
)
from ._cudasim import checking_sim
from ._ordering import OrderingDevice

__all__ = ["FaultInjection", "FaultyCudaDevice", "FaultyDevice", "InjectedFault",
           "OrderingFaultyDevice", "faulty_cpu_layer_class", "faulty_device_layer",
           "sim_cuda_layer"]


class InjectedFault(RuntimeError):
    """The failure a fault-injecting layer raises at its chosen point."""


class FaultInjection(DeviceLayer):
    """Mixin for a device layer: fails the ``fail_copy_at``-th copy or the
    ``fail_alloc_at``-th allocation (1-based, counted over the layer's life), sleeps
    ``copy_delay`` seconds in every copy and ``alloc_delay`` in every allocation, each plus
    up to ``jitter`` seconds at random (seeded by ``seed``): races show up. Copies before the
    failing one really happen: the failure is a real partial move."""

    def __init__(self, *args: Any, fail_copy_at: int | None = None,
                 fail_alloc_at: int | None = None, copy_delay: float = 0.0,
                 alloc_delay: float = 0.0, jitter: float = 0.0, seed: int = 0) -> None:
        super().__init__(*args)
        self.fail_copy_at = fail_copy_at
        self.fail_alloc_at = fail_alloc_at
        self.copy_delay = copy_delay
        self.alloc_delay = alloc_delay
        self.jitter = jitter  # up to this many seconds more, at random, for each delay
        self._random = random.Random(seed)
        self.faults = 0
        # id -> weak reference, removed by the reference's callback when the buffer dies
        self._device_buffers: dict[int, weakref.ref[torch.Tensor]] = {}

    @property
    def live_device_bytes(self) -> int:
        """Bytes of device buffers this layer allocated that are still alive (whatever the
        report says): a leak check that needs no allocator statistics."""
        return sum(t.nbytes for r in list(self._device_buffers.values())
                   if (t := r()) is not None)

    def arm(self, *, copy_at: int | None = None, alloc_at: int | None = None) -> None:
        """Fail the ``copy_at``-th / ``alloc_at``-th operation from now on (1 = the next)."""
        self.fail_copy_at = None if copy_at is None else self.copies + copy_at
        self.fail_alloc_at = None if alloc_at is None else self.allocations + alloc_at

    def _delay(self, seconds: float) -> None:
        if seconds or self.jitter:
            time.sleep(seconds + self._random.uniform(0.0, self.jitter))

    def _alloc(self, nbytes: int, tier: Tier, pinned: bool) -> torch.Tensor:
        self._delay(self.alloc_delay)
        if self.allocations == self.fail_alloc_at:
            self.faults += 1
            self.fail_alloc_at = None
            raise InjectedFault(f"injected allocation failure ({tier}, {nbytes} bytes)")
        buf = super()._alloc(nbytes, tier, pinned)
        if tier == "device":
            key = id(buf)
            self._device_buffers[key] = weakref.ref(
                buf, lambda _, key=key: self._device_buffers.pop(key, None))  # type: ignore[misc]
        return buf

    def _copy_one(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self._delay(self.copy_delay)
        if self.copies + 1 == self.fail_copy_at:
            self.faults += 1
            self.fail_copy_at = None
            raise InjectedFault(f"injected copy failure ({src.nbytes} bytes)")
        super()._copy_one(dst, src)

    async def read_file(self, reads: Sequence[tuple[torch.Tensor, FileRegion]],
                        limiter: anyio.CapacityLimiter | None = None) -> None:
        """File reads are copies here too (one per tensor): delayed, counted, and failed at
        the armed one, after the reads before it really happened (a real partial write)."""
        reads = list(reads)
        if self.copy_delay or self.jitter:
            await to_thread(self._delay, self.copy_delay * len(reads))
        fail = None if self.fail_copy_at is None else self.fail_copy_at - self.copies - 1
        if fail is None or not 0 <= fail < len(reads):
            await super().read_file(reads, limiter)
            return
        await super().read_file(reads[:fail], limiter)
        with self._count_lock:
            self.copies += 1
        self.faults += 1
        self.fail_copy_at = None
        raise InjectedFault(f"injected read failure ({reads[fail][1].nbytes} bytes of "
                            f"{reads[fail][1].path})")


class FaultyDevice(FaultInjection, CpuDevice):
    """The CPU device layer with fault injection."""

    def __init__(self, device: torch.device | None = None, *, fail_copy_at: int | None = None,
                 fail_alloc_at: int | None = None, copy_delay: float = 0.0,
                 alloc_delay: float = 0.0, jitter: float = 0.0, seed: int = 0) -> None:
        super().__init__(device, fail_copy_at=fail_copy_at, fail_alloc_at=fail_alloc_at,
                         copy_delay=copy_delay, alloc_delay=alloc_delay, jitter=jitter, seed=seed)


class OrderingFaultyDevice(FaultInjection, OrderingDevice):
    """:class:`FaultyDevice` on the ordering layer (:class:`OrderingDevice`: copies land
    late, only when waited for, and every ordering mistake is reported). Copies are counted,
    delayed and failed where they start (as CUDA enqueues them); ``ordering_seed`` seeds the
    landing delays (default: ``seed``), each up to ``max_delay`` seconds."""

    def __init__(self, device: torch.device | None = None, *, fail_copy_at: int | None = None,
                 fail_alloc_at: int | None = None, copy_delay: float = 0.0,
                 alloc_delay: float = 0.0, jitter: float = 0.0, seed: int = 0,
                 ordering_seed: int | None = None, max_delay: float = 0.002) -> None:
        super().__init__(device, fail_copy_at=fail_copy_at, fail_alloc_at=fail_alloc_at,
                         copy_delay=copy_delay, alloc_delay=alloc_delay, jitter=jitter, seed=seed)
        self.max_delay = max_delay
        self._ord_delays = random.Random(seed if ordering_seed is None else ordering_seed)


class FaultyCudaDevice(FaultInjection, CudaDevice):
    """The CUDA device layer with fault injection (``runtime``: a simulated GPU, say)."""

    def __init__(self, device: torch.device | None = None, runtime: CudaRuntime | None = None,
                 *, fail_copy_at: int | None = None, fail_alloc_at: int | None = None,
                 copy_delay: float = 0.0, alloc_delay: float = 0.0, jitter: float = 0.0,
                 seed: int = 0) -> None:
        super().__init__(device or torch.device("cpu"), runtime, fail_copy_at=fail_copy_at,
                         fail_alloc_at=fail_alloc_at, copy_delay=copy_delay,
                         alloc_delay=alloc_delay, jitter=jitter, seed=seed)


class _SeededOrderingFaultyDevice(OrderingFaultyDevice):
    """:class:`OrderingFaultyDevice` as :data:`~strategies.devices._layers.DEVICE_LAYER_ENV` selects it
    for a CPU device: landing delays seeded from :func:`layer_seed` unless ``ordering_seed``
    is given (a test seeds the layers it makes, so a failure replays)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("ordering_seed", layer_seed())
        super().__init__(*args, **kwargs)


class _SimFaultyDevice(FaultyCudaDevice):
    """:class:`FaultyCudaDevice` over a simulated GPU seeded from :func:`layer_seed`: the
    fault-injecting layer ``RESIDENCY_DEVICE_LAYER=cuda-sim`` selects for a CPU device."""

    def __init__(self, device: torch.device | None = None, **faults: Any) -> None:
        super().__init__(device, checking_sim(), **faults)


def faulty_cpu_layer_class() -> type[FaultInjection]:
    """The fault-injecting layer class for a CPU device that :data:`DEVICE_LAYER_ENV` selects
    now (made as :class:`FaultyDevice` is: ``cls(device=None, **faults)``):
    :class:`FaultyDevice`, the ordering one, or the CUDA one over a simulated GPU."""
    kind = cpu_layer_kind()
    if kind == "ordering":
        return _SeededOrderingFaultyDevice
    if kind == "cuda-sim":
        return _SimFaultyDevice
    return FaultyDevice


def sim_cuda_layer(**sim: Any) -> CudaDevice:
    """:class:`~strategies.devices._cuda.CudaDevice` over a simulated GPU (:class:`SimCuda`, made with
    ``sim``: ``seed``, ``max_lag``, ``capacity``, ``workspace_bytes``, ... as
    :func:`~strategies.checking._cudasim.checking_sim` makes it): the CUDA layer's own code on
    the CPU."""
    return CudaDevice(torch.device("cpu"), checking_sim(**sim))


def faulty_device_layer(device: str | torch.device | None = None, **faults: Any
                        ) -> FaultInjection:
    """A fault-injecting layer for ``device`` (see :func:`strategies.resolve_device`; on a
    CPU device, the one :func:`faulty_cpu_layer_class` selects: the ordering one or the CUDA
    one over a simulated GPU when ``RESIDENCY_DEVICE_LAYER`` asks for it)."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return FaultyCudaDevice(dev, **faults)
    return faulty_cpu_layer_class()(dev, **faults)
