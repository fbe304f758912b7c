"""The virtual-memory arena of ``resident-stable`` and its simulation: the driver's rules
(granularity, access after map, poison when unmapped, the context per thread), packing, and
tensors of every dtype, tied and aliased, kept at their addresses by sleep and wake while a
simulated graph captured on them replays."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import nn

from lifecycle import LifecycleController
from lifecycle.testing import sim_cuda_layer
from strategies.checking._vmmsim import GraphReplayFault, SimGraph, SimVmm, check_access
from strategies.devices._vmm import ALIGN, Arena, VmmError, graph_capturing

pytestmark = pytest.mark.anyio

MiB = 2**20


def current(sim: SimVmm) -> SimVmm:
    sim.make_current()
    return sim


def test_small_tensors_are_packed_at_aligned_offsets_in_one_granule() -> None:
    sim = current(SimVmm())
    arena = Arena(sim, [("a", 10), ("b", 3000), ("c", 1)], "test")
    assert [o for o, _ in arena.offsets.values()] == [0, ALIGN, ALIGN * 7]
    assert arena.size == 2 * MiB and arena.waste == 2 * MiB - 3011
    assert arena.map() and not arena.map()  # mapped once
    assert all(arena.holds(arena.view(k)) for k in "abc")
    arena.close()
    assert sim.log == ["cuMemGetAllocationGranularity", "cuMemAddressReserve", "cuMemCreate",
                       "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease",
                       "cuMemAddressFree"]


def test_the_driver_refuses_sizes_off_the_granularity_and_a_call_without_a_context() -> None:
    sim = current(SimVmm())
    with pytest.raises(VmmError, match="granularity"):
        sim.reserve(MiB)
    va = sim.reserve(2 * MiB)
    handle = sim.create(2 * MiB)
    errors: list[BaseException] = []

    def other_thread() -> None:
        try:
            sim.map(va, 2 * MiB, handle)
        except VmmError as exc:
            errors.append(exc)

    thread = threading.Thread(target=other_thread, name="no-context")
    thread.start()
    thread.join()
    assert len(errors) == 1 and "invalid device context" in str(errors[0])
    assert "no-context" in str(errors[0])


def test_mapped_memory_needs_access_and_unmapped_memory_is_fatal_and_poisoned() -> None:
    sim = current(SimVmm())
    va = sim.reserve(2 * MiB)
    with pytest.raises(GraphReplayFault, match="unmapped"):
        check_access(va + 100, 4, "a read")
    handle = sim.create(2 * MiB)
    sim.map(va, 2 * MiB, handle)
    with pytest.raises(GraphReplayFault, match="without access"):
        check_access(va, 4, "a read")
    sim.set_access(va, 2 * MiB)
    check_access(va, 4, "a read")
    mem = sim.bytes_at(va, 2 * MiB)
    mem.fill_(7)
    sim.unmap(va, 2 * MiB)
    sim.release(handle)
    assert int(mem.min()) == 0xFF  # poison: NaN in float dtypes
    with pytest.raises(VmmError, match="nothing is mapped"):
        sim.set_access(va, 2 * MiB)
    sim.free(va, 2 * MiB)
    assert sim.physical_bytes == 0


def test_a_failed_map_undoes_the_calls_before_it() -> None:
    for k in (1, 2, 3):  # cuMemCreate, cuMemMap, cuMemSetAccess
        sim = current(SimVmm())
        arena = Arena(sim, [("a", 4096)], "test")
        sim.fail_at = sim.calls + k
        with pytest.raises(VmmError, match="injected"):
            arena.map()
        assert not arena.mapped and sim.physical_bytes == 0
        assert arena.map()  # a retry maps at the same addresses
        arena.close()


class Mixed(nn.Module):
    """Every dtype the arena must keep, a tied weight and a view of another tensor."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = nn.Embedding(32, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.proj = nn.Linear(16, 16).to(torch.bfloat16)
        self.scale = nn.Parameter(torch.rand(16, generator=g).to(torch.float16))
        self.register_buffer("table", torch.randn(4, 16, generator=g).to(torch.float8_e4m3fn))
        self.register_buffer("counts", torch.arange(16, dtype=torch.int64))
        self.register_buffer("first", self.counts[:4])  # a view of another buffer
        self.counts: torch.Tensor
        self.first: torch.Tensor
        self.table: torch.Tensor

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = x + self.proj(x.to(torch.bfloat16)).float() * self.scale.float()
        x = x + self.table.float().sum(0) + self.counts.float() + self.first.float().sum()
        out: torch.Tensor = self.head(x)
        return out


async def test_every_dtype_tied_and_aliased_tensors_keep_their_addresses_across_sleep_and_wake(
        ) -> None:
    model: Any = Mixed()
    ids = torch.arange(6).reshape(1, 6)
    with torch.no_grad():
        expected = model(ids)
    async with LifecycleController(residency={"mixed": "resident-stable"}) as ctl:
        await ctl.attach({"mixed": model})
        arena = ctl._components["mixed"].strategy.store.arena
        assert arena is not None
        tensors = dict(model.named_parameters()) | dict(model.named_buffers())
        placed = {n: (t.dtype, t.data_ptr()) for n, t in tensors.items()}
        assert all(arena.holds(t) for t in tensors.values())
        assert model.head.weight is model.emb.weight
        graph = SimGraph(model, getattr(ctl._layer, "runtime", None))
        assert torch.equal(graph.capture(ids), expected)
        for _ in range(3):
            await ctl.sleep()
            await ctl.wake()
            assert {n: (t.dtype, t.data_ptr()) for n, t in tensors.items()} == placed
            assert model.first.data_ptr() == model.counts.data_ptr()  # still a view
            with torch.no_grad():
                assert torch.equal(model(ids), expected)
            assert torch.equal(graph.replay(), expected)
    assert not any(arena.holds(t) for t in tensors.values())  # detached: ordinary memory
    with torch.no_grad():
        assert torch.equal(model(ids), expected)


@pytest.mark.parametrize("arrives", ["built on the host", "attached again after a detach"])
async def test_tensors_in_host_memory_attach_resident_stable_into_a_mapped_arena(
        arrives: str) -> None:
    """A model in host memory (built on the CPU, with a GPU's memory its own; or handed back
    by a detach and attached again) attaches resident-stable by copies into its arena: the
    arena stays mapped through the commit of every move of the attach, and the model serves
    its own outputs from it, through a sleep and a wake too."""
    model: Any = Mixed()
    ids = torch.arange(6).reshape(1, 6)
    with torch.no_grad():
        expected = model(ids)
    layer = sim_cuda_layer(host_modules=True) if arrives == "built on the host" else None
    async with LifecycleController(device_layer=layer,
                                   residency={"mixed": "resident-stable"}) as ctl:
        if arrives != "built on the host":
            await ctl.attach({"mixed": model})
            await ctl.detach()
        assert not any(ctl._layer.on_device(t) for t in model.parameters())
        await ctl.attach({"mixed": model})
        store = ctl._components["mixed"].strategy.store
        assert store.arena is not None and store.arena.mapped
        for _ in range(2):
            assert all(store.arena.holds(t) for t in model.parameters())
            with torch.no_grad():
                assert torch.equal(model(ids), expected)
            await ctl.sleep()
            await ctl.wake()


def test_a_simulated_capture_is_seen_by_the_cpu_layers_compute_check() -> None:
    seen: list[bool] = []

    class Probe(nn.Module):
        def forward(self, x: Any) -> Any:
            seen.append(graph_capturing())
            return x

    SimGraph(Probe()).capture(torch.ones(1))
    assert seen == [True] and not graph_capturing()
