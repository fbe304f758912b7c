"""vLLM's weight-transfer contract: ``/init_weight_transfer_engine {init_info}``,
``/start_weight_update``, ``/update_weights {update_info}`` (one or more),
``/finish_weight_update {weight_version}``, ordered as vLLM's RL state machine orders them
(a misordered call is a 409 with vLLM's message, and changes nothing).

One update is one transaction from start to finish. Two backends:

* ``ipc`` (``init_info`` without ``master_address``): each ``/update_weights`` carries
  ``update_info.ipc_handles_pickled``, base64 of torch's multiprocessing pickle of ``[(name,
  tensor), ...]`` (names ``module.tensor``, or relative to the transformer) or of ``{module:
  [...]}``, read by the tensor-upload path; optional ``names`` / ``dtype_names`` / ``shapes``
  are checked against it. The tensors are only staged: finish writes every module as one
  update (all or nothing); before it nothing of them is visible.
* ``nccl`` (``init_info {master_address, master_port, rank_offset, world_size}``: the process
  group path of lifecycle._weight_sync, gloo on a CPU server): the trainer broadcasts while it
  posts ``update_info {names, dtype_names, shapes}``; it is received by the group's process
  (its canary checks, one deadline: the transaction's time left) into host tensors that are
  only staged, as the ipc backend's (a refused ``/update_weights`` still drains the
  broadcast). What one transaction stages counts against the group's ``max_staging_bytes``
  (a 400 naming it past that).

Either way finish writes everything staged as one update (``update_weights_from_modules``:
every module, or none); before it nothing is written, so checksums and generations see the
old weights; an abandoned or failed transaction drops what it staged (nothing to restore).
Generations wait from start to finish (the pause mode ``keep``).

On a server of several ranks (``serve --nproc``) every rank stages the same tensors (rank 0
relays an ipc payload to the others through the ranks' store; each rank joins the trainer's
group as ``rank_offset`` plus its rank and receives the broadcast itself): a call that fails on
one rank fails on all, naming it, and nothing of it is staged anywhere; finish is one
collective update, written on every rank or on none (lifecycle.http._ranks).

A transaction not finished within ``init_info.update_timeout`` seconds of its start (ours;
default 300: the trainer gone), or whose update failed, is abandoned and rolled back; the next
call says so.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from strategies import ResidencyError

from .._weight_sync import WeightSyncTransferFailed
from ._answers import Routes, update_response
from ._bodies import json_body, refused
from ._driver import TRANSFER_GROUP, RanksUnavailable
from ._state import Service, service_of
from ._wire import WireRefused

__all__ = ["TRANSFER_ROUTES", "WeightTransfer"]

GROUP = TRANSFER_GROUP
DEFAULT_TIMEOUT = 300.0
_NOT_STARTED = ("update_weights requires a preceding start_weight_update. "
                "Call POST /start_weight_update first.")
_FINISH_NOT_STARTED = "finish_weight_update called without a preceding start_weight_update."
_STARTED = ("start_weight_update called while a weight update is already in progress.  "
            "Call POST /finish_weight_update first.")


@dataclass
class WeightTransfer:
    """One server's transfer engine and its transaction (event-loop thread only)."""

    timeout: float = DEFAULT_TIMEOUT
    backend: str | None = None
    active: bool = False
    started: float = 0.0
    serial: int = 0  # which transaction (each rank's staging is keyed by it: _driver.Staging)
    paused_by_us: bool = False
    abandoned: str | None = None  # why the last transaction was rolled back

    def expired(self) -> bool:
        return self.active and time.monotonic() - self.started > self.timeout


def _transfer(service: Service) -> WeightTransfer:
    transfer: WeightTransfer = service.transfer
    return transfer


def _conflict(message: str) -> Exception:
    return refused(message, 409, detail=message)


