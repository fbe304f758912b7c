"""The ASGI app: the reference's control paths over one :class:`LifecycleController`.

Every response, error or not, has a JSON body (clients call ``.json()`` on everything).
Typed refusals are 4xx, never 500: 400 for a refused request (with the reference's message),
401 without the API key, 403 for the weight update group routes on a server that did not
opt in to them, 404/405 for unknown paths and methods, 408 when a body stops
arriving, 409 when in-flight work did not drain in time, 413 for a body over the limit, 503
when a call waited too long for a transition, 507 when a move would pass the host budget
(refused before allocating). 500 is kept for a move that failed and was rolled back (the
body says so) and for a bug; an update over a trainer's process group that was rolled back
because the trainer's broadcast failed (it died or stalled) is the client's failure: 400, as
the reference answers failed updates (the update's ``causes`` say so, not its message).
Nothing changes on any refusal. A library error a route lets through is answered by one
handler from one table of error type to status (``lifecycle.http._status``); routes raise,
they do not choose statuses for library errors.

Bodies are bounded in memory as well as size: an upload's base64 strings are not parsed as
JSON but left in the body's buffer and decoded there (see :func:`_parse`), and everything slow
(scanning a large body, decoding, checking weight files) runs in worker threads, so that
``/health`` answers whatever an update is doing.

The routes are a table (:data:`ROUTES`); each handler parses its body against a small schema
(unknown fields are ignored: clients send fields meant for other servers) and calls the
controller, whose admission orders control calls and generations.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
import mmap
import os
import secrets
import stat
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import torch
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .. import LifecycleController, OccupationResult, Phase, UpdateResult
from .._discard import Discard, stale_note
from .._weight_sync import DEFAULT_TIMEOUT
from ..metrics import ControllerMetrics
from ..payload import FD_TIMEOUT, check_load_format
from ._driver import Driver, Generate, LocalDriver, Upload
from ._generations import Generations
from ._status import STATUS, answer_of
from ._wire import TensorRequest, client_fault, trainer_failed

__all__ = ["ROUTES", "Generate", "create_app", "demo_generate"]

_log = logging.getLogger("lifecycle.http")

MiB = 2**20


class BadRequest(Exception):
    """A refusal of the request itself: ``status`` and a JSON body, nothing changed."""

    def __init__(self, status: int, body: Mapping[str, Any],
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(body.get("message") or body.get("error"))
        self.status = status
        self.body = dict(body)
        self.headers = dict(headers or {})


def _refused(message: str, status: int = 400, **extra: Any) -> BadRequest:
    return BadRequest(status, {"success": False, "message": message, **extra})


# -- bodies -----------------------------------------------------------------------------
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "boolean": (bool,), "integer": (int,), "number": (int, float),
    "list of strings": (list,), "object": (dict,)}


def _text(name: str, value: str) -> str:
    """``value``, refused when it is not valid Unicode text: a lone surrogate (JSON's
    ``"\\ud800"``) cannot be encoded, in a path or in an answer."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _refused(f"{name} is not valid Unicode text (a lone surrogate at character "
                       f"{exc.start})") from None
    return value


def _field(body: Mapping[str, Any], name: str, kind: str, *, required: bool = False,
           default: Any = None, bounds: tuple[int, int] | None = None) -> Any:
    """``body[name]`` checked against ``kind`` (see :data:`_TYPES`); strings must be valid
    Unicode, integers inside ``bounds`` (inclusive) when given."""
    if name not in body or body[name] is None:
        if required:
            raise _refused(f"{name} is required")
        return default
    value = body[name]
    ok = isinstance(value, _TYPES[kind]) and not (kind in ("integer", "number")
                                                  and isinstance(value, bool))
    if ok and kind == "list of strings":
        ok = all(isinstance(v, str) for v in value)
    if not ok:
        raise _refused(f"{name} must be a {kind}, got {type(value).__name__}")
    if kind == "string":
        _text(name, value)
    elif kind == "list of strings":
        for i, v in enumerate(value):
            _text(f"{name}[{i}]", v)
    elif kind == "integer" and bounds is not None and not bounds[0] <= value <= bounds[1]:
        shown = str(value) if len(str(value)) <= 40 else f"an integer of {len(str(value))} digits"
        raise _refused(f"{name} must be an integer from {bounds[0]} to {bounds[1]}, got {shown}")
    return value


# Integers in a body: a handful of digits is plenty (seeds, steps); Python refuses over 4300.
_MAX_DIGITS = 100


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > _MAX_DIGITS:
        raise _refused(f"body holds an integer of {len(digits)} digits; at most {_MAX_DIGITS}")
    return int(digits)


