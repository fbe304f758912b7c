"""FSDP and tensor parallelism recognised for real (real fully_shard, FSDP1 and
parallelize_module on a CPU gloo mesh), and checksums compared across ranks."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lifecycle import FSDPInferenceUnsupported, LifecycleController
from strategies import ComponentResidencyError, StoreError
from tests.helpers import small_pipeline
from tests.ranks.test_collective import TIMEOUT, run_ranks


def test_checksums_across_ranks_name_the_rank_whose_copy_differs(tmp_path: Path) -> None:
    """Three ranks with the same weights agree; after rank 2's transformer is changed
    behind the controller, every rank is told that rank 2 differs, on that component only."""

    async def scenario(rank: int, world: int, tmp: Path) -> dict[str, Any]:
        ctl = LifecycleController("cpu", process_group=dist.group.WORLD,
                                  collective_timeout=TIMEOUT)
        pipe = small_pipeline()
        await ctl.attach(pipe)
        same = await ctl.weights_checksum_across_ranks()
        if rank == 2:
            with torch.no_grad():
                next(pipe["transformer"].parameters()).add_(1)
        differ = await ctl.weights_checksum_across_ranks()
        return {"same": same.agree, "differ": differ.disagreeing(),
                "ranks": sorted(differ.per_rank["vae"])}

    out = run_ranks(scenario, tmp_path, world=3)
    for r in range(3):
        assert out[r] == {"same": True, "differ": {"transformer": [2]}, "ranks": [0, 1, 2]}


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


async def _refusals(build: Any) -> dict[str, str]:
    """Attach a module built by ``build`` offloaded (refused) and resident, then sleep."""
    out: dict[str, str] = {}
    ctl = LifecycleController("cpu", residency="transformer=component-offload")
    try:
        await ctl.attach({"transformer": build()})
        out["offload"] = "attached"
    except (ComponentResidencyError, StoreError) as exc:
        out["offload"] = str(exc)
    ctl = LifecycleController("cpu")
    try:
        await ctl.attach({"transformer": build()})
    except StoreError as exc:
        out["resident"] = str(exc)
        return out
    out["resident"] = "attached"
    try:
        await ctl.sleep()
        out["sleep"] = "slept"
    except FSDPInferenceUnsupported as exc:
        out["sleep"] = str(exc)
    return out


def test_real_fsdp2_fsdp1_and_tensor_parallel_modules_are_recognised(tmp_path: Path) -> None:
    """fully_shard (FSDP2) and FullyShardedDataParallel (FSDP1) modules: offload modes are
    refused at attach, resident attach works and sleep is refused with the reference's FSDP
    message. A tensor-parallel module (DTensor parameters outside FSDP) is refused at attach
    naming the parameter: its .data cannot be re-pointed."""

    async def scenario(rank: int, world: int, tmp: Path) -> dict[str, Any]:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))

        def fsdp2() -> nn.Module:
            m = _mlp()
            fully_shard(m, mesh=mesh)
            return m

        def fsdp1() -> nn.Module:
            with warnings.catch_warnings():  # torch marks FSDP1 deprecated
                warnings.simplefilter("ignore")
                return FullyShardedDataParallel(_mlp(), device_id=torch.device("cpu"))

        def tensor_parallel() -> nn.Module:
            return parallelize_module(_mlp(), mesh, {"0": ColwiseParallel()})

        return {"fsdp2": await _refusals(fsdp2), "fsdp1": await _refusals(fsdp1),
                "tp": await _refusals(tensor_parallel)}

    out = run_ranks(scenario, tmp_path, world=2)
    for r in (0, 1):
        for kind in ("fsdp2", "fsdp1"):
            got = out[r][kind]
            assert got["offload"] == ("Component 'transformer' resolved to component-offload, "
                                      "but it was loaded as an FSDP-managed module"), got
            assert got["resident"] == "attached"
            assert got["sleep"] == "sleep/wake does not support FSDP inference"
        tp = out[r]["tp"]
        for how in ("offload", "resident"):
            assert tp[how].startswith("tensor '0.weight' of component 'transformer' is a "
                                      "DTensor"), tp


pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without distributed")
