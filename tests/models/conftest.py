"""Shared set-up of the real-model tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Runs these tiny forwards on one intra-op thread: a second one gains nothing at these sizes, and
    when another process keeps a core busy, torch's two threads wait on each other (forwards of ~10 ms
    then took 0.2-1 s on a 2-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
