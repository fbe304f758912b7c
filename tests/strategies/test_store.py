"""A TensorStore on its own, no controller: what its inventory finds (tied weights, views,
regions of a flat buffer, recomputed weights, buffers that are not state), its moves to the
host and back, the bytes it copies only when something changed, and what a failed or
cancelled move leaves (nothing)."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import anyio
import pytest
import torch
from torch import nn

import strategies._store as store_module
from lifecycle.testing import FaultInjection, InjectedFault
from strategies import DeviceLayer, StoreError
from strategies.protocol import StoreReport, TensorStore, forget_locals, prepare_discard, prepare_undiscard
from tests.helpers import TiedLM
from tests.strategies.device_modules import device_store, on_the_device

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


class Extras(nn.Module):
    """A parameter, a persistent and a non-persistent buffer, a tensor attribute, and a tensor
    in a list attribute."""

    scale: torch.Tensor
    table: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 2.0))
        self.register_buffer("table", torch.arange(8, dtype=torch.float32), persistent=False)
        self.cache = torch.linspace(0, 1, 16)
        self.rotary = [torch.ones(3)]


class Packed(nn.Module):
    """Three parameters packed into one flat buffer, as another offloading tool leaves them:
    ``a.weight`` at bytes 0-63, ``b.weight`` at 128-191, and ``b.bias`` overlapping it."""

    def __init__(self) -> None:
        super().__init__()
        flat = torch.arange(64, dtype=torch.float32)
        self.a = nn.Module()
        self.b = nn.Module()
        self.a.weight = nn.Parameter(flat[0:16].view(4, 4))
        self.b.weight = nn.Parameter(flat[32:48].view(4, 4))
        self.b.bias = nn.Parameter(flat[44:48])


def normed() -> nn.Sequential:
    """A weight_norm and a spectral_norm layer: their ``weight`` is recomputed each forward."""
    torch.manual_seed(0)
    with warnings.catch_warnings():  # (torch deprecates this weight_norm for another one)
        warnings.simplefilter("ignore", FutureWarning)
        first = nn.utils.weight_norm(nn.Linear(16, 32))
    return nn.Sequential(first, nn.utils.spectral_norm(nn.Linear(32, 8)))


def values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in module.state_dict(keep_vars=True).items()}


def same(module: nn.Module, before: dict[str, torch.Tensor]) -> bool:
    now = values(module)
    return now.keys() == before.keys() and all(torch.equal(now[n], before[n]) for n in now)


def pointers(module: nn.Module) -> list[int]:
    return [t.data_ptr() for t in module.state_dict(keep_vars=True).values()]


async def offloaded(store: TensorStore) -> None:
    """Send every unit of ``store`` to the host."""
    (await store.prepare_to_host(store.units)).commit()


async def placed(store: TensorStore) -> None:
    """Bring every unit of ``store`` to the device."""
    (await store.prepare_to_device(store.units)).commit()


# -- inventory ----------------------------------------------------------------------------

def test_tied_weights_are_one_tensor_under_every_name(layer: DeviceLayer) -> None:
    """A weight tied to another module's is one slot with both names, listed once."""
    lm = TiedLM()
    store = device_store("lm", lm, layer)
    embed, _ = store.slot_named("embed.weight")
    assert store.slot_named("head.weight")[0] is embed
    assert embed.names == ["embed.weight", "head.weight"]
    assert [n for n, _ in store.named_tensors()].count("embed.weight") == 1
    assert "head.weight" not in dict(store.named_tensors())


def test_a_view_shares_its_tensors_storage_and_stops_being_a_view(layer: DeviceLayer) -> None:
    """A buffer registered as a view of a parameter's row shares that parameter's storage (one
    unit), and no longer keeps the tensor it was sliced from alive."""
    lm = TiedLM()
    assert lm.first_row._base is not None
    store = device_store("lm", lm, layer)
    unit = store.slot_named("first_row")[1]
    assert unit is store.slot_named("embed.weight")[1]
    assert [[s.names for s in st.slots] for st in unit.storages] == [
        [["first_row"], ["embed.weight", "head.weight"]]]
    assert unit.nbytes == lm.embed.weight.nbytes
    assert lm.first_row._base is None
    assert lm.first_row.untyped_storage().data_ptr() == lm.embed.weight.untyped_storage().data_ptr()


