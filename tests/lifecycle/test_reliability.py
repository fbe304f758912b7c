"""Many concurrent callers, bad pipelines at attach (cancellation at every await point:
test_cancellation.py)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch
from torch import nn

from lifecycle import (
    ComponentAsleep,
    LifecycleController,
    Phase,
    TransitionRejected,
    WeightUpdateWhileSleeping,
)
from strategies import ComponentResidencyError, StoreError
from tests.helpers import faulty_device, fingerprints, layer, small_pipeline, tensor_ids

pytestmark = pytest.mark.anyio

RESIDENCY = "text_encoder=layerwise-offload,vae=component-offload"


def shifted(pipe: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    return {k: v + 1 for k, v in pipe["transformer"].state_dict().items()}


async def test_fifty_tasks_thousand_calls_no_deadlock_and_every_call_answered() -> None:
    """50 tasks x 20 random calls (sleep, wake, updates, uses) all get an answer within a
    deadline; the final state is consistent and the weights are one of the written versions."""
    pipe = small_pipeline()
    versions = {"orig": fingerprints(pipe)}
    states = {"A": shifted(pipe), "B": {k: v - 1 for k, v in pipe["transformer"].state_dict().items()}}
    for name, state in states.items():
        ref = small_pipeline()
        ref["transformer"].load_state_dict(state)
        versions[name] = fingerprints(ref)
    ctl = LifecycleController(device_layer=faulty_device(), residency=RESIDENCY, drain_timeout=10)
    await ctl.attach(pipe)
    answered: list[str] = []
    rng = random.Random(11)

    async def worker(seed: int) -> None:
        r = random.Random(seed)
        for _ in range(20):
            kind = r.choice(["sleep", "wake", "use", "use", "update"])
            try:
                if kind == "use":
                    async with ctl.use(r.choice(["text_encoder", "transformer", "vae"])):
                        await anyio.sleep(0)
                elif kind == "update":
                    await ctl.update_weights_from_tensors(states[r.choice("AB")])
                else:
                    await getattr(ctl, kind)()
            except (ComponentAsleep, WeightUpdateWhileSleeping):
                pass
            answered.append(kind)

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(worker, rng.randrange(1 << 30))
    assert len(answered) == 1000
    assert ctl.in_flight == 0 and ctl.transition is None
    assert fingerprints(pipe) in versions.values()
    await ctl.sleep()
    assert ctl.report().device_bytes == 0
    await ctl.wake()


class _SharedBlock(nn.Module):
    pass


def bad_pipelines() -> list[tuple[str, Callable[[], Any], type[Exception], str]]:
    def meta() -> dict[str, nn.Module]:
        pipe = small_pipeline()
        with torch.device("meta"):
            pipe["extra"] = nn.Linear(2, 2)
        return pipe

    def shared() -> dict[str, nn.Module]:
        pipe = small_pipeline()
        pipe["transformer_2"] = nn.Sequential(layer(pipe["transformer"], 0, nn.Linear))
        return pipe

    def sparse() -> dict[str, nn.Module]:
        pipe = small_pipeline()
        pipe["vae"].register_buffer("mask", torch.eye(3).to_sparse())
        return pipe

    def fsdp_offload() -> dict[str, nn.Module]:
        from torch.distributed.fsdp import FSDPModule

        pipe = small_pipeline()
        lin = layer(pipe["transformer"], 0, nn.Linear)
        lin.__class__ = type("FSDPLinear", (FSDPModule, type(lin)), {})
        return pipe

    return [
        ("meta tensors", meta, StoreError,
         "tensor 'weight' of component 'extra' is on the meta device (no data)"),
        ("a module shared by two components", shared, ValueError,
         "components 'transformer' and 'transformer_2' share the module Linear"),
        ("a sparse tensor", sparse, StoreError, "has layout torch.sparse_coo"),
        ("an FSDP-managed component with a non-resident mode", fsdp_offload,
         ComponentResidencyError,
         "Component 'transformer' resolved to component-offload, but it was loaded as an "
         "FSDP-managed module"),
        ("a non-module pipeline", lambda: [nn.Linear(2, 2)], TypeError,
         "expected a Mapping[str, nn.Module]"),
    ]


@pytest.mark.parametrize("case", bad_pipelines(), ids=lambda c: c[0])
async def test_bad_pipeline_is_a_typed_error_and_nothing_moves(case: Any) -> None:
    """Each bad pipeline is refused at attach with its error; tensors, hooks and the phase
    are exactly as before."""
    _, make, exc_type, message = case
    pipe = make()
    residency = "transformer=component-offload" if exc_type is ComponentResidencyError else None
    real = pipe if isinstance(pipe, dict) else {}
    real_modules = {k: v for k, v in real.items() if not any(t.is_meta for t in v.parameters())}
    before, ids = fingerprints(real_modules), tensor_ids(real_modules)
    hooks = {k: len(m._forward_pre_hooks) for k, v in real.items() for m in [v]}
    ctl = LifecycleController("cpu", residency=residency)
    with pytest.raises(exc_type) as info:
        await ctl.attach(pipe)
    assert message in str(info.value)
    assert ctl.phase is Phase.UNINITIALIZED
    assert fingerprints(real_modules) == before and tensor_ids(real_modules) == ids
    assert {k: len(m._forward_pre_hooks) for k, v in real.items() for m in [v]} == hooks
    with pytest.raises(TransitionRejected):
        async with ctl.use("transformer"):
            pass
