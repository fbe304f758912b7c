"""The per-app service state: what every route reaches through its request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from .. import LifecycleController
from ..metrics import ControllerMetrics
from ..payload import FD_TIMEOUT
from ._bodies import refused
from ._driver import Driver
from ._generations import Generations

__all__ = ["Service", "group_service", "service_of"]


@dataclass
class Service:
    driver: Driver
    metrics: ControllerMetrics
    body_limit: int
    upload_limit: int
    fd_timeout: float = FD_TIMEOUT
    file_check_timeout: float = 10.0
    process_groups: bool = False  # the weight update group routes are served
    # The generations in flight and the pause state (lifecycle.http._generations).
    generations: Generations = field(default_factory=lambda: Generations(None, None))
    # vLLM's weight-transfer transaction (lifecycle.http._transfer.WeightTransfer).
    transfer: Any = None

    @property
    def ctl(self) -> LifecycleController:
        return self.driver.ctl


def service_of(request: Request) -> Service:
    service: Service = request.app.state.service
    return service


def group_service(request: Request) -> Service:
    """The service, when it serves the weight update group routes; else a 403. They make the
    server connect to an address the client names and run a receiving process: served only
    with an API key, or when the server opted in (``process_groups``)."""
    service = service_of(request)
    if not service.process_groups:
        raise refused("the weight update group routes are disabled on this server: they make "
                      "it connect to a trainer the client names; serve with --api-key KEY, "
                      "or with --allow-process-groups on a trusted network", 403)
    return service