# A body (see _read)
Body = bytearray | mmap.mmap
# With mapped=True, a body at least this large whose size is declared goes into an anonymous
# memory map of that size.
_MAPPED_MIN = MiB


async def _read(request: Request, limit: int, *, mapped: bool = False) -> Body:
    """The body, at most ``limit`` bytes (413 past it), in one buffer: no list of chunks to
    join, no second copy. With ``mapped``, a large body of declared size goes into a memory
    map of that size: pages are committed as bytes arrive (nothing for a client that declares
    much and sends little), and nothing moves as it fills (a growing bytearray over-allocates,
    and a move holds two copies for a moment)."""
    declared = request.headers.get("content-length")
    size = int(declared) if declared is not None and declared.isdigit() else None
    if size is not None and size > limit:
        raise _refused(f"body of {size} bytes is over the limit of {limit}", 413)
    if mapped and size is not None and size >= _MAPPED_MIN:
        try:
            buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
        except (OSError, ValueError, OverflowError):  # strict overcommit
            pass
        else:
            pos = 0
            with memoryview(buffer) as view:
                async for chunk in request.stream():
                    if pos + len(chunk) > size:  # h11 refuses this first
                        raise _refused(f"body is longer than its Content-Length of {size}")
                    view[pos:pos + len(chunk)] = chunk
                    pos += len(chunk)
            if pos != size:
                raise _refused(f"body of {pos} bytes is shorter than its Content-Length of {size}")
            return buffer
    raw = bytearray()
    async for chunk in request.stream():
        if len(raw) + len(chunk) > limit:
            raise _refused(f"body is over the limit of {limit} bytes", 413)
        raw += chunk
    return raw


# A string of an upload's body at least this long, with no escapes, is not parsed: it stays
# where it is in the body's buffer (see _parse), and its base64 is decoded from there.
_SPAN_MIN = 4096


class _Span(str):
    """A long string of the body left in the body's buffer: ``view`` is its bytes. The ``str``
    itself only describes it (``"<N characters at byte S>"``, unique in the body, so that long
    keys stay distinct): field checks pass, messages stay short."""

    view: memoryview