def test_a_flat_buffer_is_cut_into_one_region_per_group_of_overlapping_tensors(
        layer: DeviceLayer) -> None:
    """Parameters packed into one storage move as regions: disjoint tensors apart (each with its
    layer), overlapping ones together; every region remembers the storage it came from."""
    store = device_store("p", Packed(), layer, ["a", "b"])
    assert {u.key: [(st.base, st.nbytes) for st in u.storages] for u in store.units} == {
        "a": [(0, 64)], "b": [(128, 64)]}
    assert [s.names for s in store.by_key["b"].slot_list] == [["b.weight"], ["b.bias"]]
    origins = {st.origin for st in store.storages()}
    assert len(origins) == 1 and origins.pop()[1] == 64 * 4


async def test_regions_of_a_flat_buffer_move_on_their_own(layer: DeviceLayer) -> None:
    """One region goes to the host and back while the other stays; values and views are kept
    (the overlapping bias still views the weight's bytes)."""
    module = Packed()
    before = values(module)
    store = device_store("p", module, layer, ["a", "b"])
    (await store.prepare_to_host([store.by_key["b"]])).commit()
    assert [u.where for u in store.units] == ["device", "host"]
    assert same(module, before)
    (await store.prepare_to_device([store.by_key["b"]])).commit()
    assert same(module, before)
    with torch.no_grad():
        module.get_parameter("b.weight")[3, 0] = -1.0
    assert module.get_parameter("b.bias")[0] == -1.0


def test_recomputed_weights_are_derived_not_inventoried(layer: DeviceLayer) -> None:
    """weight_norm's and spectral_norm's ``weight`` is no tensor of the store: the store knows
    it as derived from the parameters it is computed from."""
    store = device_store("n", normed(), layer)
    assert sorted(n for n, _ in store.named_tensors()) == [
        "0.bias", "0.weight_g", "0.weight_v", "1.bias", "1.weight_orig", "1.weight_u",
        "1.weight_v"]
    assert store.tensor_named("0.weight") is None
    assert [(d.name, d.full_nbytes()) for d in store.derived] == [("weight", 2048), ("weight", 1024)]


async def test_recomputed_weights_are_released_with_their_parameters_and_computed_again(
        layer: DeviceLayer) -> None:
    """On the host a recomputed weight is an empty placeholder; back on the device it is what
    its hook computes, bit for bit."""
    module = normed()
    store = device_store("n", module, layer)
    first = module[0]
    assert isinstance(first, nn.Linear)
    expected = first.weight.detach().clone()
    await offloaded(store)
    assert first.weight.numel() == 0
    await placed(store)
    assert torch.equal(first.weight, expected)


def test_state_is_what_an_update_can_bring_back(layer: DeviceLayer) -> None:
    """Parameters and persistent buffers are state; non-persistent buffers and tensor
    attributes (plain or in a list) are managed too, but are not."""
    store = device_store("x", Extras(), layer)
    assert {n: s.state for n, s in ((n, store.slot_named(n)[0]) for n, _ in store.named_tensors())} == {
        "cache": False, "lin.bias": True, "lin.weight": True, "rotary[0]": False, "scale": True,
        "table": False}


async def test_strides_of_a_transposed_parameter_survive_a_round_trip(layer: DeviceLayer) -> None:
    """A non-contiguous parameter keeps its strides (and values) through host and device."""
    module = nn.Linear(4, 8)
    module.weight = nn.Parameter(torch.randn(4, 8).t())
    before = values(module)
    store = device_store("t", module, layer)
    await offloaded(store)
    assert module.weight.stride() == (1, 8) and same(module, before)
    await placed(store)
    assert module.weight.stride() == (1, 8) and same(module, before)


