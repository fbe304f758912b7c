"""Reading checkpoint regions straight into tensors: the pieces cover every byte exactly
once, are dealt evenly, land bit-exact, and a region that does not fit its tensor is
refused before anything is read."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
import torch
from safetensors.torch import save_file

from strategies._fileread import FileRegion, _lanes, read_regions, safetensors_regions

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


def test_lanes_cover_every_byte_once_and_stay_balanced(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Every byte of every region is in exactly one piece; lanes differ by at most a
    piece."""
    import strategies._fileread as fileread

    monkeypatch.setattr(fileread, "PIECE", 100)
    dsts = [torch.empty(n, dtype=torch.uint8) for n in (1, 250, 99, 1000, 100)]
    reads = [(d, FileRegion("f", 7 * i, d.numel(), torch.uint8)) for i, d in enumerate(dsts)]
    lanes = _lanes(reads, 3)
    covered = sorted((address, address + size) for lane in lanes for _, _, address, size in lane)
    expected = sorted((d.data_ptr() + s, d.data_ptr() + min(s + 100, d.numel()))
                      for d in dsts for s in range(0, d.numel(), 100))
    assert covered == expected
    loads = [sum(size for *_, size in lane) for lane in lanes]
    assert max(loads) - min(loads) <= 100


async def test_regions_of_a_safetensors_file_read_back_bit_exact(tmp_path: Path) -> None:
    """Every tensor of a file, read through its header's offsets into fresh tensors by
    several threads, equals what was saved (bfloat16 and int64 too)."""
    state = {"a": torch.randn(37, 5), "b": torch.arange(1000, dtype=torch.int64),
             "c": torch.randn(3, 3).to(torch.bfloat16), "d": torch.randn(40_000)}
    path = tmp_path / "w.safetensors"
    save_file(state, str(path))
    regions = safetensors_regions(path)
    dsts = {k: torch.empty_like(v) for k, v in state.items()}
    await read_regions([(dsts[k], FileRegion(str(path), *regions[k], v.dtype))
                        for k, v in state.items()], anyio.CapacityLimiter(3))
    assert all(torch.equal(dsts[k], v) for k, v in state.items())


async def test_a_region_that_does_not_fit_its_tensor_is_refused_before_any_read(
        tmp_path: Path) -> None:
    """A dtype or length mismatch raises ValueError naming the file; the tensor is
    untouched."""
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.ones(8)}, str(path))
    offset, nbytes = safetensors_regions(path)["a"]
    dst = torch.zeros(8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"w\.safetensors"):
        await read_regions([(dst, FileRegion(str(path), offset, nbytes, torch.float32))])
    assert torch.equal(dst, torch.zeros(8, dtype=torch.float64))
