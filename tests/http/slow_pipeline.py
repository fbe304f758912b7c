"""A pipeline factory for ``residency serve --pipeline tests.http.slow_pipeline:factory``:
the demo pipeline, whose generation holds the transformer for ``delay`` seconds (a request
that is still in flight when a release or a shutdown comes)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import anyio

from lifecycle import LifecycleController
from lifecycle.demo import DemoPipeline
from lifecycle.http import Generate, demo_generate


def factory() -> tuple[DemoPipeline, Generate]:
    """The demo pipeline (1 MB) and a generation that can be made slow."""
    pipe = DemoPipeline.build(2**20)
    fast = demo_generate(pipe)

    async def generate(ctl: LifecycleController, body: Mapping[str, Any]) -> Mapping[str, Any]:
        delay = float(body.get("delay", 0.0))
        # One request for the whole generation: a release drains all of it.
        async with ctl.request(list(pipe.modules)):
            async with ctl.use("transformer"):
                await anyio.sleep(delay)
            return await fast(ctl, {k: v for k, v in body.items() if k != "delay"})

    return pipe, generate