def _meta() -> nn.Module:
    return nn.Linear(2, 2, device="meta")


def _inference() -> nn.Module:
    with torch.inference_mode():
        return nn.Linear(2, 2)


@pytest.mark.parametrize(("make", "message"), [
    (_meta, "tensor 'weight' of component 'x' is on the meta device"),
    (_inference, "tensor 'weight' of component 'x' is an inference tensor"),
], ids=["meta", "inference"])
def test_tensors_that_cannot_be_placed_are_refused_by_name(
        layer: DeviceLayer, make: Callable[[], nn.Module], message: str) -> None:
    """A meta tensor or an inference tensor is refused when the store takes inventory."""
    with pytest.raises(StoreError, match=message):
        TensorStore("x", make(), layer)


async def test_stale_tensors_stay_stale_through_a_rescan(layer: DeviceLayer) -> None:
    """Tensors a discarding sleep dropped are stale after the wake, and a new inventory of the
    module (a rescan) still says so."""
    store = device_store("x", Extras(), layer)
    move = await prepare_discard(store, everything=True)
    assert move is not None
    move.commit()
    (await prepare_undiscard(store, list(store.units))).commit()
    store.rescan()
    assert (store.stale_count, store.stale_names()) == (3, ["lin.bias", "lin.weight", "scale"])


async def test_a_rescan_takes_in_a_replaced_tensor_unless_the_store_is_offloaded(
        layer: DeviceLayer) -> None:
    """A parameter replaced behind the store is noticed; on the device a rescan takes it in,
    offloaded the store refuses (the old tensor's bytes live in its mirror)."""
    module = Extras()
    store = device_store("x", module, layer)
    module.lin.weight = nn.Parameter(torch.zeros(4, 4))
    on_the_device(module, layer)  # (the new one in device memory too)
    assert store.structure_changed() == ["weight"]
    store.rescan()
    assert store.structure_changed() == []
    assert store.tensor_named("lin.weight") is module.lin.weight
    await offloaded(store)
    module.lin.bias = nn.Parameter(torch.zeros(4))
    with pytest.raises(StoreError, match=r"component 'x' was changed behind the controller "
                                         r"while offloaded: lin.bias: replaced;"):
        store.rescan()


async def test_a_parameter_replaced_by_a_host_tensor_while_placed_is_refused_by_name(
        layer: DeviceLayer) -> None:
    """Placed (every unit on the device), a parameter replaced by a tensor in host memory (a
    host buffer of the layer's own: off the device tier of every layer) is refused by a
    rescan, by name, and the store keeps the inventory it had."""
    module = Extras()
    store = device_store("x", module, layer)
    await store.adopt()  # (a module built in host memory: its units get mirrors first)
    (await store.prepare_to_device(store.select("host"))).commit()
    assert {u.where for u in store.units} == {"device"}
    host = layer.alloc(64, "host", pinned=False).view(torch.float32).view(4, 4)
    assert not layer.on_device(host)
    module.lin.weight = nn.Parameter(host)
    with pytest.raises(StoreError, match=r"component 'x' is placed on cpu, but 'lin.weight' "
                                         r"now hold host memory \(replaced behind the controller\)"):
        store.rescan()
    assert store.structure_changed() == ["weight"]


# -- moves --------------------------------------------------------------------------------

async def test_a_round_trip_keeps_every_value_and_every_tensor_object(layer: DeviceLayer) -> None:
    """To the host and back: the same tensor objects, the same values, and the report says
    where the bytes are at each step."""
    lm = TiedLM()
    before, params = values(lm), list(lm.parameters())
    store = device_store("lm", lm, layer)
    assert store.report() == StoreReport(5824, 0, 0)
    await offloaded(store)
    host = sum(u.nbytes for u in store.units)
    assert (store.report().device_bytes, store.report().host_bytes) == (0, host)
    assert same(lm, before)
    await placed(store)
    assert (store.report().device_bytes, store.report().host_bytes) == (5824, host)
    assert same(lm, before) and list(lm.parameters()) == params
    assert lm.head.weight is lm.embed.weight