async def _end(service: Service, transfer: WeightTransfer) -> None:
    transfer.active = False
    with contextlib.suppress(RanksUnavailable):  # a rank gone: its staging went with it
        await service.driver.drop_staged(transfer.serial)
    if transfer.paused_by_us:
        transfer.paused_by_us = False
        service.generations.resume()


async def _roll_back(service: Service, transfer: WeightTransfer, why: str) -> None:
    """Abandon the transaction: drop what is staged (nothing was written)."""
    transfer.abandoned = why
    await _end(service, transfer)


async def _check_expiry(service: Service, transfer: WeightTransfer) -> None:
    if transfer.expired():
        await _roll_back(service, transfer, f"not finished within {transfer.timeout:g} s of "
                                            "its start (the trainer gone?); rolled back")


async def init_weight_transfer_engine(request: Request) -> Response:
    service = service_of(request)
    transfer = _transfer(service)
    body = await json_body(request, service.body_limit)
    info = body.get("init_info")
    if info is None:
        raise refused("Missing 'init_info' in request body")
    if not isinstance(info, dict):
        raise refused(f"init_info must be an object, got {type(info).__name__}")
    if transfer.active:
        raise _conflict(_STARTED)
    timeout = info.get("update_timeout", DEFAULT_TIMEOUT)  # ours: seconds start -> finish
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise refused(f"init_info.update_timeout must be a number of seconds above 0, got "
                      f"{str(timeout)[:40]}")
    transfer.timeout = float(timeout)
    if "master_address" not in info:
        transfer.backend = "ipc"
        return JSONResponse({"message": "Weight transfer initialized", "backend": "ipc"})
    if not service.process_groups:  # it joins a trainer's group: opt-in, as the group routes
        raise refused("the nccl weight transfer is disabled on this server: it connects to a "
                      "trainer the client names; serve with --api-key KEY, or with "
                      "--allow-process-groups on a trusted network", 403)
    args: dict[str, Any] = {
        "master_address": info.get("master_address"), "master_port": info.get("master_port"),
        "rank_offset": info.get("rank_offset"), "world_size": info.get("world_size"),
        "group_name": GROUP,
        "backend": info.get("backend") or ("nccl" if service.ctl.device.type == "cuda"
                                           else "gloo"),
        "timeout": float(info.get("timeout", 60.0))}
    await service.driver.destroy_weights_update_group(GROUP)
    result = await service.driver.init_weights_update_group(args)
    if not result.success:
        raise refused(result.message)
    transfer.backend = "nccl"
    return JSONResponse({"message": "Weight transfer initialized", "backend": "nccl"})


async def start_weight_update(request: Request) -> Response:
    service = service_of(request)
    transfer = _transfer(service)
    await json_body(request, service.body_limit)
    await _check_expiry(service, transfer)
    if transfer.backend is None:
        raise _conflict("start_weight_update requires a preceding init_weight_transfer_engine. "
                        "Call POST /init_weight_transfer_engine first.")
    if transfer.active:
        raise _conflict(_STARTED)
    transfer.active, transfer.started, transfer.abandoned = True, time.monotonic(), None
    transfer.serial += 1
    if not service.generations.paused:  # no generation sees a half-updated pipeline
        await service.generations.pause("keep")
        transfer.paused_by_us = True
    return JSONResponse({"message": "Weight update started"})


async def update_weights(request: Request) -> Response:
    service = service_of(request)
    transfer = _transfer(service)
    body = await json_body(request, service.upload_limit)
    info = body.get("update_info")
    await _check_expiry(service, transfer)
    if not transfer.active:
        message = _NOT_STARTED if transfer.abandoned is None else \
            f"{_NOT_STARTED} (the last update was abandoned: {transfer.abandoned})"
        raise _conflict(message)
    if info is None:
        raise refused("Missing 'update_info' in request body")
    if not isinstance(info, dict):
        raise refused(f"update_info must be an object, got {type(info).__name__}")
    serial = transfer.serial
    if transfer.backend == "ipc":  # every rank decodes it (a rank that cannot: all refuse)
        staged = await service.driver.stage_ipc(serial, info)
    else:
        staged = await _receive(service, transfer, info)
    if staged is None or transfer.serial != serial or not transfer.active:
        # abandoned while it arrived: nothing of it is staged
        raise _conflict(f"{_NOT_STARTED} (the last update was abandoned: {transfer.abandoned})")
    return JSONResponse({"message": "Weights updated", "staged": staged})


