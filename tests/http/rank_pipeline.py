"""A pipeline factory for multi-rank serving tests: the demo pipeline, whose weights are
changed on the rank named by ``RESIDENCY_TEST_CORRUPT_RANK`` (a rank that went wrong)."""

from __future__ import annotations

import os

import torch

from lifecycle.demo import DemoPipeline
from lifecycle.http import Generate, demo_generate


def factory() -> tuple[DemoPipeline, Generate]:
    """The demo pipeline (1 MB); corrupted on the rank the environment names."""
    pipe = DemoPipeline.build(2**20)
    if os.environ.get("RANK") == os.environ.get("RESIDENCY_TEST_CORRUPT_RANK", "none"):
        with torch.no_grad():
            next(pipe.modules["vae"].parameters()).add_(0.5)
    return pipe, demo_generate(pipe)