async def test_only_changed_units_are_copied_back(layer: DeviceLayer) -> None:
    """A unit whose tensors did not change since its mirror was made copies nothing on the way
    to the host; an in-place change copies that unit only; a write that bypasses the version
    counter is copied once it is declared (``mark_dirty``)."""
    module = Extras()
    store = device_store("x", module, layer)
    await offloaded(store)
    await placed(store)
    move = await store.prepare_to_host(store.units)
    move.commit()
    assert move.bytes_copied == 0
    await placed(store)
    with torch.no_grad():
        module.lin.weight.add_(1)
    move = await store.prepare_to_host(store.units)
    move.commit()
    assert move.bytes_copied == store.slot_named("lin.weight")[1].nbytes == 64
    await placed(store)
    module.scale.data.copy_(torch.zeros(4))  # (not seen: .data bypasses the version counter)
    store.mark_dirty()
    move = await store.prepare_to_host(store.units)
    move.commit()
    assert move.bytes_copied == store.nbytes


@pytest.mark.parametrize("direction", ["to host", "to device"])
async def test_a_move_failing_at_any_copy_or_allocation_leaves_nothing_behind(
        faulty: Callable[..., FaultInjection], direction: str) -> None:
    """Whichever copy or allocation of a move fails, the store is as before: every tensor where
    it was with its value, no byte pending, no new mirror, and (its frames forgotten) no
    device buffer alive."""
    for kind in ("copy", "alloc"):
        k = 0
        while True:
            k += 1
            layer = faulty()
            lm = TiedLM()
            before = values(lm)
            store = device_store("lm", lm, layer)
            if direction == "to device":
                await offloaded(store)
            report, ptrs = store.report(), pointers(lm)
            layer.arm(**{f"{kind}_at": k})
            prepare = store.prepare_to_host if direction == "to host" else store.prepare_to_device
            try:
                move = await prepare(store.units)
            except InjectedFault as exc:
                forget_locals(exc)
            else:
                move.commit()
                break
            assert (store.report(), pointers(lm), store.pending_bytes) == (report, ptrs, 0)
            assert same(lm, before) and layer.live_device_bytes == 0
            assert all(u.host is None for u in store.units) == (direction == "to host")
        assert k > 1  # (it failed at least once)


@pytest.mark.parametrize("direction", ["to host", "to device"])
async def test_a_move_cancelled_between_chunks_is_rolled_back(
        faulty: Callable[..., FaultInjection], monkeypatch: pytest.MonkeyPatch,
        direction: str) -> None:
    """A move cancelled while it copies (between two chunks) leaves the store as it was."""
    monkeypatch.setattr(store_module, "CHUNK", 1024)  # (a chunk per unit or so)
    layer = faulty()
    lm = TiedLM()
    before = values(lm)
    store = device_store("lm", lm, layer)
    if direction == "to device":
        await offloaded(store)
    report, ptrs = store.report(), pointers(lm)
    layer.copy_delay = 0.1
    prepare = store.prepare_to_host if direction == "to host" else store.prepare_to_device
    with anyio.move_on_after(0.05) as scope:
        await prepare(store.units)
    assert scope.cancelled_caught
    assert (store.report(), pointers(lm), store.pending_bytes) == (report, ptrs, 0)
    assert same(lm, before)


# -- the report ---------------------------------------------------------------------------

async def test_recomputed_weights_count_in_device_bytes_and_in_the_total(
        layer: DeviceLayer) -> None:
    """Placed, a component holds its recomputed weights on the device: they count in its
    device bytes and its total alike (device bytes equal the total), never on the host."""
    store = device_store("n", normed(), layer)
    stored = sum(u.nbytes for u in store.units)
    assert (stored, store.nbytes) == (3520, 3520 + 2048 + 1024)
    assert store.report().device_bytes == store.nbytes
    await offloaded(store)
    assert (store.report().device_bytes, store.report().host_bytes) == (0, stored)
    await placed(store)
    assert store.report().device_bytes == store.nbytes