async def _receive(service: Service, transfer: WeightTransfer, info: Mapping[str, Any]
                   ) -> dict[str, int] | None:
    """nccl: every rank receives the broadcast into host tensors (lifecycle._weight_sync) and
    stages them by module; nothing is written before finish. A failure on any rank rolls the
    transaction back on every rank."""
    names, dtypes, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
            and len(names) == len(dtypes) == len(shapes) and names
            and all(isinstance(n, str) for n in names)):
        await _roll_back(service, transfer, "update_info was not names, dtype_names and "
                                            "shapes of one length (the broadcast cannot be "
                                            "received)")
        raise refused("update_info needs names, dtype_names and shapes, lists of one length")
    if info.get("packed"):
        await _roll_back(service, transfer, "a packed broadcast is not received here")
        raise refused("packed broadcasts are not supported; send packed=false")
    serial = transfer.serial
    left = max(0.001, transfer.started + transfer.timeout - time.monotonic())
    try:
        return await service.driver.stage_received(serial, names, dtypes, shapes, left)
    except (ResidencyError, WeightSyncTransferFailed, WireRefused, RanksUnavailable) as exc:
        if transfer.serial == serial and transfer.active:
            await _roll_back(service, transfer, str(exc))
        raise refused(str(exc), rolled_back=True) from None


async def finish_weight_update(request: Request) -> Response:
    service = service_of(request)
    transfer = _transfer(service)
    body = await json_body(request, service.body_limit)
    version = body.get("weight_version")
    if version is not None and not isinstance(version, str | int):
        raise refused(f"weight_version must be a string, got {type(version).__name__}")
    await _check_expiry(service, transfer)
    if not transfer.active:
        message = _FINISH_NOT_STARTED if transfer.abandoned is None else \
            f"{_FINISH_NOT_STARTED} (the last update was abandoned: {transfer.abandoned})"
        raise _conflict(message)
    label = None if version is None else str(version)
    if not await service.driver.staged(transfer.serial):
        await _end(service, transfer)
        raise refused("no weights were sent between start and finish; nothing changed")
    try:  # everything staged, as one update on every rank (all or nothing)
        result = await service.driver.commit_staged(transfer.serial, label)
    except RanksUnavailable as exc:
        transfer.abandoned = str(exc)
        raise refused(str(exc), 503) from None
    finally:
        await _end(service, transfer)
    if not result.success:
        transfer.abandoned = result.message
        return update_response(result)
    return JSONResponse({"message": "Weight update finished",
                         "weight_version": service.ctl.weight_version_label})


async def abandon_after(service: Service) -> None:
    """Roll an unfinished transaction back once it outlived its timeout (run by the server's
    lifespan: one watchdog for every transaction; without one, the next call does it)."""
    transfer = _transfer(service)
    while True:
        wait = transfer.timeout if not transfer.active else \
            max(0.0, transfer.started + transfer.timeout - time.monotonic())
        await anyio.sleep(min(wait, 1.0) if math.isfinite(wait) else 1.0)
        await _check_expiry(service, transfer)


TRANSFER_ROUTES: Routes = {
    "/init_weight_transfer_engine": (init_weight_transfer_engine, ("POST",), True),
    "/start_weight_update": (start_weight_update, ("POST",), True),
    "/update_weights": (update_weights, ("POST",), True),
    "/finish_weight_update": (finish_weight_update, ("POST",), True),
}
