"""The reference's routes: each handler decodes its body (lifecycle.http._bodies) and calls
the driver; :data:`ROUTES`, the table of every route the app serves (these, and those of
lifecycle.http._control and lifecycle.http._transfer), is data the app and its gatekeeper read.
Routes raise: a library error's status is the app's one handler's (lifecycle.http._status).
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from strategies.protocol import to_thread

from . import _control, _transfer
from ._answers import Handler, Routes, group_result, transition, update
from ._bodies import (
    Span,
    discard_of,
    distributed_update,
    field,
    json_body,
    parse,
    read,
    refused,
    tensor_request,
    timeout_of,
    unicode_text,
    update_mode,
    weight_version,
)
from ._driver import Upload
from ._state import group_service, service_of

__all__ = ["ROUTES"]


async def release(request: Request) -> Response:
    """Release every device byte (``tags``: those of the components they name); ``discard``
    in the body (see :func:`discard_of`) drops the named components' weights without a host
    copy, overriding ``--discard-on-release``."""
    service = service_of(request)
    return await transition(request, lambda body: service.driver.sleep(
        discard_of(body, list(service.ctl.components)),
        _control.components_of(service, body.get("tags"))))


async def resume(request: Request) -> Response:
    """Resume every component (``tags``: those they name)."""
    service = service_of(request)
    return await transition(request, lambda body: service.driver.wake(
        _control.components_of(service, body.get("tags"))))


_FILE_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device",
               stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a directory"}


def _irregular_weight_file(root: str, components: Sequence[str]) -> str | None:
    """The first file a disk update would open that is not a regular file (a FIFO or a device
    blocks the native reader, which holds the GIL: the whole process would hang), with what it
    is; None when all are regular. Only ``stat``: nothing is opened."""
    try:
        if stat.S_ISREG(os.stat(root).st_mode):
            return None
    except OSError:
        return None  # the controller says it does not exist
    for component in components:
        folder = Path(root, component)
        if not folder.is_dir():
            continue
        for file in sorted(folder.glob("*.safetensors")):  # what the controller opens
            try:
                mode = os.stat(file).st_mode
            except OSError:
                continue  # a dangling link: the controller cannot read it either
            if not stat.S_ISREG(mode):
                return f"{file} is {_FILE_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}"
    return None


async def update_from_disk(request: Request) -> Response:
    service = service_of(request)
    body = await json_body(request, service.body_limit)
    path = field(body, "model_path", "string", required=True)
    if "\0" in path:
        raise refused("model_path must not contain a NUL character")
    targets = field(body, "target_modules", "list of strings")
    flush = field(body, "flush_cache", "boolean", default=False)
    update_mode(body, lora=False)
    version = weight_version(body)
    components = list(service.ctl.components) if targets is None else targets
    timeout = service.file_check_timeout
    try:
        with anyio.fail_after(timeout):
            irregular = await to_thread(
                _irregular_weight_file, path, components, abandon_on_cancel=True)
    except TimeoutError:
        raise refused(f"model_path {path!r} did not answer within {timeout:g} s (a hung file "
                       "system?); nothing was read") from None
    if irregular is not None:
        raise refused(f"weight file {irregular}, not a regular file; nothing was read")
    return await update(service, lambda: service.driver.update_from_disk(
        path, targets, weight_version=version, flush_cache=flush))


async def update_from_tensor(request: Request) -> Response:
    service = service_of(request)
    raw = await read(request, service.upload_limit, mapped=True)
    # In a worker thread: scanning a gigabyte for its strings takes a while.
    body = await to_thread(
        functools.partial(parse, raw, spans=service.body_limit))
    payloads = field(body, "serialized_named_tensors", "list of strings", required=True)
    if not payloads:
        raise refused("serialized_named_tensors is required: one entry, or one per rank")
    uuids = field(body, "payload_gpu_uuids", "list of strings")
    tensors = tensor_request(body)
    # The base64 is decoded in place in the body's buffer (each rank's entry, see the driver),
    # and the tensors are views of the decoded bytes where they can be: the upload's memory is
    # about the body's size.
    entries = [p.view if isinstance(p, Span) else p for p in payloads]
    del body, payloads
    upload = Upload(entries, uuids, tensors, service.fd_timeout)
    return await update(service, lambda: service.driver.update_from_upload(upload))


async def tensor_checker(request: Request) -> Response:
    """``/update_weights_from_tensor_checker``: the reference clients' per-tensor SHA-256s
    compared with the module's tensors (200 when all match, else 400 naming each)."""
    service = service_of(request)
    body = await json_body(request, service.body_limit)
    target = body.get("target_module")
    if not target:
        raise refused("target_module is required")
    if not isinstance(target, str):
        raise refused(f"target_module must be a string, got {type(target).__name__}")
    unicode_text("target_module", target)
    expected = body.get("expected_named_tensors_sha256")
    if not isinstance(expected, dict) or not expected:
        raise refused("expected_named_tensors_sha256 is required")
    for name, digest in expected.items():
        unicode_text("expected_named_tensors_sha256", name)
        if isinstance(digest, str):
            unicode_text(f"expected_named_tensors_sha256[{name[:100]!r}]", digest)
    result = await service.driver.check_tensor_hashes(target, expected)
    return JSONResponse(result.as_dict(), status_code=200 if result.success else 400)


