"""Request bodies: read bounded (in size and in memory), parsed, and each field checked.

A body is read into one buffer (:func:`read`: 413 past its limit, a large upload into an
anonymous memory map); :func:`parse` makes it a JSON object, leaving an upload's long base64
strings in that buffer (:class:`Span`) so that only the JSON around them is parsed. The field
decoders (:func:`field` and the ones named after a field) turn a body into the typed values the
routes pass on; every refusal is a :class:`BadRequest` naming the field and what is valid,
before anything changed.
"""

from __future__ import annotations

import json
import mmap
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from starlette.requests import Request

from .._discard import Discard
from .._weight_sync import DEFAULT_TIMEOUT, Broadcast, DistributedUpdate
from ..payload import check_load_format
from ._wire import TensorRequest

__all__ = ["MAX_WEIGHT_VERSION", "SPAN_MIN", "UPDATE_MODES", "BadRequest", "Body", "MiB", "Span",
           "discard_of", "distributed_update", "field", "json_body", "parse", "read", "refused",
           "tensor_request", "texts", "timeout_of", "unicode_text", "update_mode", "weight_version"]

MiB = 2**20


class BadRequest(Exception):
    """A refusal of the request itself: ``status`` and a JSON body, nothing changed."""

    def __init__(self, status: int, body: Mapping[str, Any],
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(body.get("message") or body.get("error"))
        self.status = status
        self.body = dict(body)
        self.headers = dict(headers or {})


def refused(message: str, status: int = 400, **extra: Any) -> BadRequest:
    return BadRequest(status, {"success": False, "message": message, **extra})


# -- reading and parsing -----------------------------------------------------------------------------
_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,), "boolean": (bool,), "integer": (int,), "number": (int, float),
    "list of strings": (list,), "object": (dict,)}


def unicode_text(name: str, value: str) -> str:
    """``value``, refused when it is not valid Unicode text: a lone surrogate (JSON's
    ``"\\ud800"``) cannot be encoded, in a path or in an answer."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise refused(f"{name} is not valid Unicode text (a lone surrogate at character "
                       f"{exc.start})") from None
    return value


def field(body: Mapping[str, Any], name: str, kind: str, *, required: bool = False,
          default: Any = None, bounds: tuple[int, int] | None = None) -> Any:
    """``body[name]`` checked against ``kind`` (see :data:`_TYPES`); strings must be valid
    Unicode, integers inside ``bounds`` (inclusive) when given."""
    if name not in body or body[name] is None:
        if required:
            raise refused(f"{name} is required")
        return default
    value = body[name]
    ok = isinstance(value, _TYPES[kind]) and not (kind in ("integer", "number")
                                                  and isinstance(value, bool))
    if ok and kind == "list of strings":
        ok = all(isinstance(v, str) for v in value)
    if not ok:
        raise refused(f"{name} must be a {kind}, got {type(value).__name__}")
    if kind == "string":
        unicode_text(name, value)
    elif kind == "list of strings":
        for i, v in enumerate(value):
            unicode_text(f"{name}[{i}]", v)
    elif kind == "integer" and bounds is not None and not bounds[0] <= value <= bounds[1]:
        shown = str(value) if len(str(value)) <= 40 else f"an integer of {len(str(value))} digits"
        raise refused(f"{name} must be an integer from {bounds[0]} to {bounds[1]}, got {shown}")
    return value


# Integers in a body: a handful of digits is plenty (seeds, steps); Python refuses over 4300.
_MAX_DIGITS = 100


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > _MAX_DIGITS:
        raise refused(f"body holds an integer of {len(digits)} digits; at most {_MAX_DIGITS}")
    return int(digits)


# A body (see read)
Body = bytearray | mmap.mmap
# With mapped=True, a body at least this large whose size is declared goes into an anonymous
# memory map of that size.
_MAPPED_MIN = MiB


async def read(request: Request, limit: int, *, mapped: bool = False) -> Body:
    """The body, at most ``limit`` bytes (413 past it), in one buffer: no list of chunks to
    join, no second copy. With ``mapped``, a large body of declared size goes into a memory
    map of that size: pages are committed as bytes arrive (nothing for a client that declares
    much and sends little), and nothing moves as it fills (a growing bytearray over-allocates,
    and a move holds two copies for a moment)."""
    declared = request.headers.get("content-length")
    size = int(declared) if declared is not None and declared.isdigit() else None
    if size is not None and size > limit:
        raise refused(f"body of {size} bytes is over the limit of {limit}", 413)
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
                        raise refused(f"body is longer than its Content-Length of {size}")
                    view[pos:pos + len(chunk)] = chunk
                    pos += len(chunk)
            if pos != size:
                raise refused(f"body of {pos} bytes is shorter than its Content-Length of {size}")
            return buffer
    raw = bytearray()
    async for chunk in request.stream():
        if len(raw) + len(chunk) > limit:
            raise refused(f"body is over the limit of {limit} bytes", 413)
        raw += chunk
    return raw


# A string of an upload's body at least this long, with no escapes, is not parsed: it stays
# where it is in the body's buffer (see parse), and its base64 is decoded from there.
SPAN_MIN = 4096


class Span(str):
    """A long string of the body left in the body's buffer: ``view`` is its bytes. The ``str``
    itself only describes it (``"<N characters at byte S>"``, unique in the body, so that long
    keys stay distinct): field checks pass, messages stay short."""

    view: memoryview


def parse(raw: Body, *, spans: int | None = None) -> dict[str, Any]:
    """The JSON object ``raw`` holds (``{}`` when empty). With ``spans`` (a byte limit), every
    string of at least :data:`SPAN_MIN` bytes without escapes comes back as a :class:`Span`
    view of ``raw`` instead of a copy, and the JSON around them may be at most ``spans`` bytes
    (413 past it): only that much is parsed, and the parse holds the GIL."""
    found: dict[str, tuple[int, int]] = {}
    skeleton: bytes | bytearray
    if spans is not None:
        skeleton, found = _cut_long_strings(raw)
        if len(skeleton) > spans:
            raise refused(f"the body's JSON outside its long strings is {len(skeleton)} bytes, "
                          f"over the limit of {spans}", 413)
    else:
        assert isinstance(raw, bytearray)
        skeleton = raw
    if not skeleton.strip():
        return {}
    try:
        body = json.loads(skeleton, parse_int=_parse_int)
    except RecursionError:
        raise refused("body is nested too deeply to be a request") from None
    except (UnicodeDecodeError, ValueError) as exc:
        raise refused(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise refused(f"body must be a JSON object, got {type(body).__name__}")
    if found:
        _restore(body, found, memoryview(raw))
    return body


def _cut_long_strings(raw: Body) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """``raw`` with every string literal of at least :data:`SPAN_MIN` bytes and no escapes
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
        if end - start - 1 >= SPAN_MIN and raw.find(b"\\", start + 1, end) < 0:
            key = f"residency-{nonce}-{len(found)}"
            found[key] = (start + 1, end)
            pieces += [view[pos:start], f'"{key}"'.encode()]
            pos = end + 1
        scan = end + 1
    pieces.append(view[pos:])
    return b"".join(pieces), found


