"""What the HTTP handlers call: a driver between the routes and the controller(s).

:class:`LocalDriver` calls this process's controller. A multi-rank server (``residency serve
--nproc``) uses :class:`lifecycle.http._ranks.RankDriver`, which runs each call on every rank
and combines the answers. The handlers do not know which one they have.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import torch

from .. import LifecycleController, OccupationResult, Phase, UpdateResult

__all__ = ["Driver", "Generate", "LocalDriver", "RanksUnavailable"]

# A pipeline's generation: (controller, request body) -> JSON-able answer.
Generate = Callable[[LifecycleController, Mapping[str, Any]], Awaitable[Mapping[str, Any]]]


class RanksUnavailable(RuntimeError):
    """Some rank of a multi-rank server is dead or unreachable (answered with 503)."""


class Driver:
    """The calls the routes make (see :class:`LocalDriver` for their meaning)."""

    ctl: LifecycleController

    async def sleep(self) -> OccupationResult:
        raise NotImplementedError

    async def wake(self) -> OccupationResult:
        raise NotImplementedError

    async def update_from_disk(self, path: str, targets: Sequence[str] | None) -> UpdateResult:
        raise NotImplementedError

    async def update_from_tensors(self, named: list[tuple[str, torch.Tensor]],
                                  target: str) -> UpdateResult:
        raise NotImplementedError

    async def checksum(self, names: Sequence[str]) -> dict[str, str]:
        raise NotImplementedError

    @property
    def can_generate(self) -> bool:
        raise NotImplementedError

    async def generate(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        raise NotImplementedError

    async def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def unavailable(self) -> str | None:
        """Why the server cannot serve at all (503 on /health), or None."""
        raise NotImplementedError


def local_state(ctl: LifecycleController) -> dict[str, Any]:
    """One controller's phase, version and placement, as /state shows it."""
    report = ctl.report()
    return {
        "pid": os.getpid(),
        "phase": ctl.phase.value, "transition": ctl.transition, "in_flight": ctl.in_flight,
        "weights_version": ctl.weights_version, "device": str(ctl.device),
        "rank": report.rank, "world_size": report.world_size,
        "device_bytes": report.device_bytes, "host_bytes": report.host_bytes,
        "components": {n: {"mode": c.mode, "device_bytes": c.device_bytes,
                           "host_bytes": c.host_bytes, "pinned_bytes": c.pinned_bytes,
                           "total_bytes": c.total_bytes}
                       for n, c in report.components.items()}}


class LocalDriver(Driver):
    """This process's controller, called directly."""

    def __init__(self, ctl: LifecycleController, generate: Generate | None) -> None:
        self.ctl = ctl
        self._generate = generate

    async def sleep(self) -> OccupationResult:
        return await self.ctl.sleep()

    async def wake(self) -> OccupationResult:
        return await self.ctl.wake()

    async def update_from_disk(self, path: str, targets: Sequence[str] | None) -> UpdateResult:
        return await self.ctl.update_weights_from_disk(path, targets)

    async def update_from_tensors(self, named: list[tuple[str, torch.Tensor]],
                                  target: str) -> UpdateResult:
        return await self.ctl.update_weights_from_tensors(named, target)

    async def checksum(self, names: Sequence[str]) -> dict[str, str]:
        known = [n for n in names if n in self.ctl.components]
        return await self.ctl.weights_checksum_async(known)

    @property
    def can_generate(self) -> bool:
        return self._generate is not None

    async def generate(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        assert self._generate is not None
        return await self._generate(self.ctl, body)

    async def state(self) -> dict[str, Any]:
        return local_state(self.ctl)

    def unavailable(self) -> str | None:
        return "no pipeline attached" if self.ctl.phase is Phase.UNINITIALIZED else None
