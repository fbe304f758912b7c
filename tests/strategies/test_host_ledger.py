"""A device layer's host ledger: every host buffer counted by kind until it dies, a host
budget that refuses before allocating, a pin budget that makes buffers pageable."""

from __future__ import annotations

import gc

import pytest
import torch

from strategies import CpuDevice, HostBudgetExceeded
from strategies._hostmem import HostLedger


def test_host_buffers_count_until_they_die_and_device_buffers_never() -> None:
    """Host buffers count as pageable on the CPU layer until freed; device-tier ones do not."""
    layer = CpuDevice()
    a = layer.alloc(1000, "host")
    b = layer.alloc(24, "host")
    layer.alloc(4096, "device")
    assert (layer.host.held().pinned, layer.host.held().pageable) == (0, 1024)
    del a
    assert layer.host.held().total == 24
    del b
    gc.collect()
    assert (layer.host.held().total, layer.host.peak) == (0, 1024)


def test_an_allocation_past_the_host_budget_is_refused_before_it_happens() -> None:
    """With 1000 bytes of budget and 900 held, a 200-byte buffer is refused with the numbers
    and nothing is allocated; 100 bytes fit."""
    layer = CpuDevice()
    layer.host.set_budgets(1000, None)
    held = layer.alloc(900, "host")
    allocations = layer.allocations
    with pytest.raises(HostBudgetExceeded) as info:
        layer.alloc(200, "host")
    assert (info.value.needed, info.value.held, info.value.budget) == (200, 900, 1000)
    assert layer.allocations == allocations and layer.host.refused == 1
    assert layer.alloc(100, "host").nbytes == 100
    with layer.host.unbudgeted():
        assert layer.alloc(500, "host").nbytes == 500
    del held


def test_the_pin_budget_makes_a_buffer_pageable_not_refused() -> None:
    """A buffer that wants pinning past the pin budget is pageable (counted so, with the
    footprint of pages for the pinned ones)."""
    ledger = HostLedger(lambda n: (n + 4095) // 4096 * 4096)
    ledger.set_budgets(None, 8192)
    assert ledger.admit(5000, True) is True
    pinned = torch.empty(5000, dtype=torch.uint8)
    ledger.track(pinned, True)
    assert ledger.admit(5000, True) is False and ledger.unpinned == 1
    pageable = torch.empty(5000, dtype=torch.uint8)
    ledger.track(pageable, False)
    assert (ledger.held().pinned, ledger.held().pageable) == (8192, 5000)
    assert ledger.kind(pinned) == (8192, True) and ledger.kind(torch.empty(1)) is None


def test_budgets_must_be_bytes() -> None:
    """A negative budget is refused naming the budget."""
    with pytest.raises(ValueError, match="pin budget must be a non-negative number of bytes"):
        HostLedger(lambda n: n).set_budgets(10, -1)