async def get_weight_version(request: Request) -> Response:
    """The ``weight_version`` of the weights served (None before an update gave one)."""
    return JSONResponse({"weight_version": service_of(request).ctl.weight_version_label})


async def init_weights_update_group(request: Request) -> Response:
    """Join the trainer's group (it is rank 0 and serves the store): every server rank joins
    as ``rank_offset`` plus its rank, waiting at most ``timeout`` seconds for the others."""
    service = group_service(request)
    body = await json_body(request, service.body_limit)
    args: dict[str, Any] = {
        "master_address": field(body, "master_address", "string", required=True),
        "master_port": field(body, "master_port", "integer", required=True),
        "rank_offset": field(body, "rank_offset", "integer", required=True),
        "world_size": field(body, "world_size", "integer", required=True),
        "group_name": field(body, "group_name", "string", default="weight_update_group"),
        "backend": field(body, "backend", "string", default="nccl"),
        "timeout": timeout_of(body)}
    bucket = field(body, "bucket_bytes", "integer", bounds=(1, 2**50))
    if bucket is not None:
        args["bucket_bytes"] = bucket
    return await group_result(lambda: service.driver.init_weights_update_group(args))


async def update_weights_from_distributed(request: Request) -> Response:
    """Receive the tensors the trainer broadcasts over the group (in list order) into the
    target module, all or nothing. A request refused for its tensor list or the update's
    options still receives the broadcast before the answer (the trainer's completes): see
    :func:`lifecycle.http._bodies.distributed_update`."""
    service = group_service(request)
    body = await json_body(request, service.body_limit)
    broadcast = distributed_update(body)
    return await update(service, lambda: service.driver.update_from_broadcast(broadcast),
                        trainer=True)


async def destroy_weights_update_group(request: Request) -> Response:
    """Leave the group on every rank; an absent group is a success (clients destroy before
    they init)."""
    service = group_service(request)
    body = await json_body(request, service.body_limit)
    name = field(body, "group_name", "string", default="weight_update_group")
    return await group_result(lambda: service.driver.destroy_weights_update_group(name))


async def checksum(request: Request) -> Response:
    service = service_of(request)
    body = await json_body(request, service.body_limit)
    names = field(body, "module_names", "list of strings")
    wanted = list(service.ctl.components) if names is None else names
    sums = await service.driver.checksum(wanted)
    # A stale component (discarded by a release, not all updated since): "discarded".
    return JSONResponse({n: sums.get(n, "not_found") for n in wanted})


async def generate(request: Request) -> Response:
    service = service_of(request)
    body = await json_body(request, service.body_limit)
    if not service.driver.can_generate:
        raise refused("this pipeline has no generate function (see residency serve "
                       "--pipeline MODULE:FACTORY)", 404)
    async with service.generations.running(body.get("rid")) as rid:
        return JSONResponse({**await service.driver.generate(body), "rid": rid})


async def health(request: Request) -> Response:
    # 200 while sleeping too (routers mark a server dead otherwise); 503 without a pipeline.
    reason = service_of(request).driver.unavailable()
    if reason is not None:
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
    return JSONResponse({"status": "ok"})


async def flush_cache(request: Request) -> Response:
    service = service_of(request)
    await json_body(request, service.body_limit)
    await service.ctl.device_layer.release_cache()
    return JSONResponse({"success": True})


async def state(request: Request) -> Response:
    return JSONResponse(await service_of(request).driver.state())


async def metrics(request: Request) -> Response:
    m = service_of(request).metrics
    return Response(m.render(), media_type=m.content_type)


# The reference's routes, each served to POST callers with the API key.
_POSTED: dict[str, Handler] = {
    "/release_memory_occupation": release, "/resume_memory_occupation": resume,
    "/update_weights_from_disk": update_from_disk, "/update_weights_from_tensor":
    update_from_tensor, "/update_weights_from_tensor_checker": tensor_checker,
    "/get_weights_checksum": checksum, "/init_weights_update_group": init_weights_update_group,
    "/update_weights_from_distributed": update_weights_from_distributed,
    "/destroy_weights_update_group": destroy_weights_update_group, "/generate": generate}

#: Every route served: path -> (handler, methods, needs the API key).
ROUTES: Routes = {
    **{path: (handler, ("POST",), True) for path, handler in _POSTED.items()},
    "/get_weight_version": (get_weight_version, ("GET",), True),
    "/flush_cache": (flush_cache, ("GET", "POST"), True),
    "/state": (state, ("GET",), True),
    # probes and scrapers: no key (the reference's health checks send none)
    "/health": (health, ("GET",), False), "/health_generate": (health, ("GET",), False),
    "/metrics": (metrics, ("GET",), False),
    **_control.CONTROL_ROUTES, **_transfer.TRANSFER_ROUTES,
}

