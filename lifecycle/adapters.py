"""Adapters for real pipelines: run a diffusers pipeline's own ``__call__`` under a controller.

A diffusers pipeline (anything with a ``components`` mapping and a ``__call__``) attaches to
a :class:`~lifecycle.LifecycleController` as it is: its ``nn.Module`` components become the
controller's components (schedulers, tokenizers and other entries are ignored). Calling the
pipeline directly still works while it is awake and every component is resident, and fails
loudly otherwise (:class:`~lifecycle.ComponentAsleep` while sleeping,
:class:`~lifecycle.ComponentNotPlaced` for an offloaded component outside ``use()``).

:class:`PipelineRunner` is the generate-equivalent that always works: it runs the pipeline's
own ``__call__`` in a worker thread while holding ``ctl.use(name)`` for every attached
component, so a sleep or weight update waits for the call to finish and offloaded
components are in place for it::

    pipe = DDPMPipeline.from_pretrained(...)
    ctl = LifecycleController("cuda", residency="unet=component-offload")
    runner = await PipelineRunner.attach(pipe, ctl)
    images = (await runner(num_inference_steps=20, generator=g)).images
    await ctl.sleep()   # waits for running calls; frees the device
    await ctl.wake()

Every component is placed for the whole call (diffusers' ``__call__`` does not say which
component it needs when), so a component-offloaded pipeline holds all its components on the
device during a call and none between calls; layerwise offload still streams its layers.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from strategies.protocol import to_thread

from ._controller import LifecycleController
from ._errors import UnknownComponent

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """Runs ``pipeline(...)`` in a worker thread with every attached component in use.

    ``order``: the components to hold during a call, in the order their ``use()`` is
    entered (default: every attached component, in attach order). A call enters them one
    after the other inside one ``ctl.request(order)`` (so the next one's move-in starts
    while the current one is placed), then runs the pipeline, then releases them all."""

    def __init__(self, pipeline: Any, ctl: LifecycleController, *,
                 order: Sequence[str] | None = None) -> None:
        if not callable(pipeline):
            raise TypeError(f"{type(pipeline).__name__} is not callable; expected a pipeline "
                            "with a __call__ (e.g. a diffusers DiffusionPipeline)")
        self.pipeline = pipeline
        self.ctl = ctl
        self._order = None if order is None else tuple(order)
        # The pipeline's calls run in threads of their own, not in anyio's shared pool.
        self._threads = anyio.CapacityLimiter(4)

    @classmethod
    async def attach(cls, pipeline: Any, ctl: LifecycleController, *,
                     order: Sequence[str] | None = None) -> PipelineRunner:
        """Attach ``pipeline`` to ``ctl`` and return a runner for it."""
        runner = cls(pipeline, ctl, order=order)
        await ctl.attach(pipeline)
        runner._check()
        return runner

    @property
    def order(self) -> tuple[str, ...]:
        """The components a call holds, in the order it enters them."""
        return self._order if self._order is not None else tuple(self.ctl.components)

    def _check(self) -> None:
        """The controller must have this very pipeline's components attached."""
        attached = self.ctl.components
        if not attached:
            raise RuntimeError("no pipeline is attached to the controller; "
                               "use `await PipelineRunner.attach(pipeline, ctl)`")
        own = getattr(self.pipeline, "components", None)
        if isinstance(own, Mapping):
            foreign = [n for n, m in attached.items() if own.get(n) is not m]
            if foreign:
                raise RuntimeError(f"the controller's components {foreign} are not this "
                                   "pipeline's; attach this pipeline to it")
        unknown = [n for n in self.order if n not in attached]
        if unknown:
            raise UnknownComponent(unknown[0], list(attached))

    async def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``pipeline(*args, **kwargs)`` with every component in use; returns its output.

        Raises :class:`~lifecycle.ComponentAsleep` while the pipeline sleeps (or wakes it
        first with the controller's ``auto_wake``). Cancelling the caller does not abandon
        the worker thread: the components are released once the call has really ended."""
        self._check()
        order = self.order
        call = functools.partial(self.pipeline, *args, **kwargs)
        async with self.ctl.request(order), contextlib.AsyncExitStack() as uses:
            for name in order:
                await uses.enter_async_context(self.ctl.use(name))
            return await to_thread(call, limiter=self._threads)