def _parse(raw: Body, *, spans: int | None = None) -> dict[str, Any]:
    """The JSON object ``raw`` holds (``{}`` when empty). With ``spans`` (a byte limit), every
    string of at least :data:`_SPAN_MIN` bytes without escapes comes back as a :class:`_Span`
    view of ``raw`` instead of a copy, and the JSON around them may be at most ``spans`` bytes
    (413 past it): only that much is parsed, and the parse holds the GIL."""
    found: dict[str, tuple[int, int]] = {}
    skeleton: bytes | bytearray
    if spans is not None:
        skeleton, found = _cut_long_strings(raw)
        if len(skeleton) > spans:
            raise _refused(f"the body's JSON outside its long strings is {len(skeleton)} bytes, "
                           f"over the limit of {spans}", 413)
    else:
        assert isinstance(raw, bytearray)
        skeleton = raw
    if not skeleton.strip():
        return {}
    try:
        body = json.loads(skeleton, parse_int=_parse_int)
    except RecursionError:
        raise _refused("body is nested too deeply to be a request") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise _refused(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise _refused(f"body must be a JSON object, got {type(body).__name__}")
    if found:
        _restore(body, found, memoryview(raw))
    return body


def _cut_long_strings(raw: Body) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """``raw`` with every string literal of at least :data:`_SPAN_MIN` bytes and no escapes
    replaced by a placeholder literal; and placeholder -> (start, end) of its bytes in ``raw``.
    JSON strings are delimited by the only unescaped quotes, so a scan from quote to quote
    finds them exactly; placeholders carry a random nonce, so no client text can be one."""
    nonce = secrets.token_hex(16)
    view = memoryview(raw)
    pieces: list[bytes | memoryview] = []
    found: dict[str, tuple[int, int]] = {}
    pos = scan = 0
    while (start := raw.find(b'"', scan)) >= 0:
        end = start
        while True:
            end = raw.find(b'"', end + 1)
            if end < 0:  # unterminated: json.loads says so
                pieces.append(view[pos:])
                return b"".join(pieces), found
            backslash = end - 1
            while raw[backslash] == 0x5C:
                backslash -= 1
            if (end - 1 - backslash) % 2 == 0:
                break
        if end - start - 1 >= _SPAN_MIN and raw.find(b"\\", start + 1, end) < 0:
            key = f"residency-{nonce}-{len(found)}"
            found[key] = (start + 1, end)
            pieces += [view[pos:start], f'"{key}"'.encode()]
            pos = end + 1
        scan = end + 1
    pieces.append(view[pos:])
    return b"".join(pieces), found


def _restore(body: dict[str, Any], found: Mapping[str, tuple[int, int]], raw: memoryview) -> None:
    """Make every placeholder in ``body`` (key or value, at any depth) a :class:`_Span`."""

    def span(key: str) -> _Span:
        start, end = found[key]
        out = _Span(f"<{end - start} characters at byte {start}>")
        out.view = raw[start:end]
        return out

    def fix(value: Any) -> Any:
        if isinstance(value, str) and value in found:
            return span(value)
        if isinstance(value, dict | list):
            stack.append(value)
        return value

    stack: list[Any] = [body]
    while stack:  # iterative: bodies may be nested as deep as json.loads allows
        node = stack.pop()
        if isinstance(node, list):
            node[:] = [fix(v) for v in node]
        else:
            items = [(fix(k), fix(v)) for k, v in node.items()]
            node.clear()
            node.update(items)


async def _body(request: Request, limit: int) -> dict[str, Any]:
    """The JSON object body (``{}`` when empty), read at most ``limit`` bytes."""
    return _parse(await _read(request, limit))


# -- the app's state ----------------------------------------------------------------------
@dataclass
class _Service:
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


def _service(request: Request) -> _Service:
    service: _Service = request.app.state.service
    return service


def _occupation(result: OccupationResult) -> Response:
    # success (and idempotent repeats) 200; a failure result ("pipeline not initialized") 400
    return JSONResponse(result.as_dict(), status_code=200 if result.success else 400)


async def _transition(request: Request,
                      call: Callable[[Mapping[str, Any]], Awaitable[OccupationResult]]
                      ) -> Response:
    """A release or resume; ``call`` gets the body (clients send ``{}`` or ``{"tags": [...]}``:
    see lifecycle.http._control.components_of), which must be valid JSON."""
    service = _service(request)
    body = await _body(request, service.body_limit)
    # A refusal says whether the pipeline sleeps (see _library_error).
    request.state.answer_extra = lambda: {"sleeping": service.ctl.phase is Phase.SLEEPING}
    return _occupation(await call(body))


# How many unknown names a refused ``discard`` shows, and how much of each.
_SHOWN_NAMES, _SHOWN_CHARS = 5, 60


def _discard(body: Mapping[str, Any], components: Sequence[str]) -> Discard:
    """The release body's ``discard``: None (absent or null: the server's
    ``--discard-on-release``), a boolean, ``"all"``, or component names (a list, or one string
    of comma-separated names) as a list; a 400 naming what is wrong and the valid values."""
    value = body.get("discard")
    if value is None or isinstance(value, bool) or value == "all":
        return value
    valid = (f"true (every component), false (none), \"all\", or a list of component names "
             f"from {sorted(components)}")
    if isinstance(value, str):
        names = [n.strip() for n in _text("discard", value).split(",")]
    elif isinstance(value, list) and all(isinstance(n, str) for n in value):
        names = [_text(f"discard[{i}]", n) for i, n in enumerate(value)]
    else:
        kind = "a list holding a non-string" if isinstance(value, list) else type(value).__name__
        raise _refused(f"discard must be {valid}; got {kind}")
    unknown = sorted({n for n in names if n not in components})
    if unknown:
        shown = ", ".join(repr(n[:_SHOWN_CHARS]) for n in unknown[:_SHOWN_NAMES])
        more = f" and {len(unknown) - _SHOWN_NAMES} more" if len(unknown) > _SHOWN_NAMES else ""
        raise _refused(f"discard names unknown component(s) {shown}{more}; it must be {valid}")
    return names


async def release(request: Request) -> Response:
    """Release every device byte (``tags``: those of the components they name); ``discard``
    in the body (see :func:`_discard`) drops the named components' weights without a host
    copy, overriding ``--discard-on-release``."""
    service = _service(request)
    return await _transition(request, lambda body: service.driver.sleep(
        _discard(body, list(service.ctl.components)),
        _control.components_of(service, body.get("tags"))))


async def resume(request: Request) -> Response:
    """Resume every component (``tags``: those they name)."""
    service = _service(request)
    return await _transition(request, lambda body: service.driver.wake(
        _control.components_of(service, body.get("tags"))))


def _update_response(result: UpdateResult, *, trainer: bool = False) -> Response:
    """An update's answer: 200, or 400 for a refusal. A rollback is a 500 (our failure),
    except, with ``trainer``, one caused by the trainer's broadcast (it died or stalled: the
    client's side), a 400 like the reference's failed updates. ``stale``: the components
    still stale after it (discarded tensors no update wrote yet: how many); a success says so
    in its message too, with a few names, so that a trainer sees a partial update."""
    stale = dict(result.stale)
    if result.success:
        names = ", ".join(result.updated)
        # The stale components' tensors (a few names), else their counts at least.
        note = stale_note(result.stale_tensors) if result.stale_tensors else \
            "; still stale: " + ", ".join(f"{n} ({k} tensor(s))" for n, k in stale.items())
        return JSONResponse({"success": True, "version": result.version,
                             "message": f"Updated {len(result.updated)} modules ({names})."
                                        + (note if stale else ""),
                             "bytes_written": result.bytes_written, "seconds": result.seconds,
                             "weight_version": result.weight_version, "stale": stale})
    ours = result.rolled_back and not (trainer and trainer_failed(result)) \
        and not client_fault(result)
    return JSONResponse({"success": False, "message": result.message, "version": result.version,
                         "rolled_back": result.rolled_back,
                         "weight_version": result.weight_version, "stale": stale},
                        status_code=500 if ours else 400)


async def _update(service: _Service, call: Callable[[], Awaitable[UpdateResult]], *,
                  trainer: bool = False) -> Response:
    return _update_response(await call(), trainer=trainer)


#: weight_update_mode values served: a full replacement (absent or "full"), or a LoRA merge
#: ("lora_merge": lora_A / lora_B tensors merged into their linears' pristine bases; tensor
#: uploads and updates over a weight update group only).
UPDATE_MODES: tuple[str | None, ...] = (None, "full", "lora_merge")


def _update_mode(body: Mapping[str, Any], *, lora: bool = True) -> str | None:
    mode: str | None = _field(body, "weight_update_mode", "string")
    if mode == "lora_merge" and not lora:
        raise _refused("weight_update_mode 'lora_merge' is not supported for disk updates; "
                       "accepted: 'full' (LoRA merges come as tensors, or over a weight update "
                       "group)")
    if mode not in UPDATE_MODES:
        assert mode is not None
        raise _refused(f"weight_update_mode {mode[:60]!r} is not supported; accepted: 'full' (the "
                       "default, a replacement of the named tensors) or 'lora_merge' (lora_A / "
                       "lora_B tensors merged into their linears)")
    return mode


#: The longest ``weight_version`` any route keeps (as sent); a longer one is refused (400).
#: Below the upload parser's long-string threshold, so no route ever sees its placeholder.
MAX_WEIGHT_VERSION = 1024


def _weight_version(body: Mapping[str, Any]) -> str | None:
    """``weight_version``: the trainer's label of the weights it sends (a string of at most
    :data:`MAX_WEIGHT_VERSION` characters, kept as sent; an integer is taken as its decimal
    string)."""
    value = body.get("weight_version")
    if isinstance(value, _Span):  # a long string left in an upload's buffer: over the cap
        raise _refused(f"weight_version is {len(value.view)} bytes long; at most "
                       f"{MAX_WEIGHT_VERSION} characters")
    if isinstance(value, str) and len(value) > MAX_WEIGHT_VERSION:
        raise _refused(f"weight_version is {len(value)} characters long; at most "
                       f"{MAX_WEIGHT_VERSION}")
    if value is None or isinstance(value, str):
        return None if value is None else _text("weight_version", value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 10**30:
        return str(value)
    raise _refused(f"weight_version must be a string, got {type(value).__name__}")


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
    service = _service(request)
    body = await _body(request, service.body_limit)
    path = _field(body, "model_path", "string", required=True)
    if "\0" in path:
        raise _refused("model_path must not contain a NUL character")
    targets = _field(body, "target_modules", "list of strings")
    flush = _field(body, "flush_cache", "boolean", default=False)
    _update_mode(body, lora=False)
    version = _weight_version(body)
    components = list(service.ctl.components) if targets is None else targets
    timeout = service.file_check_timeout
    try:
        with anyio.fail_after(timeout):
            irregular = await anyio.to_thread.run_sync(
                _irregular_weight_file, path, components, abandon_on_cancel=True)
    except TimeoutError:
        raise _refused(f"model_path {path!r} did not answer within {timeout:g} s (a hung file "
                       "system?); nothing was read") from None
    if irregular is not None:
        raise _refused(f"weight file {irregular}, not a regular file; nothing was read")
    return await _update(service, lambda: service.driver.update_from_disk(
        path, targets, weight_version=version, flush_cache=flush))


def _tensor_request(body: Mapping[str, Any]) -> TensorRequest:
    """The fields of a tensor upload besides its entries, checked."""
    targets = _field(body, "target_modules", "list of strings", default=["transformer"])
    if not targets:
        raise _refused("target_modules must name the module to update, got []")
    load_format = _field(body, "load_format", "string")
    if load_format == "auto":  # the LLM server's default: sniffed here
        load_format = None
    check_load_format(load_format)
    return TensorRequest(
        targets=tuple(targets), load_format=load_format, weight_update_mode=_update_mode(body),
        lora_alpha=_field(body, "lora_alpha", "number"),
        lora_rank=_field(body, "lora_rank", "integer"),
        weight_version=_weight_version(body),
        flush_cache=_field(body, "flush_cache", "boolean", default=False))


async def update_from_tensor(request: Request) -> Response:
    service = _service(request)
    raw = await _read(request, service.upload_limit, mapped=True)
    # In a worker thread: scanning a gigabyte for its strings takes a while.
    body = await anyio.to_thread.run_sync(
        functools.partial(_parse, raw, spans=service.body_limit))
    payloads = _field(body, "serialized_named_tensors", "list of strings", required=True)
    if not payloads:
        raise _refused("serialized_named_tensors is required: one entry, or one per rank")
    uuids = _field(body, "payload_gpu_uuids", "list of strings")
    tensors = _tensor_request(body)
    # The base64 is decoded in place in the body's buffer (each rank's entry, see the driver),
    # and the tensors are views of the decoded bytes where they can be: the upload's memory is
    # about the body's size.
    entries = [p.view if isinstance(p, _Span) else p for p in payloads]
    del body, payloads
    upload = Upload(entries, uuids, tensors, service.fd_timeout)
    return await _update(service, lambda: service.driver.update_from_upload(upload))


async def tensor_checker(request: Request) -> Response:
    """``/update_weights_from_tensor_checker``: the reference clients' per-tensor SHA-256s
    compared with the module's tensors (200 when all match, else 400 naming each)."""
    service = _service(request)
    body = await _body(request, service.body_limit)
    target = body.get("target_module")
    if not target:
        raise _refused("target_module is required")
    if not isinstance(target, str):
        raise _refused(f"target_module must be a string, got {type(target).__name__}")
    _text("target_module", target)
    expected = body.get("expected_named_tensors_sha256")
    if not isinstance(expected, dict) or not expected:
        raise _refused("expected_named_tensors_sha256 is required")
    for name, digest in expected.items():
        _text("expected_named_tensors_sha256", name)
        if isinstance(digest, str):
            _text(f"expected_named_tensors_sha256[{name[:100]!r}]", digest)
    result = await service.driver.check_tensor_hashes(target, expected)
    return JSONResponse(result.as_dict(), status_code=200 if result.success else 400)


async def get_weight_version(request: Request) -> Response:
    """The ``weight_version`` of the weights served (None before an update gave one)."""
    return JSONResponse({"weight_version": _service(request).ctl.weight_version_label})


# -- weight sync over a trainer's process group ----------------------------------------------
# Seconds a join, or a wait for the next broadcast tensor, may take: at most a day.
_MAX_TIMEOUT = 86400.0


def _timeout(body: Mapping[str, Any]) -> float:
    value = _field(body, "timeout", "number", default=DEFAULT_TIMEOUT)
    if not 0 < value <= _MAX_TIMEOUT:  # NaN fails too
        raise _refused(f"timeout must be a number of seconds above 0 and at most "
                       f"{_MAX_TIMEOUT:g}, got {value}")
    return float(value)


def _texts(name: str, value: Any) -> None:
    """Lone surrogates in the strings of a list would reach the answer's JSON: refused."""
    if isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, str):
                _text(f"{name}[{i}]", v)


def _group_service(request: Request) -> _Service:
    """The service, when it serves the weight update group routes; else a 403. They make the
    server connect to an address the client names and run a receiving process: served only
    with an API key, or when the server opted in (``process_groups``)."""
    service = _service(request)
    if not service.process_groups:
        raise _refused("the weight update group routes are disabled on this server: they make "
                       "it connect to a trainer the client names; serve with --api-key KEY, "
                       "or with --allow-process-groups on a trusted network", 403)
    return service


async def _group_result(call: Callable[[], Awaitable[Any]]) -> Response:
    result = await call()
    return JSONResponse(result.as_dict(), status_code=200 if result.success else 400)


async def init_weights_update_group(request: Request) -> Response:
    """Join the trainer's group (it is rank 0 and serves the store): every server rank joins
    as ``rank_offset`` plus its rank, waiting at most ``timeout`` seconds for the others."""
    service = _group_service(request)
    body = await _body(request, service.body_limit)
    args: dict[str, Any] = {
        "master_address": _field(body, "master_address", "string", required=True),
        "master_port": _field(body, "master_port", "integer", required=True),
        "rank_offset": _field(body, "rank_offset", "integer", required=True),
        "world_size": _field(body, "world_size", "integer", required=True),
        "group_name": _field(body, "group_name", "string", default="weight_update_group"),
        "backend": _field(body, "backend", "string", default="nccl"),
        "timeout": _timeout(body)}
    bucket = _field(body, "bucket_bytes", "integer", bounds=(1, 2**50))
    if bucket is not None:
        args["bucket_bytes"] = bucket
    return await _group_result(lambda: service.driver.init_weights_update_group(args))


async def update_weights_from_distributed(request: Request) -> Response:
    """Receive the tensors the trainer broadcasts over the group (in list order) into the
    target module, all or nothing. The tensor list and the update's options are checked by
    the controller, which still receives the broadcast when it refuses (the trainer's
    completes): they are passed as they came."""
    service = _group_service(request)
    body = await _body(request, service.body_limit)
    for name in ("names", "dtypes", "shapes"):
        if name not in body or body[name] is None:
            raise _refused(f"{name} is required")
        _texts(name, body[name])
    load_format = _field(body, "load_format", "string")
    if load_format not in (None, "auto", "direct"):
        raise _refused(f"load_format {load_format[:60]!r} is not supported over a weight "
                       "update group; the trainer broadcasts each named tensor as it is")
    targets = body.get("target_modules")
    _texts("target_modules", targets)
    args: dict[str, Any] = {
        "names": body["names"], "dtypes": body["dtypes"], "shapes": body["shapes"],
        "group_name": _field(body, "group_name", "string", default="weight_update_group"),
        "target_modules": ["transformer"] if targets is None else targets,
        "flush_cache": _field(body, "flush_cache", "boolean", default=False),
        "weight_version": _weight_version(body),
        "weight_update_mode": body.get("weight_update_mode"),
        "lora_alpha": body.get("lora_alpha"), "lora_rank": body.get("lora_rank"),
        "timeout": _timeout(body), "bucket_bytes": body.get("bucket_bytes")}
    return await _update(service, lambda: service.driver.update_weights_from_distributed(args),
                         trainer=True)


async def destroy_weights_update_group(request: Request) -> Response:
    """Leave the group on every rank; an absent group is a success (clients destroy before
    they init)."""
    service = _group_service(request)
    body = await _body(request, service.body_limit)
    name = _field(body, "group_name", "string", default="weight_update_group")
    return await _group_result(lambda: service.driver.destroy_weights_update_group(name))


async def checksum(request: Request) -> Response:
    service = _service(request)
    body = await _body(request, service.body_limit)
    names = _field(body, "module_names", "list of strings")
    wanted = list(service.ctl.components) if names is None else names
    sums = await service.driver.checksum(wanted)
    # A stale component (discarded by a release, not all updated since): "discarded".
    return JSONResponse({n: sums.get(n, "not_found") for n in wanted})


async def generate(request: Request) -> Response:
    service = _service(request)
    body = await _body(request, service.body_limit)
    if not service.driver.can_generate:
        raise _refused("this pipeline has no generate function (see residency serve "
                       "--pipeline MODULE:FACTORY)", 404)
    async with service.generations.running(body.get("rid")) as rid:
        return JSONResponse({**await service.driver.generate(body), "rid": rid})


async def health(request: Request) -> Response:
    # 200 while sleeping too (routers mark a server dead otherwise); 503 without a pipeline.
    reason = _service(request).driver.unavailable()
    if reason is not None:
        return JSONResponse({"status": "unavailable", "reason": reason}, status_code=503)
    return JSONResponse({"status": "ok"})


async def flush_cache(request: Request) -> Response:
    service = _service(request)
    await _body(request, service.body_limit)
    await service.ctl.device_layer.release_cache()
    return JSONResponse({"success": True})


async def state(request: Request) -> Response:
    return JSONResponse(await _service(request).driver.state())


async def metrics(request: Request) -> Response:
    m = _service(request).metrics
    return Response(m.render(), media_type=m.content_type)


Handler = Callable[[Request], Awaitable[Response]]

# The RL clients' control routes use this module's helpers above: imported once they exist.
from . import _control, _transfer  # noqa: E402

# The reference's routes, each served to POST callers with the API key.
_POSTED: dict[str, Handler] = {
    "/release_memory_occupation": release, "/resume_memory_occupation": resume,
    "/update_weights_from_disk": update_from_disk, "/update_weights_from_tensor":
    update_from_tensor, "/update_weights_from_tensor_checker": tensor_checker,
    "/get_weights_checksum": checksum, "/init_weights_update_group": init_weights_update_group,
    "/update_weights_from_distributed": update_weights_from_distributed,
    "/destroy_weights_update_group": destroy_weights_update_group, "/generate": generate}

# path -> (handler, methods, needs the API key)
ROUTES: dict[str, tuple[Handler, tuple[str, ...], bool]] = {
    **{path: (handler, ("POST",), True) for path, handler in _POSTED.items()},
    "/get_weight_version": (get_weight_version, ("GET",), True),
    "/flush_cache": (flush_cache, ("GET", "POST"), True),
    "/state": (state, ("GET",), True),
    # probes and scrapers: no key (the reference's health checks send none)
    "/health": (health, ("GET",), False), "/health_generate": (health, ("GET",), False),
    "/metrics": (metrics, ("GET",), False),
    **_control.CONTROL_ROUTES, **_transfer.TRANSFER_ROUTES,
}


# -- errors -------------------------------------------------------------------------------
async def _bad_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, BadRequest)
    return JSONResponse(exc.body, status_code=exc.status, headers=exc.headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return JSONResponse({"success": False, "error": exc.detail, "message": exc.detail},
                        status_code=exc.status_code, headers=exc.headers)


async def _library_error(request: Request, exc: Exception) -> Response:
    """Every library error a route lets through: its status from the one table
    (lifecycle.http._status), with the fields the route adds (``request.state.answer_extra``)."""
    extra = getattr(request.state, "answer_extra", None)
    answer = answer_of(exc, request.url.path, **(extra() if extra is not None else {}))
    assert answer is not None  # registered for the table's classes only
    status, body = answer
    return JSONResponse(body, status_code=status)


async def _gone(request: Request, exc: Exception) -> Response:
    # The client went away mid-body: nobody reads this answer; not our bug either.
    return JSONResponse({"success": False, "message": "the client disconnected"}, status_code=400)


async def _internal_error(request: Request, exc: Exception) -> Response:
    _log.error("http.internal_error path=%s error=%s", request.url.path, type(exc).__name__)
    return JSONResponse({"success": False, "message": f"internal error: {type(exc).__name__}"},
                        status_code=500)


# -- middleware ---------------------------------------------------------------------------
def _timed_receive(receive: Receive, timeout: float) -> Receive:
    """``receive`` that raises a 408 :class:`BadRequest` when the next piece of the request
    body does not come within ``timeout`` seconds (a client that declared more than it sends
    would otherwise hold the request forever); untimed once the body is complete."""
    complete = False

    async def timed() -> Message:
        nonlocal complete
        if complete:
            return await receive()
        try:
            with anyio.fail_after(timeout):
                message = await receive()
        except TimeoutError:
            raise BadRequest(408, {"success": False, "message": f"the request body stopped "
                                   f"arriving ({timeout:g} s without a byte)"},
                             {"connection": "close"}) from None
        complete = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return timed


class _Gatekeeper:
    """API key check, the body read timeout, one log line and one metrics count per request."""

    def __init__(self, app: ASGIApp, service: _Service, api_key: str | None,
                 body_timeout: float | None) -> None:
        self.app = app
        self.service = service
        self.api_key = api_key
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        path = scope["path"]
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        if self.body_timeout is not None:
            receive = _timed_receive(receive, self.body_timeout)
        try:
            refusal = self._refusal(scope)
            if refusal is None:
                await self.app(scope, receive, send_status)
            else:
                await refusal(scope, receive, send_status)
        finally:
            label = path if path in ROUTES else "other"
            self.service.metrics.count_request(label, status)
            _log.info("%s %s %d %.1f ms", scope["method"], path, status,
                      1e3 * (time.perf_counter() - t0))

    def _refusal(self, scope: Scope) -> Response | None:
        """None when the request may go on; else its answer: 401 without the key, 400 with
        more than one ``Authorization`` header (which one would count?)."""
        route = ROUTES.get(scope["path"])
        if self.api_key is None or (route is not None and not route[2]):
            return None
        headers = [v for k, v in scope["headers"] if k.lower() == b"authorization"]
        if len(headers) > 1:
            message = f"the request has {len(headers)} Authorization headers; send one"
            return JSONResponse({"success": False, "error": message, "message": message},
                                status_code=400)
        scheme, _, token = (headers[0] if headers else b"").decode("latin-1").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("latin-1"),
                                                              self.api_key.encode()):
            return None
        return JSONResponse({"error": "Unauthorized"}, status_code=401)


