"""Decoding one ``serialized_named_tensors`` entry: base64, the ``load_format``, the modules.

The entry points of the package (see its doc): the bytes are sniffed or taken as the format
says, a safetensors file is parsed (``_safetensors``), a pickle is checked and unpickled
(``_prescan``, ``_unpickler``), and a payload keyed by module is resolved against the targets.
"""

from __future__ import annotations

import binascii
import ctypes
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._bucket import unflatten
from ._errors import PayloadModulesMismatch, TransportError, refuse
from ._handles import FD_TIMEOUT, fd_timeout_var
from ._memory import PIECE
from ._safetensors import load_safetensors, looks_like_safetensors
from ._sealed import TensorRef
from ._unpickler import named_pairs, unpickle

#: ``load_format`` values :func:`decode_named_tensors` accepts (``None``: sniffed).
LOAD_FORMATS: tuple[str | None, ...] = (None, "direct", "flattened_bucket", "safetensors")


# --------------------------------------------------------------------------------------------
# Decoding.
# --------------------------------------------------------------------------------------------


def decode_named_tensors(payload: str | bytes | bytearray | memoryview, load_format: str | None,
                         *, fd_timeout: float = FD_TIMEOUT, module: str = "transformer"
                         ) -> list[tuple[str, torch.Tensor]]:
    """Decode one ``serialized_named_tensors`` entry into ``(name, tensor)`` pairs.

    ``payload``: the base64 text (a ``str``, or its ASCII bytes). ``load_format``:
    ``"safetensors"``; ``"direct"`` (a pickled list of pairs); ``"flattened_bucket"`` (a pickled
    bucket); ``None`` (safetensors if the bytes are a safetensors file, else ``"direct"``).
    A pickle may also hold ``{module: payload}``: the tensors of ``module`` are returned.
    ``fd_timeout``: seconds each step of a ``file_descriptor`` handshake may take. Raises
    :class:`TransportError`. Same as :func:`decode_payload` of :func:`decode_base64`.
    """
    check_load_format(load_format)
    return decode_payload(decode_base64(payload), load_format, fd_timeout=fd_timeout,
                          module=module)


def check_load_format(load_format: object) -> None:
    """Raise :class:`TransportError` unless ``load_format`` is one of :data:`LOAD_FORMATS`."""
    if load_format not in LOAD_FORMATS:
        shown = repr(load_format)[:60] if isinstance(load_format, str) else type(load_format).__name__
        refuse(f"load_format {shown} is not supported; accepted: 'safetensors', 'direct', "
                "'flattened_bucket', or none (safetensors or direct, sniffed)")


def decode_base64(payload: object) -> memoryview:
    """The bytes of a base64 entry (``str`` or ASCII bytes-like), decoded in pieces (the GIL is
    let go between them). A writable ``memoryview`` (the entry's place in the request body) is
    decoded in place, over its own text: no second buffer; anything else into a new one."""
    out: memoryview | None = None
    if isinstance(payload, str):
        if not payload.isascii():
            refuse(f"not valid base64 ({len(payload)} characters)")
        text: memoryview | str = payload
    elif isinstance(payload, bytes | bytearray | memoryview):
        text = memoryview(payload).cast("B")
        if isinstance(payload, memoryview) and not text.readonly:
            out = text  # the decoded bytes never overtake the text still to be read
    else:
        refuse(f"the entry must be a base64 string, got {type(payload).__name__}")
    n = len(text)
    if n == 0:
        refuse("the entry is empty")
    invalid = f"not valid base64 ({n} characters)"
    if n % 4:
        refuse(invalid)
    tail = text[n - 2:]
    size = n // 4 * 3 - (tail.count("=") if isinstance(tail, str) else bytes(tail).count(b"="))
    if out is None:
        out = memoryview(bytearray(size))
    else:
        # Start the bytes on a 64-byte boundary, so that tensors can be views of them. Writes
        # stay behind reads: a piece of 4k characters gives 3k bytes, and the shift is < 64.
        shift = -ctypes.addressof(ctypes.c_char.from_buffer(out)) % 64
        out = out[shift:] if shift <= n - size else out
    done = 0
    step = PIECE // 4 * 4
    try:
        for i in range(0, n, step):
            piece = binascii.a2b_base64(text[i:i + step], strict_mode=True)
            out[done:done + len(piece)] = piece
            done += len(piece)
    except (binascii.Error, ValueError):
        raise TransportError(invalid) from None
    if done != size:
        refuse(invalid)
    return out[:size]