def _restore(body: dict[str, Any], found: Mapping[str, tuple[int, int]], raw: memoryview) -> None:
    """Make every placeholder in ``body`` (key or value, at any depth) a :class:`Span`."""

    def span(key: str) -> Span:
        start, end = found[key]
        out = Span(f"<{end - start} characters at byte {start}>")
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


async def json_body(request: Request, limit: int) -> dict[str, Any]:
    """The JSON object body (``{}`` when empty), read at most ``limit`` bytes."""
    return parse(await read(request, limit))


# How many unknown names a refused ``discard`` shows, and how much of each.
_SHOWN_NAMES, _SHOWN_CHARS = 5, 60


def discard_of(body: Mapping[str, Any], components: Sequence[str]) -> Discard:
    """The release body's ``discard``: None (absent or null: the server's
    ``--discard-on-release``), a boolean, ``"all"``, or component names (a list, or one string
    of comma-separated names) as a list; a 400 naming what is wrong and the valid values."""
    value = body.get("discard")
    if value is None or isinstance(value, bool) or value == "all":
        return value
    valid = (f"true (every component), false (none), \"all\", or a list of component names "
             f"from {sorted(components)}")
    if isinstance(value, str):
        names = [n.strip() for n in unicode_text("discard", value).split(",")]
    elif isinstance(value, list) and all(isinstance(n, str) for n in value):
        names = [unicode_text(f"discard[{i}]", n) for i, n in enumerate(value)]
    else:
        kind = "a list holding a non-string" if isinstance(value, list) else type(value).__name__
        raise refused(f"discard must be {valid}; got {kind}")
    unknown = sorted({n for n in names if n not in components})
    if unknown:
        shown = ", ".join(repr(n[:_SHOWN_CHARS]) for n in unknown[:_SHOWN_NAMES])
        more = f" and {len(unknown) - _SHOWN_NAMES} more" if len(unknown) > _SHOWN_NAMES else ""
        raise refused(f"discard names unknown component(s) {shown}{more}; it must be {valid}")
    return names


#: weight_update_mode values served: a full replacement (absent or "full"), or a LoRA merge
#: ("lora_merge": lora_A / lora_B tensors merged into their linears' pristine bases; tensor
#: uploads and updates over a weight update group only).
UPDATE_MODES: tuple[str | None, ...] = (None, "full", "lora_merge")


