"""Weight versions: the trainer's ``weight_version`` label is kept with a successful update,
kept through a failed one, and shown in results, the report and the metrics."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from lifecycle import LifecycleController, SyncLifecycleController
from lifecycle.metrics import ControllerMetrics
from tests.helpers import faulty_device, small_pipeline

pytestmark = pytest.mark.anyio


def version_info(metrics: ControllerMetrics) -> dict[str, float]:
    """``residency_weight_version_info`` samples by their ``version`` label."""
    return {s.labels["version"]: s.value
            for f in text_string_to_metric_families(metrics.render().decode())
            if f.name == "residency_weight_version_info" for s in f.samples}


async def test_the_label_follows_successful_updates_only(tmp_path: Path) -> None:
    """A successful update (tensors, disk) stores its label, one without a label keeps the
    last, a refused or rolled-back update keeps it too; results, report and metrics agree."""
    layer = faulty_device()
    async with LifecycleController(device_layer=layer) as ctl:
        metrics = ControllerMetrics(ctl)
        pipe = small_pipeline()
        await ctl.attach(pipe)
        assert (ctl.weight_version_label, ctl.report().weight_version) == (None, None)
        assert version_info(metrics) == {}
        state = {k: v + 1 for k, v in pipe["transformer"].state_dict().items()}
        first = await ctl.update_weights_from_tensors(state, weight_version="v1")
        assert (first.success, first.version, first.weight_version) == (True, 1, "v1")
        save_file({f"transformer.{k}": v + 2 for k, v in state.items()},
                  str(tmp_path / "w.safetensors"))
        second = await ctl.update_weights_from_disk(tmp_path / "w.safetensors",
                                                    weight_version="v2", flush_cache=True)
        assert (second.success, second.weight_version, ctl.weight_version_label) == (True, "v2", "v2")
        unlabelled = await ctl.update_weights_from_tensors(state)
        assert (unlabelled.success, unlabelled.weight_version) == (True, "v2")
        refused = await ctl.update_weights_from_tensors({"nope": torch.zeros(1)},
                                                        weight_version="v3")
        layer.arm(copy_at=1)
        rolled_back = await ctl.update_weights_from_tensors(state, weight_version="v4")
        assert (refused.success, rolled_back.rolled_back) == (False, True)
        assert refused.weight_version == rolled_back.weight_version == "v2"
        assert (ctl.weights_version, ctl.weight_version_label) == (3, "v2")
        assert ctl.report().weight_version == "v2"
        assert rolled_back.as_dict()["weight_version"] == "v2"
        assert version_info(metrics) == {"v2": 1.0}
        metrics.close()


def test_the_blocking_facade_shows_the_label() -> None:
    """SyncLifecycleController passes weight_version through and shows the label."""
    pipe = small_pipeline()
    with SyncLifecycleController("cpu") as ctl:
        ctl.attach(pipe)
        state = {k: v.clone() for k, v in pipe["vae"].state_dict().items()}
        assert ctl.update_weights_from_tensors(state, "vae", weight_version="7").success
        assert ctl.weight_version_label == "7"
        assert ctl.report().weight_version == "7"