def decode_payload(data: bytes | bytearray | memoryview, load_format: str | None, *,
                   fd_timeout: float = FD_TIMEOUT, module: str = "transformer"
                   ) -> list[tuple[str, torch.Tensor]]:
    """Decode the bytes of one entry (see :func:`decode_named_tensors`): the tensors of
    ``module`` (a bare payload, or its part of a payload keyed by module). Tensors may be views
    of ``data`` when it is writable (they keep it alive; nothing else may write it): no copy of
    the payload. Others own their memory, or map the sender's (``file_descriptor`` sharing)."""
    return decode_modules(data, load_format, [module], fd_timeout=fd_timeout)[module]


def decode_modules(data: bytes | bytearray | memoryview, load_format: str | None,
                   modules: Sequence[str], *, fd_timeout: float = FD_TIMEOUT
                   ) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Decode the bytes of one entry into the tensors of each of ``modules``, as the
    reference resolves a payload: a pickled dict ``{module: payload}`` (every module of
    ``modules`` must be in it; others are ignored) or, when exactly one module is targeted, a
    bare payload. A payload is a list of ``(name, tensor)`` pairs, or a flattened bucket with
    ``load_format="flattened_bucket"``; a safetensors file is always a bare payload. A dict
    with exactly the keys ``flattened_tensor`` and ``metadata`` under ``flattened_bucket`` is a
    bare bucket (what older clients send), not a dict of modules."""
    check_load_format(load_format)
    view = memoryview(data).cast("B")
    if load_format == "safetensors" or (load_format is None and looks_like_safetensors(view)):
        return _bare(load_safetensors(view), modules)
    token = fd_timeout_var.set(fd_timeout)
    try:
        obj = unpickle(view)
    finally:
        fd_timeout_var.reset(token)
    materialize = unflatten if load_format == "flattened_bucket" else named_pairs
    if isinstance(obj, dict) and not (load_format == "flattened_bucket" and _is_bucket(obj)):
        return _by_module(obj, modules, materialize, load_format)
    if len(modules) == 1:
        return {modules[0]: materialize(obj)}
    raise PayloadModulesMismatch(
        "Ambiguous tensor payload for multi-module update. Provide a dict mapping module_name -> "
        f"module payload, requested modules: {list(modules)}.")


def _is_bucket(obj: dict[Any, Any]) -> bool:
    return set(obj) == {"flattened_tensor", "metadata"}


def _bare(named: list[tuple[str, torch.Tensor]], modules: Sequence[str]
          ) -> dict[str, list[tuple[str, torch.Tensor]]]:
    if len(modules) == 1:
        return {modules[0]: named}
    raise PayloadModulesMismatch(
        "Ambiguous tensor payload for multi-module update: a safetensors entry holds one "
        f"module's tensors; requested modules: {list(modules)}.")


def _by_module(obj: dict[Any, Any], modules: Sequence[str],
               materialize: Callable[[object], list[tuple[str, torch.Tensor]]],
               load_format: str | None) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """The payloads of ``modules`` in a pickled ``{module: payload}`` dict."""
    for key in obj:
        if type(key) is not str:
            refuse(f"the pickle holds a dict with a key of type {type(key).__name__}; expected "
                    "{module name: payload}")
    missing = [m for m in modules if m not in obj]
    if missing:
        keys = list(obj)
        shown = [k[:100] for k in keys[:_SHOWN_KEYS]]
        more = f" (and {len(keys) - _SHOWN_KEYS} more)" if len(keys) > _SHOWN_KEYS else ""
        hint = ""
        if _is_bucket(obj):
            hint = " (a flattened bucket needs load_format='flattened_bucket')"
        elif all(isinstance(v, TensorRef) for v in obj.values()):
            hint = " (a dict of tensors is not a payload: send a list of (name, tensor) pairs)"
        raise PayloadModulesMismatch(f"Missing tensor payload for module(s): {missing}. "
                                     f"Provided modules: {shown}{more}{hint}")
    out: dict[str, list[tuple[str, torch.Tensor]]] = {}
    for module in modules:
        try:
            out[module] = materialize(obj[module])
        except PayloadModulesMismatch:
            raise
        except TransportError as exc:
            raise TransportError(f"module {module[:100]!r} (load_format "
                                 f"{load_format or 'direct'}): {exc}") from None
    return out


_SHOWN_KEYS = 20