def update_mode(body: Mapping[str, Any], *, lora: bool = True) -> str | None:
    mode: str | None = field(body, "weight_update_mode", "string")
    if mode == "lora_merge" and not lora:
        raise refused("weight_update_mode 'lora_merge' is not supported for disk updates; "
                      "accepted: 'full' (LoRA merges come as tensors, or over a weight update "
                      "group)")
    if mode not in UPDATE_MODES:
        assert mode is not None
        raise refused(f"weight_update_mode {mode[:60]!r} is not supported; accepted: 'full' (the "
                       "default, a replacement of the named tensors) or 'lora_merge' (lora_A / "
                       "lora_B tensors merged into their linears)")
    return mode


#: The longest ``weight_version`` any route keeps (as sent); a longer one is refused (400).
#: Below the upload parser's long-string threshold, so no route ever sees its placeholder.
MAX_WEIGHT_VERSION = 1024


def weight_version(body: Mapping[str, Any]) -> str | None:
    """``weight_version``: the trainer's label of the weights it sends (a string of at most
    :data:`MAX_WEIGHT_VERSION` characters, kept as sent; an integer is taken as its decimal
    string)."""
    value = body.get("weight_version")
    if isinstance(value, Span):  # a long string left in an upload's buffer: over the cap
        raise refused(f"weight_version is {len(value.view)} bytes long; at most "
                      f"{MAX_WEIGHT_VERSION} characters")
    if isinstance(value, str) and len(value) > MAX_WEIGHT_VERSION:
        raise refused(f"weight_version is {len(value)} characters long; at most "
                      f"{MAX_WEIGHT_VERSION}")
    if value is None or isinstance(value, str):
        return None if value is None else unicode_text("weight_version", value)
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) < 10**30:
        return str(value)
    raise refused(f"weight_version must be a string, got {type(value).__name__}")


def tensor_request(body: Mapping[str, Any]) -> TensorRequest:
    """The fields of a tensor upload besides its entries, checked."""
    targets = field(body, "target_modules", "list of strings", default=["transformer"])
    if not targets:
        raise refused("target_modules must name the module to update, got []")
    load_format = field(body, "load_format", "string")
    if load_format == "auto":  # the LLM server's default: sniffed here
        load_format = None
    check_load_format(load_format)
    return TensorRequest(
        targets=tuple(targets), load_format=load_format, weight_update_mode=update_mode(body),
        lora_alpha=field(body, "lora_alpha", "number"),
        lora_rank=field(body, "lora_rank", "integer"),
        weight_version=weight_version(body),
        flush_cache=field(body, "flush_cache", "boolean", default=False))


# Seconds a join, or a wait for the next broadcast tensor, may take: at most a day.
_MAX_TIMEOUT = 86400.0


def timeout_of(body: Mapping[str, Any]) -> float:
    value = field(body, "timeout", "number", default=DEFAULT_TIMEOUT)
    if not 0 < value <= _MAX_TIMEOUT:  # NaN fails too
        raise refused(f"timeout must be a number of seconds above 0 and at most "
                      f"{_MAX_TIMEOUT:g}, got {value}")
    return float(value)


def texts(name: str, value: Any) -> None:
    """Lone surrogates in the strings of a list would reach the answer's JSON: refused."""
    if isinstance(value, list):
        for i, v in enumerate(value):
            if isinstance(v, str):
                unicode_text(f"{name}[{i}]", v)



def distributed_update(body: Mapping[str, Any]) -> Broadcast:
    """``/update_weights_from_distributed``'s request. Refused here (400, before the group is
    touched) only what the HTTP layer owns: absent lists, lone surrogates, a load format, a
    field of the wrong JSON type, a ``timeout`` out of range; the tensor list and the
    update's options are checked by :meth:`DistributedUpdate.parse`, whose refusal still
    receives the broadcast (the trainer's completes)."""
    for name in ("names", "dtypes", "shapes"):
        if name not in body or body[name] is None:
            raise refused(f"{name} is required")
        texts(name, body[name])
    load_format = field(body, "load_format", "string")
    if load_format not in (None, "auto", "direct"):
        raise refused(f"load_format {load_format[:60]!r} is not supported over a weight "
                      "update group; the trainer broadcasts each named tensor as it is")
    targets = body.get("target_modules")
    texts("target_modules", targets)
    return DistributedUpdate.parse({
        "names": body["names"], "dtypes": body["dtypes"], "shapes": body["shapes"],
        "group_name": field(body, "group_name", "string", default="weight_update_group"),
        "target_modules": ["transformer"] if targets is None else targets,
        "flush_cache": field(body, "flush_cache", "boolean", default=False),
        "weight_version": weight_version(body),
        "weight_update_mode": body.get("weight_update_mode"),
        "lora_alpha": body.get("lora_alpha"), "lora_rank": body.get("lora_rank"),
        "timeout": timeout_of(body), "bucket_bytes": body.get("bucket_bytes")})
