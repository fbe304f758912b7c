"""Writing new values into a store's tensors (strategies._write), no controller: in place
wherever each tensor lives, undoable until commit, everything written restored after a
failure at any copy, allocation or read, and the host mirrors brought up to date in the
background after the commit."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lifecycle.testing import FaultInjection, InjectedFault
from strategies import DeviceLayer
from strategies.protocol import (
    FileRegion,
    TensorStore,
    WriteMove,
    WriteSource,
    forget_locals,
    safetensors_regions,
)
from tests.helpers import TiedLM
from tests.strategies.device_modules import device_store

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

NAMES = ["blocks.0.1.weight", "blocks.2.1.bias", "head.weight", "scale"]


def values(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in module.state_dict(keep_vars=True).items()}


def same(module: torch.nn.Module, expected: Mapping[str, torch.Tensor]) -> bool:
    now = values(module)
    return all(torch.equal(now[n], t) for n, t in expected.items())


def fresh_values(store: TensorStore, names: list[str] = NAMES) -> dict[str, torch.Tensor]:
    """New values for ``names``: the live tensors' shapes and dtypes, other contents."""
    gen = torch.Generator().manual_seed(7)
    out = {}
    for name in names:
        live = store.tensor_named(name)
        assert live is not None
        out[name] = torch.randn(live.shape, generator=gen).to(live.dtype)
    return out


def sources(new: Mapping[str, torch.Tensor], regions: Mapping[str, FileRegion] | None = None
            ) -> list[WriteSource]:
    return [WriteSource(n, functools.partial(torch.Tensor.clone, v),
                        None if regions is None else regions[n]) for n, v in new.items()]


def file_regions(new: Mapping[str, torch.Tensor], path: Path) -> dict[str, FileRegion]:
    """``new`` saved as a safetensors file, and where each value's bytes are in it."""
    save_file({n: v.contiguous() for n, v in new.items()}, str(path))
    return {n: FileRegion(str(path), offset, nbytes, new[n].dtype)
            for n, (offset, nbytes) in safetensors_regions(path).items()}


async def mirrored(store: TensorStore) -> None:
    """A round trip to the host: every unit on the device with a current host mirror."""
    (await store.prepare_to_host(store.units)).commit()
    (await store.prepare_to_device(store.units)).commit()


async def offloaded(store: TensorStore) -> None:
    (await store.prepare_to_host(store.units)).commit()


# Where the store's tensors are when the write comes: on the device without a host copy (the
# write backs them up), on the device with a current mirror (the mirror is the backup), or
# in the host copy of an offloaded component.
PLACES = ["on the device", "mirrored", "offloaded"]


async def setup(store: TensorStore, where: str) -> None:
    if where == "mirrored":
        await mirrored(store)
    elif where == "offloaded":
        await offloaded(store)


@pytest.mark.parametrize("where", PLACES)
async def test_a_write_lands_in_place_and_the_commit_keeps_it(
        layer: DeviceLayer, where: str) -> None:
    """Prepared, the new values are in the live tensors (the same objects at the same
    addresses, a tied weight under either name); committed, they stay."""
    lm = TiedLM()
    store = device_store("lm", lm, layer, whole=where == "offloaded")
    await setup(store, where)
    new = fresh_values(store)
    addresses = [t.data_ptr() for t in lm.state_dict().values()]
    move = await store.prepare_write(sources(new))
    assert same(lm, new) and torch.equal(lm.embed.weight, new["head.weight"])
    assert move.bytes_copied == sum(v.nbytes for v in new.values())
    move.commit()
    assert same(lm, new)
    assert [t.data_ptr() for t in lm.state_dict().values()] == addresses
    await store.land_refresh()


