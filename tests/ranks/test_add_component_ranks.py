"""add_component / remove_component over several ranks (gloo, fork-started processes): a
fault or a refusal on one rank leaves every rank as it was; then all commit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from lifecycle import TransitionFailed, TransitionRejected
from tests.helpers import faulty_device, small_pipeline
from tests.ranks.test_collective import collective, run_ranks

pytestmark = pytest.mark.moves


def extra() -> nn.Module:
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(16, 16), nn.GELU())


async def _fault_then_retry(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    layer = faulty_device()
    ctl = collective(rank, layer)
    await ctl.attach(small_pipeline())
    out: dict[str, Any] = {}
    if rank == 1:
        layer.arm(alloc_at=1)  # the added component's first allocation, on rank 1 only
    try:
        await ctl.add_component("refiner", extra(), residency="component-offload")
    except TransitionFailed as exc:
        out["first"] = (type(exc).__name__, sorted(exc.failed_ranks))
    out["after_fault"] = sorted(ctl.components)
    await ctl.add_component("refiner", extra(), residency="component-offload")
    out["added"] = sorted(ctl.components)
    await ctl.remove_component("refiner")
    out["removed"] = sorted(ctl.components)
    await ctl.aclose()
    return out


async def _refused_on_one_rank(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    ctl = collective(rank)
    pipe = small_pipeline()
    await ctl.attach(pipe)
    # Rank 1 offers a module it already serves: refused there, so no rank adds it.
    module = pipe["vae"] if rank == 1 else extra()
    out: dict[str, Any] = {}
    try:
        await ctl.add_component("refiner", module)
    except (TransitionFailed, TransitionRejected) as exc:
        out["error"] = type(exc).__name__
    out["components"] = sorted(ctl.components)
    await ctl.aclose()
    return out


NAMES = ["text_encoder", "transformer", "vae"]


def test_a_fault_on_one_rank_fails_the_add_on_every_rank_and_the_retry_commits(
        tmp_path: Path) -> None:
    """Rank 1's injected allocation fault fails add_component on both ranks (naming rank 1)
    with nothing added; the retry adds on both, and the removal removes on both."""
    out = run_ranks(_fault_then_retry, tmp_path)
    for rank in (0, 1):
        assert out[rank]["first"] == ("TransitionFailed", [1])
        assert out[rank]["after_fault"] == NAMES
        assert out[rank]["added"] == sorted([*NAMES, "refiner"])
        assert out[rank]["removed"] == NAMES


def test_a_refusal_on_one_rank_leaves_every_rank_without_the_component(tmp_path: Path) -> None:
    """Rank 1 refuses (its module is a component already); rank 0, which could add, adds
    nothing either."""
    out = run_ranks(_refused_on_one_rank, tmp_path)
    assert out[1] == {"error": "TransitionRejected", "components": NAMES}
    assert out[0] == {"error": "TransitionFailed", "components": NAMES}
