"""Faults while placing a use of an offloaded component: rolled back, the next use works."""

from __future__ import annotations

import pytest

from lifecycle import TransitionFailed
from tests.modes.strategy_suite import (
    _one_intra_op_thread,  # noqa: F401 (an autouse fixture)
    offload_all,
)

pytestmark = [pytest.mark.anyio, pytest.mark.moves]


# An offloaded component moves as one buffer: one allocation and one copy to fail.
@pytest.mark.parametrize(("kind", "k"), [("copy", 1), ("alloc", 1)])
async def test_fault_while_placing_a_use_is_rolled_back_and_the_next_use_works(
        kind: str, k: int) -> None:
    """A failed move-in raises TransitionFailed, leaves the report as it was and no lease."""
    ctl, layer = await offload_all()
    before = ctl.report().components["text_encoder"]
    layer.arm(**{f"{kind}_at": k})
    with pytest.raises(TransitionFailed) as info:
        async with ctl.use("text_encoder"):
            pytest.fail("the use body ran although placement failed")
    assert info.value.trigger == "use"
    assert ctl.report().components["text_encoder"] == before
    assert before.device_bytes == 0
    assert ctl.in_flight == 0
    async with ctl.use("text_encoder"):
        assert ctl.report().components["text_encoder"].device_bytes == before.total_bytes
    assert ctl.report().components["text_encoder"] == before
