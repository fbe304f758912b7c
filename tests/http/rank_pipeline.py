"""A pipeline factory for multi-rank serving tests: the demo pipeline, whose weights are
changed on the rank named by ``RESIDENCY_TEST_CORRUPT_RANK`` (a rank that went wrong), and
whose VAE's first parameter has another shape on the rank named by
``RESIDENCY_TEST_MISSHAPEN_RANK`` (an update of the VAE fails there, and only there)."""

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
    if os.environ.get("RANK") == os.environ.get("RESIDENCY_TEST_MISSHAPEN_RANK", "none"):
        first = next(pipe.modules["vae"].parameters())
        first.data = torch.zeros(first.numel() + 1, dtype=first.dtype)
    return pipe, demo_generate(pipe)