def create_app(ctl: LifecycleController, *, generate: Generate | None = None,
               api_key: str | None = None, metrics: ControllerMetrics | None = None,
               driver: Driver | None = None,
               body_limit: int = MiB, upload_limit: int = 1024 * MiB,
               body_timeout: float | None = 30.0, fd_timeout: float = FD_TIMEOUT,
               file_check_timeout: float = 10.0, process_groups: bool | None = None,
               on_startup: Callable[[], Awaitable[None]] | None = None,
               on_shutdown: Callable[[], Awaitable[None]] | None = None) -> ASGIApp:
    """The ASGI app serving ``ctl``: the routes of :data:`ROUTES`, JSON everywhere.

    ``generate`` serves ``/generate`` (see :func:`demo_generate`); ``api_key`` protects every
    path but ``/health*`` and ``/metrics`` (an empty key is refused: it would admit an empty
    token); ``metrics`` defaults to a fresh :class:`~lifecycle.metrics.ControllerMetrics`;
    ``body_limit`` / ``upload_limit`` bound request bodies (the tensor upload gets the larger
    one); ``body_timeout``: seconds without a byte of a body being read before a 408 (None:
    wait forever); ``fd_timeout``: seconds each step of a ``file_descriptor`` handshake of a
    pickled upload may take; ``file_check_timeout``: seconds a disk update's look at its weight
    files may take (a hung file system) before a 400. ``process_groups``: serve the weight
    update group routes (they make the server connect to a trainer the client names); None:
    only with an ``api_key`` (else they answer 403). ``on_startup`` / ``on_shutdown`` run in
    the server's lifespan (``residency serve`` attaches and detaches there); ``driver``
    replaces the direct calls to ``ctl`` (several ranks: every call on every rank).

    Header read timeouts and a connection limit belong to the HTTP server: see
    :func:`lifecycle.http.uvicorn_config`."""
    if api_key is not None and not api_key.strip():
        raise ValueError("api_key is empty: it would admit 'Authorization: Bearer ' with no "
                         "token; give a key, or None to serve without one")
    service = _Service(driver or LocalDriver(ctl, generate), metrics or ControllerMetrics(ctl),
                       body_limit, upload_limit, fd_timeout, file_check_timeout,
                       api_key is not None if process_groups is None else process_groups,
                       Generations(ctl.admission_timeout, ctl.drain_timeout))

    service.transfer = _transfer.WeightTransfer()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if on_startup is not None:
            await on_startup()
        try:
            async with anyio.create_task_group() as tg:
                # Rolls back a weight transfer its trainer abandoned (lifecycle.http._transfer).
                tg.start_soon(_transfer.abandon_after, service)
                yield
                tg.cancel_scope.cancel()
        finally:
            if on_shutdown is not None:
                await on_shutdown()

    app = Starlette(
        routes=[Route(path, handler, methods=list(methods))
                for path, (handler, methods, _) in ROUTES.items()],
        exception_handlers={**dict.fromkeys(STATUS, _library_error),
                            BadRequest: _bad_request, HTTPException: _http_error,
                            ClientDisconnect: _gone, Exception: _internal_error},
        lifespan=lifespan)
    app.state.service = service
    return _Gatekeeper(app, service, api_key, body_timeout)


# -- the demo pipeline's generation ---------------------------------------------------------
def demo_generate(pipe: Any) -> Generate:
    """``/generate`` for :class:`lifecycle.demo.DemoPipeline`: body ``{"seed": int, "steps":
    int}``; answers the image's shape, dtype and the SHA-256 of its bytes."""

    async def run(ctl: LifecycleController, body: Mapping[str, Any]) -> Mapping[str, Any]:
        # torch.Generator.manual_seed's range
        seed = _field(body, "seed", "integer", default=0, bounds=(-(2**63), 2**64 - 1))
        steps = _field(body, "steps", "integer", default=3)
        if not 1 <= steps <= 100:
            raise _refused(f"steps must be between 1 and 100, got {steps}")
        image: torch.Tensor = await pipe.generate(ctl=ctl, seed=seed, steps=steps)
        data = image.detach().to("cpu").contiguous()
        digest = hashlib.sha256(data.numpy().tobytes()).hexdigest()
        return {"success": True, "shape": list(data.shape),
                "dtype": str(data.dtype).removeprefix("torch."), "sha256": digest,
                "weights_version": ctl.weights_version}

    return run