@pytest.mark.parametrize("where", PLACES)
async def test_an_undone_write_restores_every_tensor(layer: DeviceLayer, where: str) -> None:
    """Undone instead of committed (another component's write failed), every tensor has its
    old value again, and a mirror that was current still is (the next sleep copies nothing)."""
    lm = TiedLM()
    before = values(lm)
    store = device_store("lm", lm, layer, whole=where == "offloaded")
    await setup(store, where)
    move = await store.prepare_write(sources(fresh_values(store)))
    await move.undo()
    assert same(lm, before)
    if where == "mirrored":
        assert (await store.prepare_to_host(store.units)).bytes_copied == 0


@pytest.mark.parametrize("from_file", [False, True], ids=["loaded", "from a file"])
@pytest.mark.parametrize("where", PLACES)
async def test_a_write_failing_at_any_copy_or_allocation_restores_what_it_wrote(
        faulty: Callable[..., FaultInjection], tmp_path: Path, where: str, from_file: bool) -> None:
    """Whichever copy (a backup, a write, a read from the file) or allocation (a backup)
    fails, every tensor has its old value, the report is as before, a current mirror is still
    current, and (the failure's frames forgotten) no backup is left alive."""
    for kind in ("copy", "alloc"):
        k = 0
        while True:
            k += 1
            layer = faulty()
            lm = TiedLM()
            before = values(lm)
            store = device_store("lm", lm, layer, whole=where == "offloaded")
            await setup(store, where)
            new = fresh_values(store)
            regions = file_regions(new, tmp_path / f"{kind}{k}.safetensors") if from_file else None
            report, live = store.report(), layer.live_device_bytes
            layer.arm(**{f"{kind}_at": k})
            try:
                move = await store.prepare_write(sources(new, regions))
            except InjectedFault as exc:
                forget_locals(exc)
            else:
                move.commit()
                await store.land_refresh()
                break
            assert same(lm, before) and store.report() == report
            assert layer.live_device_bytes == live
            if where == "mirrored":
                assert (await store.prepare_to_host(store.units)).bytes_copied == 0
        assert same(lm, new)
        assert k > 1 or (kind == "alloc" and where != "on the device")  # (no backup: no alloc)


async def test_a_loader_that_raises_leaves_every_tensor_as_it_was(layer: DeviceLayer) -> None:
    """A source whose loader raises: the tensors written before it are restored, and its
    error propagates as it is."""
    lm = TiedLM()
    before = values(lm)
    store = device_store("lm", lm, layer)
    new = fresh_values(store)

    def broken() -> torch.Tensor:
        raise OSError("checkpoint shard unreadable")

    with pytest.raises(OSError, match="checkpoint shard unreadable"):
        await store.prepare_write([*sources(new), WriteSource("blocks.1.1.weight", broken)])
    assert same(lm, before)


async def test_after_the_commit_the_mirrors_catch_up_in_the_background(layer: DeviceLayer) -> None:
    """Settled, a committed write starts refreshing the host mirrors of what it wrote; once
    that landed, the next move to the host copies nothing and finds the new values there."""
    lm = TiedLM()
    store = device_store("lm", lm, layer)
    await mirrored(store)
    new = fresh_values(store)
    move: WriteMove = await store.prepare_write(sources(new))
    move.commit()
    assert await move.settle() is None
    assert await store.land_refresh() is None
    sleep = await store.prepare_to_host(store.units)
    sleep.commit()
    assert sleep.bytes_copied == 0 and same(lm, new)


async def test_a_write_makes_a_tensor_dirty_until_its_mirror_is_refreshed(
        layer: DeviceLayer) -> None:
    """Without the background refresh (not settled), the written tensors' units are the ones
    the next move to the host copies, and only those."""
    lm = TiedLM()
    store = device_store("lm", lm, layer)
    await mirrored(store)
    written = ["blocks.0.1.weight"]
    (await store.prepare_write(sources(fresh_values(store, written)))).commit()
    sleep = await store.prepare_to_host(store.units)
    sleep.commit()
    assert sleep.bytes_copied == store.slot_named("blocks.0.1.weight")[1].nbytes == 1024
