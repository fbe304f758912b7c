"""Decoding ``POST /update_weights_from_tensor`` payloads: safetensors, or the reference's pickles.

The reference server (SGLang) takes ``serialized_named_tensors``: base64 of a pickle written by
torch's multiprocessing pickler (``ForkingPickler``; SGLang's ``MultiprocessingSerializer``). The
pickle does not carry tensor data: it carries *handles* to memory the sender shares on the same
host (a file descriptor passed over a Unix socket, a ``/dev/shm`` segment name, or a CUDA IPC
handle), plus either a list of ``(name, tensor)`` pairs (``load_format`` omitted or ``"direct"``)
or, for ``load_format="flattened_bucket"``, ``{"flattened_tensor": flat, "metadata": [...]}``
where each ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` names a slice of
``flat``. The newest diffusion clients key either kind by module, ``{"transformer": payload}``
(:func:`decode_modules` resolves it against ``target_modules`` as the reference does). No new
global is needed for that: the dict and its string keys are plain pickle opcodes.

Threat model
------------
The payload arrives over HTTP from whoever can reach the port. ``pickle.loads`` on such input runs
arbitrary code: a pickle may name any importable callable (``os.system``, ``builtins.eval``,
``subprocess.Popen``, ``torch.load``...) and call it. Here the pickle is read by an unpickler whose
``find_class`` answers only the names in ``ALLOWED_GLOBALS``; anything else is refused with
:class:`TransportError` before it is imported. Even the allowed names are not handed out as the
real objects: the pickle gets sealed stand-ins (no attributes can be set on them, no state can be
given to them, class tokens cannot be called), and each stand-in's call validates every argument
(types, ranges, handle and socket names) before calling torch's own rebuild function with torch's
own classes. What those calls return to the pickle is sealed too (storage and tensor references),
so the pickle can neither mutate torch's classes process-wide nor tamper with the objects it is
given; only the final validation unwraps the tensors.

Memory is bounded too: before the unpickler runs, every opcode is read once (:func:`_scan`): only
the opcodes torch's picklers write are admitted, memo indices may not skip ahead (one 6-byte
``LONG_BINPUT`` would otherwise make the unpickler zero a memo array of gigabytes), frames are
small, and the objects the pickle may build are costed against a budget of a constant plus a
small multiple of its size. Large byte strings are handed to the unpickler out of band (views of
the decoded payload, not copies). A storage is never larger than the bytes that carry it (or the
shared segment that holds it), and every tensor view must lie inside its storage.

Why each allowed global is safe (see ``ALLOWED_GLOBALS``):

- ``torch.multiprocessing.reductions.rebuild_tensor`` / ``rebuild_typed_storage`` /
  ``rebuild_storage_empty``: build a tensor view over a storage the pickle already rebuilt, wrap an
  untyped storage with a dtype, or make an empty storage. Offset, sizes and strides are checked
  here, before torch sees them: ``offset + sum((size_i - 1) * stride_i) + 1`` must not exceed the
  storage's elements (``Tensor.set_`` would silently *grow* a resizable storage, handing out
  uninitialised memory as weights), and a view may not have more elements than its storage.
- ``torch.multiprocessing.reductions.rebuild_storage_fd`` with ``multiprocessing.resource_sharer.DupFd``
  (``file_descriptor`` sharing): asks the sender's resource-sharer listener for a file descriptor and
  maps it. The listener address must be a multiprocessing listener socket path
  (``.../pymp-*/listener-*``), so a payload cannot make the server connect to arbitrary sockets (TCP
  or otherwise); the connection is authenticated with this process's multiprocessing authkey, every
  step of the handshake times out (``fd_timeout``, 5 s by default: a listener that accepts and never
  speaks costs a 400, not a thread), and the descriptor received must be a regular file holding the
  requested bytes (a shorter one would fault on access).
- ``torch.multiprocessing.reductions.rebuild_storage_filename`` (``file_system`` sharing): copies
  the bytes of a named shared-memory segment. The name must be torch's (``/torch_<...>``); the
  segment is opened read-only without following symlinks and must be a regular file in
  ``/dev/shm`` owned by this process's user, holding torch's 64-byte header plus the requested
  bytes. The segment is never written (torch's own rebuild would bump its reference count, and
  grow it when short) and torch's manager socket is never contacted (it stays the sender's). Every
  refusal has one message, so the answers cannot probe other users' segments. The price: the
  reference the sender took for this pickle is never given back, so a segment stays in
  ``/dev/shm`` until the sender (and its manager) exits.
- ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` and SGLang's UUID-aware
  ``_rebuild_cuda_tensor_modified`` (``sglang.srt.utils.patch_torch``, formerly
  ``sglang.srt.patch_torch``; clients that import SGLang emit it): open a CUDA IPC handle. The
  device may be an index or a device UUID; the reference-counter file must be torch's and its offset
  inside torch's counter file (``CUDA_IPC_REF_COUNTER_FILE_SIZE``); the view must lie inside the
  storage's declared bytes.
- ``torch._utils._rebuild_tensor_v2`` / ``_rebuild_parameter``, ``torch.storage._load_from_bytes``,
  ``collections.OrderedDict``: plain ``pickle.dumps`` of tensors (protocol 3 or later). torch's own
  ``_load_from_bytes`` is ``torch.load(weights_only=False)`` (arbitrary code); the stand-in never
  calls ``torch.load``: it reads torch's legacy storage format itself (what ``pickle.dumps`` of a
  tensor writes: five small pickles, then the storage's bytes), admitting only storage classes and
  one storage whose declared size is exactly the bytes that follow. Zip archives (compressed
  entries can declare gigabytes) and other formats are refused. Backward hooks must be empty (an
  ``OrderedDict()``, the only thing that may be built from that name).
- ``torch.Size``: a tuple of non-negative ints. ``torch.<dtype>`` (``torch.float32``...): immutable
  dtype objects. ``torch.Tensor``, ``torch.nn.parameter.Parameter``, ``torch.storage.UntypedStorage``,
  ``torch.storage.TypedStorage`` (the storage class CUDA pickles name): tokens that rebuild
  functions compare against; they cannot be called.
- ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata``: mapped to the local dataclass
  :class:`FlattenedTensorMetadata` (same six fields), whose state is validated; no SGLang import.

What the allow-list cannot remove: the pickle path trusts the *host*. Its handles point at memory
the sender shares on this machine, so fd-passed tensors alias the sender's memory (copy them
before the sender may reuse it), fd passing needs the sender alive and sharing this process's
multiprocessing authkey (a multiprocessing relative: unrelated processes fail authentication) and
works once per payload, ``file_system`` segments vanish when the sender exits, and a local user who
can create torch-named segments or multiprocessing sockets can feed them to the server. Serve the
pickle formats only to trusted, same-host trainers; safetensors is the recommended path.

Safetensors (recommended)
-------------------------
``load_format="safetensors"`` (or no ``load_format``: the bytes are sniffed) carries the data
itself and runs no code. The file is parsed here (8-byte header length, a JSON header of at most
8 MiB, then the tensors' bytes, which must tile the data area exactly); each tensor is a view of
the decoded payload where its alignment allows, else a copy made in pieces, so that other threads
keep running. A client::

    import base64
    import safetensors.torch

    payload = base64.b64encode(safetensors.torch.save(tensors)).decode()  # tensors: dict[str, Tensor]
    body = {"serialized_named_tensors": [payload], "load_format": "safetensors"}

(``safetensors.torch.save`` wants contiguous tensors that do not share memory: call
``.contiguous()`` / ``.clone()`` first where needed.)

Errors are :class:`TransportError` with a message naming what was wrong. No message carries payload
bytes (at most their length) and nothing here logs tensor contents.
"""

from __future__ import annotations

import binascii
import collections
import contextvars
import ctypes
import dataclasses
import io
import json
import math
import multiprocessing
import os
import pickle
import pickletools
import re
import socket
import stat
import struct
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from multiprocessing import connection as mp_connection
from multiprocessing import reduction as mp_reduction
from typing import Any, NoReturn

import torch
from torch.multiprocessing import reductions

__all__ = [
    "ALLOWED_GLOBALS",
    "FD_TIMEOUT",
    "LOAD_FORMATS",
    "FlattenedTensorMetadata",
    "PayloadModulesMismatch",
    "TransportError",
    "check_load_format",
    "decode_base64",
    "decode_modules",
    "decode_named_tensors",
    "decode_payload",
]

#: ``load_format`` values :func:`decode_named_tensors` accepts (``None``: sniffed).
LOAD_FORMATS: tuple[str | None, ...] = (None, "direct", "flattened_bucket", "safetensors")

#: Seconds each step of the fd-passing handshake may take by default.
FD_TIMEOUT = 5.0

_MAX_DIMS = 64
_MAX_INT = 2**62
# torch/csrc/CudaIPCTypes.h: each reference-counter file holds this many int64 counters.
_CUDA_IPC_REF_COUNTER_FILE_SIZE = 10000
# torch's refcounted shared-memory segments start with a header of this many bytes (the
# reference count), then the storage's bytes (aten MapAllocator's map_alloc_alignment).
_SHM_HEADER = 64
_SHM_HANDLE = re.compile(rb"/torch_[0-9A-Za-z_]+")
_SHM_MANAGER = re.compile(
    rb"/(?:[^/\x00]+/)*(?:torch-shm-dir-[^/\x00]+/manager\.sock|torch-shm-socket-[^/\x00]+)")
_LISTENER = re.compile(r"/(?:[^/\x00]+/)*pymp-[^/\x00]+/listener-[^/\x00]+")
# Copies and base64 decoding go in pieces of this size, so that the event loop's thread gets the
# GIL between them (a gigabyte in one C call would stall every request for seconds).
_PIECE = 4 * 2**20
# The bound on a safetensors header: the format allows 100 MB, but parsing JSON holds the GIL
# (a structure-heavy 100 MB header took 6.5 s here, the event loop stalled meanwhile); 8 MiB
# (about 80,000 tensors in one upload) stays under half a second.
_MAX_SAFETENSORS_HEADER = 8 * 2**20

_fd_timeout: contextvars.ContextVar[float] = contextvars.ContextVar("fd_timeout", default=FD_TIMEOUT)


class TransportError(ValueError):
    """A ``serialized_named_tensors`` entry could not be decoded; the message says why."""


def _refuse(message: str) -> NoReturn:
    raise TransportError(message)


# --------------------------------------------------------------------------------------------
# Sealed objects: what the pickle gets instead of real classes, functions, storages and tensors.
# --------------------------------------------------------------------------------------------


class _Sealed:
    """No attributes can be set and no pickle state given: ``BUILD`` on it is refused."""

    __slots__ = ()

    def _what(self) -> str:
        return type(self).__name__

    def __setattr__(self, name: str, value: object) -> NoReturn:
        _refuse(f"pickle tries to set attribute {name!r} on {self._what()}, which is not allowed")

    def __delattr__(self, name: str) -> NoReturn:
        _refuse(f"pickle tries to delete attribute {name!r} of {self._what()}, which is not allowed")

    def __setstate__(self, state: object) -> NoReturn:
        _refuse(f"pickle tries to set the state of {self._what()}, which is not allowed")

    def __reduce__(self) -> NoReturn:
        raise TypeError(f"{self._what()} cannot be pickled")


class _Global(_Sealed):
    """Stands in for one allowed global: a token (``call`` None) or a validating callable."""

    __slots__ = ("_call", "qualname")
    qualname: str
    _call: Callable[..., object] | None

    def __init__(self, qualname: str, call: Callable[..., object] | None = None) -> None:
        object.__setattr__(self, "qualname", qualname)
        object.__setattr__(self, "_call", call)

    def _what(self) -> str:
        return self.qualname

    def __call__(self, *args: object) -> object:
        if self._call is None:
            _refuse(f"pickle calls {self.qualname}, which may only be passed to a rebuild function")
        return self._call(*args)

    def __repr__(self) -> str:
        return f"<allowed {self.qualname}>"


class _StorageRef(_Sealed):
    """A storage a rebuild function made: untyped, or typed when ``dtype`` is set."""

    __slots__ = ("dtype", "untyped")
    untyped: torch.UntypedStorage
    dtype: torch.dtype | None

    def __init__(self, untyped: torch.UntypedStorage, dtype: torch.dtype | None) -> None:
        object.__setattr__(self, "untyped", untyped)
        object.__setattr__(self, "dtype", dtype)

    def _what(self) -> str:
        return "a rebuilt storage"

    def typed(self) -> torch.storage.TypedStorage:
        assert self.dtype is not None
        return torch.storage.TypedStorage(  # type: ignore[no-untyped-call]
            wrap_storage=self.untyped, dtype=self.dtype, _internal=True)


class _TensorRef(_Sealed):
    """A tensor a rebuild function made."""

    __slots__ = ("tensor",)
    tensor: torch.Tensor

    def __init__(self, tensor: torch.Tensor) -> None:
        object.__setattr__(self, "tensor", tensor)

    def _what(self) -> str:
        return "a rebuilt tensor"


# Tokens: compared by the rebuild functions, never called, never given to torch.
_TENSOR = _Global("torch.Tensor")
_PARAMETER = _Global("torch.nn.parameter.Parameter")
_UNTYPED_STORAGE = _Global("torch.storage.UntypedStorage")
_TYPED_STORAGE = _Global("torch.storage.TypedStorage")


# --------------------------------------------------------------------------------------------
# Argument checks.
# --------------------------------------------------------------------------------------------


def _arity(what: str, args: tuple[object, ...], *counts: int) -> None:
    if len(args) not in counts:
        expected = " or ".join(str(c) for c in counts)
        _refuse(f"pickle calls {what} with {len(args)} arguments; expected {expected}")


def _int(what: str, value: object) -> int:
    if type(value) is not int or not 0 <= value < _MAX_INT:
        _refuse(f"{what} must be a non-negative int, got {type(value).__name__}")
    return value


def _ints(what: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > _MAX_DIMS:
        _refuse(f"{what} must be a tuple of at most {_MAX_DIMS} ints, got {type(value).__name__}")
    return tuple(_int(f"{what}[{i}]", v) for i, v in enumerate(value))


def _bool(what: str, value: object) -> bool:
    if type(value) is not bool:
        _refuse(f"{what} must be a bool, got {type(value).__name__}")
    return value


def _dtype(what: str, value: object) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        _refuse(f"{what} must be a torch dtype, got {type(value).__name__}")
    return value


def _bytes(what: str, value: object, *, limit: int = 4096) -> bytes:
    if type(value) is not bytes or len(value) > limit:
        _refuse(f"{what} must be at most {limit} bytes, got {type(value).__name__}")
    return value


def _untyped(what: str, value: object) -> torch.UntypedStorage:
    if not isinstance(value, _StorageRef) or value.dtype is not None:
        _refuse(f"{what} must be an untyped storage rebuilt by this pickle, got {_kind(value)}")
    return value.untyped


def _typed(what: str, value: object) -> _StorageRef:
    if not isinstance(value, _StorageRef) or value.dtype is None:
        _refuse(f"{what} must be a typed storage rebuilt by this pickle, got {_kind(value)}")
    return value


def _tensor_class(what: str, value: object) -> None:
    if value is not _TENSOR and value is not _PARAMETER:
        _refuse(f"{what} must be torch.Tensor or torch.nn.Parameter, got {_kind(value)}")


def _storage_class(what: str, value: object) -> None:
    if value is not _UNTYPED_STORAGE:
        _refuse(f"{what} must be torch.storage.UntypedStorage, got {_kind(value)}")


def _empty_hooks(what: str, value: object) -> None:
    if type(value) is not collections.OrderedDict or value:
        _refuse(f"{what} must be an empty OrderedDict (backward hooks are not accepted)")


def _kind(value: object) -> str:
    if isinstance(value, _Sealed):
        return value._what()
    return type(value).__name__


def _torch_call(what: str, fn: Callable[..., Any], *args: Any, hint: str = "") -> Any:
    """Call torch; its failures become TransportError (its messages may quote handles: not kept)."""
    try:
        return fn(*args)
    except TransportError:
        raise
    except Exception as exc:
        raise TransportError(f"{what} failed ({type(exc).__name__}){hint}") from None


def _view(what: str, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
          storage_numel: int) -> None:
    """Refuse a view that reaches past its storage (torch would grow a resizable storage, or
    read past a mapped one) or that has more elements than its storage (an overlapping view,
    which any copy would multiply)."""
    if len(size) != len(stride):
        _refuse(f"{what}: size and stride have different lengths")
    numel = math.prod(size)
    if numel == 0:
        if offset > storage_numel:
            _refuse(f"{what}: offset {offset} is past the end of its storage of {storage_numel} "
                    "elements")
        return
    extent = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1
    if extent > storage_numel:
        _refuse(f"{what}: a view of size {size} and stride {stride} at offset {offset} reaches "
                f"element {extent}, past the end of its storage of {storage_numel} elements")
    if numel > storage_numel:
        _refuse(f"{what}: a view of {numel} elements over a storage of {storage_numel} "
                "(overlapping views are not accepted)")


def _elements(ref: _StorageRef) -> int:
    assert ref.dtype is not None
    return ref.untyped.nbytes() // ref.dtype.itemsize


# --------------------------------------------------------------------------------------------
# The rebuild functions the pickle may call.
# --------------------------------------------------------------------------------------------

_RT = "torch.multiprocessing.reductions.rebuild_tensor"


def _rebuild_tensor(*args: object) -> _TensorRef:
    _arity(_RT, args, 3)
    cls, storage, metadata = args
    _tensor_class(f"{_RT} argument 1", cls)
    ref = _typed(f"{_RT} argument 2", storage)
    if not isinstance(metadata, tuple) or len(metadata) != 4:
        _refuse(f"{_RT} argument 3 must be (offset, size, stride, requires_grad)")
    offset = _int(f"{_RT} offset", metadata[0])
    size = _ints(f"{_RT} size", metadata[1])
    stride = _ints(f"{_RT} stride", metadata[2])
    _bool(f"{_RT} requires_grad", metadata[3])
    _view(_RT, offset, size, stride, _elements(ref))
    # requires_grad is dropped: the server copies weights, it never differentiates through them.
    tensor = _torch_call(_RT, reductions.rebuild_tensor, torch.Tensor, ref.typed(),
                         (offset, size, stride, False))
    return _TensorRef(tensor)


def _rebuild_typed_storage(*args: object) -> _StorageRef:
    what = "torch.multiprocessing.reductions.rebuild_typed_storage"
    _arity(what, args, 2)
    untyped = _untyped(f"{what} argument 1", args[0])
    return _StorageRef(untyped, _dtype(f"{what} argument 2", args[1]))


def _rebuild_storage_empty(*args: object) -> _StorageRef:
    what = "torch.multiprocessing.reductions.rebuild_storage_empty"
    _arity(what, args, 1)
    _storage_class(f"{what} argument 1", args[0])
    # Empty and resizable: only views of no elements may use it (see _view).
    return _StorageRef(torch.UntypedStorage(), None)  # type: ignore[no-untyped-call]


class _DupFd:
    """Stands in for ``multiprocessing.resource_sharer.DupFd``: only its ``_id`` state, checked."""

    __slots__ = ("ident",)
    ident: tuple[str, int]

    def __init__(self, *args: object) -> NoReturn:
        _refuse("pickle calls multiprocessing.resource_sharer.DupFd, which is not allowed")

    def __setstate__(self, state: object) -> None:
        what = "multiprocessing.resource_sharer.DupFd state"
        if hasattr(self, "ident"):
            _refuse(f"{what} is set twice")
        if not isinstance(state, dict) or set(state) != {"_id"}:
            _refuse(f"{what} must be {{'_id': (address, key)}}")
        ident = state["_id"]
        if not isinstance(ident, tuple) or len(ident) != 2:
            _refuse(f"{what} must be {{'_id': (address, key)}}")
        address, key = ident
        if (type(address) is not str or len(address) > 4096 or not _LISTENER.fullmatch(address)
                or os.path.normpath(address) != address):
            _refuse(f"{what}: the address is not a multiprocessing listener socket path "
                    "(.../pymp-*/listener-*)")
        object.__setattr__(self, "ident", (address, _int(f"{what} key", key)))

    def __reduce__(self) -> NoReturn:
        raise TypeError("_DupFd cannot be pickled")


_FD = "torch.multiprocessing.reductions.rebuild_storage_fd"
_FD_HINT = (": file_descriptor sharing needs the sender alive, a payload decoded at most once, and "
            "the sender sharing this process's multiprocessing authkey (a multiprocessing relative); "
            "send safetensors instead")


class _FdFetch:
    """What ``reductions.rebuild_storage_fd`` calls ``detach()`` on: the resource sharer's
    handshake (``multiprocessing.resource_sharer.DupFd.detach``), with every step timed out,
    and a check that the descriptor received is a regular file holding ``nbytes``."""

    def __init__(self, ident: tuple[str, int], nbytes: int, timeout: float) -> None:
        self.ident, self.nbytes, self.timeout = ident, nbytes, timeout

    def detach(self) -> int:
        address, key = self.ident
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)  # the connect
            sock.connect(address)
            # Kernel-level timeouts: multiprocessing's Connection reads the raw descriptor.
            seconds = max(self.timeout, 0.001)
            timeval = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            sock.setblocking(True)
            conn = mp_connection.Connection(sock.detach())
        finally:
            sock.close()
        with conn:
            authkey = multiprocessing.current_process().authkey
            mp_connection.answer_challenge(conn, authkey)
            mp_connection.deliver_challenge(conn, authkey)
            conn.send((key, os.getpid()))
            fd: int = mp_reduction.recv_handle(conn)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < self.nbytes:
                _refuse(f"{_FD}: the descriptor received is not a regular file of at least "
                        f"{self.nbytes} bytes")
        except BaseException:
            os.close(fd)
            raise
        return fd


def _rebuild_storage_fd(*args: object) -> _StorageRef:
    _arity(_FD, args, 3)
    cls, df, size = args
    _storage_class(f"{_FD} argument 1", cls)
    if not isinstance(df, _DupFd) or not hasattr(df, "ident"):
        _refuse(f"{_FD} argument 2 must be a multiprocessing.resource_sharer.DupFd with its state")
    nbytes = _int(f"{_FD} size", size)
    fetch = _FdFetch(df.ident, nbytes, _fd_timeout.get())
    try:
        storage = reductions.rebuild_storage_fd(  # type: ignore[no-untyped-call]
            torch.UntypedStorage, fetch, nbytes)
    except TransportError:
        raise
    except (TimeoutError, BlockingIOError):
        raise TransportError(f"{_FD}: the sender's listener did not answer within "
                             f"{fetch.timeout:g} s{_FD_HINT}") from None
    except Exception as exc:
        raise TransportError(f"{_FD} failed ({type(exc).__name__}){_FD_HINT}") from None
    return _StorageRef(storage, None)


_FN = "torch.multiprocessing.reductions.rebuild_storage_filename"
_FN_REFUSED = (f"{_FN}: the shared-memory segment cannot be used; it must be a regular file in "
               "/dev/shm owned by this server's user and holding torch's 64-byte header plus the "
               "requested bytes (file_system sharing needs the sender alive on this host)")


def _rebuild_storage_filename(*args: object) -> _StorageRef:
    _arity(_FN, args, 4, 5)
    cls, manager, handle, size = args[:4]
    dtype = args[4] if len(args) == 5 else None
    _storage_class(f"{_FN} argument 1", cls)
    manager = _bytes(f"{_FN} manager", manager)
    if not _SHM_MANAGER.fullmatch(manager) or os.path.normpath(manager) != manager:
        _refuse(f"{_FN}: the manager is not torch's shared-memory manager socket")
    handle = _bytes(f"{_FN} handle", handle, limit=255)
    if not _SHM_HANDLE.fullmatch(handle):
        _refuse(f"{_FN}: the handle is not a torch shared-memory segment name (/torch_...)")
    checked_dtype = None if dtype is None else _dtype(f"{_FN} dtype", dtype)
    nbytes = _int(f"{_FN} size", size) * (1 if checked_dtype is None else checked_dtype.itemsize)
    # The manager socket is the sender's: it is never contacted (torch's rebuild would register
    # the segment with whatever socket the payload names, and keep that connection open).
    storage = _copy_segment(b"/dev/shm" + handle, nbytes)
    return _StorageRef(storage, checked_dtype)


def _copy_segment(path: bytes, nbytes: int) -> torch.UntypedStorage:
    """The ``nbytes`` after torch's header of the segment at ``path``, copied; read-only, so the
    segment (and its reference count) is never written. One message for every refusal."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError:
        raise TransportError(_FN_REFUSED) from None
    try:
        info = os.fstat(fd)
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid()
                or info.st_size < _SHM_HEADER + nbytes):
            _refuse(_FN_REFUSED)
        out = torch.empty(nbytes, dtype=torch.uint8)
        target = _writable(out)
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [target[done:done + _PIECE]], _SHM_HEADER + done)
            if got <= 0:
                _refuse(_FN_REFUSED)  # truncated under us
            done += got
    except OSError:
        raise TransportError(_FN_REFUSED) from None
    finally:
        os.close(fd)
    return out.untyped_storage()


def _cuda_device(what: str, device: object) -> int:
    """A device index, or (SGLang's patched reductions) a device UUID string."""
    if type(device) is int:
        return _int(what, device)
    if type(device) is not str or len(device) > 64:
        _refuse(f"{what} must be a device index or a device UUID string")
    if not torch.cuda.is_available():
        _refuse(f"{what}: the payload holds CUDA tensors but this process has no CUDA device")
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device:
            return index
    _refuse(f"{what} names a CUDA device UUID this process cannot see")


_CU = "torch.multiprocessing.reductions.rebuild_cuda_tensor"


def _rebuild_cuda_tensor(*args: object) -> _TensorRef:
    _arity(_CU, args, 15)
    (tensor_cls, size, stride, offset, storage_cls, dtype, device, storage_handle,
     storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle,
     ref_counter_offset, event_handle, event_sync_required) = args
    _tensor_class(f"{_CU} tensor class", tensor_cls)
    size_t = _ints(f"{_CU} size", size)
    stride_t = _ints(f"{_CU} stride", stride)
    if len(size_t) != len(stride_t):
        _refuse(f"{_CU}: size and stride have different lengths")
    # reduce_tensor sends type(tensor._typed_storage()): TypedStorage (torch 2.x).
    if storage_cls is not _TYPED_STORAGE and storage_cls is not _UNTYPED_STORAGE:
        _refuse(f"{_CU} storage class must be torch.storage.TypedStorage or UntypedStorage, got "
                f"{_kind(storage_cls)}")
    real_storage_cls = torch.storage.TypedStorage if storage_cls is _TYPED_STORAGE else torch.UntypedStorage
    if storage_handle is not None:
        _bytes(f"{_CU} storage handle", storage_handle)
    if event_handle is not None:
        _bytes(f"{_CU} event handle", event_handle)
    nbytes = _int(f"{_CU} storage size", storage_size_bytes)
    if storage_handle is None or nbytes == 0:
        counter = ref_counter_handle  # torch makes an empty storage and never opens the counter
        if counter is not None:
            _bytes(f"{_CU} ref-counter handle", counter, limit=255)
    elif not _SHM_HANDLE.fullmatch(_bytes(f"{_CU} ref-counter handle", ref_counter_handle, limit=255)):
        _refuse(f"{_CU}: the ref-counter handle is not a torch shared-memory segment name")
    else:
        counter = ref_counter_handle
    _bool(f"{_CU} requires_grad", requires_grad)  # dropped, as in rebuild_tensor
    if _int(f"{_CU} ref-counter offset", ref_counter_offset) >= _CUDA_IPC_REF_COUNTER_FILE_SIZE:
        _refuse(f"{_CU}: the ref-counter offset is outside torch's counter file")
    checked_dtype = _dtype(f"{_CU} dtype", dtype)
    checked_offset = _int(f"{_CU} offset", offset)
    _view(_CU, checked_offset, size_t, stride_t,
          nbytes // checked_dtype.itemsize if storage_handle is not None else 0)
    checked = (
        torch.Tensor, size_t, stride_t, checked_offset, real_storage_cls,
        checked_dtype, _cuda_device(f"{_CU} device", device), storage_handle,
        nbytes, _int(f"{_CU} storage offset", storage_offset_bytes),
        False, counter, ref_counter_offset,
        event_handle, _bool(f"{_CU} event_sync_required", event_sync_required),
    )
    return _TensorRef(_torch_call(_CU, reductions.rebuild_cuda_tensor, *checked,
                                  hint=": CUDA IPC needs the sender alive on this host"))


_V2 = "torch._utils._rebuild_tensor_v2"


def _rebuild_tensor_v2(*args: object) -> _TensorRef:
    _arity(_V2, args, 6, 7)
    storage, offset, size, stride, requires_grad, hooks = args[:6]
    metadata = args[6] if len(args) == 7 else None
    ref = _typed(f"{_V2} argument 1", storage)
    offset_i = _int(f"{_V2} offset", offset)
    size_t = _ints(f"{_V2} size", size)
    stride_t = _ints(f"{_V2} stride", stride)
    _bool(f"{_V2} requires_grad", requires_grad)
    _empty_hooks(f"{_V2} backward_hooks", hooks)
    if metadata is not None and (
        not isinstance(metadata, dict)
        or not all(type(k) is str and type(v) is bool for k, v in metadata.items())
    ):
        _refuse(f"{_V2} metadata must be a dict of flags")
    _view(_V2, offset_i, size_t, stride_t, _elements(ref))
    tensor = _torch_call(_V2, torch._utils._rebuild_tensor_v2, ref.typed(), offset_i,
                         size_t, stride_t, False, collections.OrderedDict(), metadata)
    return _TensorRef(tensor)


def _rebuild_parameter(*args: object) -> _TensorRef:
    what = "torch._utils._rebuild_parameter"
    _arity(what, args, 3)
    data, requires_grad, hooks = args
    if not isinstance(data, _TensorRef):
        _refuse(f"{what} argument 1 must be a tensor rebuilt by this pickle, got {_kind(data)}")
    _bool(f"{what} requires_grad", requires_grad)
    _empty_hooks(f"{what} backward_hooks", hooks)
    return data  # the server wants the values, not a Parameter


_LB = "torch.storage._load_from_bytes"


def _load_from_bytes(*args: object) -> _StorageRef:
    _arity(_LB, args, 1)
    raw = args[0]
    # A memoryview: a large byte string handed over out of band (see _unpickle).
    if type(raw) is not bytes and type(raw) is not memoryview:
        _refuse(f"{_LB} argument must be bytes, got {type(raw).__name__}")
    # torch's own _load_from_bytes is torch.load(weights_only=False): arbitrary code. Not here:
    # torch's legacy storage format, read by _legacy_storage, and nothing else.
    return _legacy_storage(memoryview(raw))


def _size(*args: object) -> torch.Size:
    _arity("torch.Size", args, 1)
    return torch.Size(_ints("torch.Size argument", args[0]))


def _ordered_dict(*args: object) -> collections.OrderedDict[object, object]:
    _arity("collections.OrderedDict", args, 0)
    return collections.OrderedDict()


# --------------------------------------------------------------------------------------------
# torch's legacy storage format: what ``pickle.dumps(tensor)`` carries inside _load_from_bytes.
# --------------------------------------------------------------------------------------------

# torch.serialization: MAGIC_NUMBER, PROTOCOL_VERSION.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001
_LEGACY_STORAGES: Mapping[str, torch.dtype] = {
    "torch.DoubleStorage": torch.float64, "torch.FloatStorage": torch.float32,
    "torch.HalfStorage": torch.float16, "torch.BFloat16Storage": torch.bfloat16,
    "torch.LongStorage": torch.int64, "torch.IntStorage": torch.int32,
    "torch.ShortStorage": torch.int16, "torch.CharStorage": torch.int8,
    "torch.ByteStorage": torch.uint8, "torch.BoolStorage": torch.bool,
    "torch.ComplexFloatStorage": torch.complex64, "torch.ComplexDoubleStorage": torch.complex128,
}
_LEGACY_UNTYPED = ("torch.storage.UntypedStorage", "torch.UntypedStorage")


@dataclasses.dataclass(frozen=True)
class _StorageType:
    name: str
    dtype: torch.dtype | None  # None: untyped


@dataclasses.dataclass(frozen=True)
class _StorageRecord:
    dtype: torch.dtype | None
    key: str
    numel: int


class _LegacyUnpickler(pickle.Unpickler):
    """One of the small pickles of torch's legacy format: storage classes and one storage id."""

    def __init__(self, file: io.BytesIO, records: list[_StorageRecord]) -> None:
        super().__init__(file)
        self.records = records

    def find_class(self, module_name: str, global_name: str, /) -> Any:
        qualname = f"{module_name}.{global_name}"
        if qualname in _LEGACY_STORAGES:
            return _StorageType(qualname, _LEGACY_STORAGES[qualname])
        if qualname in _LEGACY_UNTYPED:
            return _StorageType(qualname, None)
        _refuse(f"{_LB}: the storage refers to {qualname[:200]}, which is not allowed: only "
                "torch storage classes are")

    def persistent_load(self, pid: Any, /) -> _StorageRecord:
        what = f"{_LB}: the storage id"
        if (not isinstance(pid, tuple) or len(pid) not in (5, 6) or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or type(pid[2]) is not str
                or len(pid[2]) > 64 or type(pid[3]) is not str or len(pid[3]) > 64
                or (len(pid) == 6 and pid[5] is not None)):
            _refuse(f"{what} must be ('storage', storage class, key, location, numel)")
        if self.records:
            _refuse(f"{what} appears twice; one storage is expected")
        record = _StorageRecord(pid[1].dtype, pid[2], _int(f"{what}'s numel", pid[4]))
        self.records.append(record)
        return record


def _legacy_storage(raw: memoryview) -> _StorageRef:
    """The storage of torch's legacy format (``torch.save(storage,
    _use_new_zipfile_serialization=False)``, what ``TypedStorage.__reduce__`` writes): pickles of
    the magic number, the protocol version, the system info, the storage id, the list of keys;
    then the element count (8 bytes, little-endian) and the storage's bytes, to the end."""
    refused = (f"{_LB}: not torch's legacy storage format ({len(raw)} bytes; what pickle.dumps of "
               "a tensor writes); zip archives and other formats are refused")
    records: list[_StorageRecord] = []
    values: list[object] = []
    pos = 0
    for _ in range(5):
        try:
            end, _spans = _scan(raw, pos, legacy=True)
        except TransportError as exc:
            raise TransportError(f"{refused}: {exc}") from None
        try:
            values.append(_LegacyUnpickler(io.BytesIO(raw[pos:end]), records).load())
        except TransportError:
            raise
        except Exception:
            raise TransportError(refused) from None
        pos = end
    magic, protocol, sys_info, main, keys = values
    if (type(magic) is not int or magic != _LEGACY_MAGIC or protocol != _LEGACY_PROTOCOL
            or not isinstance(sys_info, dict)):
        _refuse(refused)
    if sys_info.get("little_endian") is not True:
        _refuse(f"{_LB}: the storage was written big-endian, which this server does not read")
    if not records or main is not records[0] or keys != [records[0].key]:
        _refuse(f"{_LB}: the pickle must hold exactly one storage")
    record = records[0]
    itemsize = 1 if record.dtype is None else record.dtype.itemsize
    nbytes = record.numel * itemsize
    if len(raw) - pos < 8 or int.from_bytes(raw[pos:pos + 8], "little") != record.numel:
        _refuse(f"{_LB}: the storage's element count does not match its id ({record.numel})")
    pos += 8
    if len(raw) - pos != nbytes:
        _refuse(f"{_LB}: the storage declares {nbytes} bytes but {len(raw) - pos} follow")
    return _StorageRef(_tensor_over(raw[pos:], record.dtype or torch.uint8, [nbytes // itemsize]
                                    ).untyped_storage(), record.dtype)


def _writable(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    n = tensor.nbytes
    if n == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(tensor.data_ptr())).cast("B")


def _tensor_over(data: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` holding ``data``: a view of it when it is writable
    and aligned for the dtype (no copy; the tensor keeps ``data`` alive), else a copy."""
    if len(data) and not data.readonly:
        flat = torch.frombuffer(data, dtype=torch.uint8)
        if flat.data_ptr() % dtype.itemsize == 0:
            return flat.view(dtype).reshape(shape)
    tensor = torch.empty(shape, dtype=dtype)
    _copy_into(tensor, data)
    return tensor


def _copy_into(tensor: torch.Tensor, src: memoryview) -> None:
    """Copy ``src`` into the (contiguous, CPU) ``tensor``'s bytes, in pieces."""
    target = _writable(tensor)
    assert len(target) == len(src)
    for i in range(0, len(src), _PIECE):
        target[i:i + _PIECE] = src[i:i + _PIECE]


# --------------------------------------------------------------------------------------------
# The opcode check: what a pickle may make the unpickler do, read before it runs.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Op:
    name: str
    fixed: int = 0      # bytes of a fixed-size argument
    counted: int = 0    # bytes of the little-endian length of a counted argument
    cost: int = 16      # bytes the unpickler may keep for it (plus a counted argument's length)


# Only what torch's and Python's picklers write for tensors, storages, handles, lists, dicts
# and tuples (protocols 2 to 5, binary opcodes): no text opcodes (protocol 0), no sets, no
# extension registry, no out-of-band buffers, no DUP, no NEWOBJ_EX / INST / OBJ, no persistent
# ids (but in torch's legacy storage pickles). Costs are generous estimates of what the
# unpickler allocates (object, stack slot, container slot).
_OPCODES: Mapping[int, _Op] = {
    0x80: _Op("PROTO", fixed=1, cost=0),
    0x95: _Op("FRAME", fixed=8, cost=0),
    ord("."): _Op("STOP", cost=0),
    ord("("): _Op("MARK"),
    ord("0"): _Op("POP", cost=0),
    ord("1"): _Op("POP_MARK", cost=0),
    ord("N"): _Op("NONE", cost=24),
    0x88: _Op("NEWTRUE", cost=24),
    0x89: _Op("NEWFALSE", cost=24),
    ord("J"): _Op("BININT", fixed=4, cost=48),
    ord("K"): _Op("BININT1", fixed=1, cost=48),
    ord("M"): _Op("BININT2", fixed=2, cost=48),
    0x8A: _Op("LONG1", counted=1, cost=64),
    0x8B: _Op("LONG4", counted=4, cost=64),
    ord("G"): _Op("BINFLOAT", fixed=8, cost=48),
    0x8C: _Op("SHORT_BINUNICODE", counted=1, cost=96),
    ord("X"): _Op("BINUNICODE", counted=4, cost=96),
    0x8D: _Op("BINUNICODE8", counted=8, cost=96),
    ord("C"): _Op("SHORT_BINBYTES", counted=1, cost=64),
    ord("B"): _Op("BINBYTES", counted=4, cost=64),
    0x8E: _Op("BINBYTES8", counted=8, cost=64),
    ord("]"): _Op("EMPTY_LIST", cost=96),
    ord("}"): _Op("EMPTY_DICT", cost=128),
    ord(")"): _Op("EMPTY_TUPLE", cost=24),
    ord("l"): _Op("LIST", cost=96),
    ord("d"): _Op("DICT", cost=128),
    ord("t"): _Op("TUPLE", cost=64),
    0x85: _Op("TUPLE1", cost=64),
    0x86: _Op("TUPLE2", cost=72),
    0x87: _Op("TUPLE3", cost=80),
    ord("a"): _Op("APPEND"),
    ord("e"): _Op("APPENDS"),
    ord("s"): _Op("SETITEM", cost=64),
    ord("u"): _Op("SETITEMS", cost=64),
    ord("q"): _Op("BINPUT", fixed=1),
    ord("r"): _Op("LONG_BINPUT", fixed=4),
    0x94: _Op("MEMOIZE"),
    ord("h"): _Op("BINGET", fixed=1, cost=32),
    ord("j"): _Op("LONG_BINGET", fixed=4, cost=32),
    ord("c"): _Op("GLOBAL", cost=128),
    0x93: _Op("STACK_GLOBAL", cost=128),
    ord("R"): _Op("REDUCE", cost=1024),
    ord("b"): _Op("BUILD", cost=256),
    0x81: _Op("NEWOBJ", cost=256),
    ord("Q"): _Op("BINPERSID", cost=256),  # legacy storage pickles only
}
_BYTES_OPS = frozenset({ord("C"), ord("B"), 0x8E})
_MAX_FRAME = 2**20
_MAX_OPS = 1_000_000
# A pickle may make the unpickler hold at most this, plus _COST_PER_BYTE times its size.
_COST_BASE = 32 * 2**20
_COST_PER_BYTE = 2
_LEGACY_MAX = 64 * 2**10  # each small pickle of the legacy storage format
# Byte strings at least this long (outside frames, which hold only small ones) are handed to
# the unpickler out of band: a view of the payload instead of a copy.
_OUT_OF_BAND = 64 * 2**10


def _scan(data: memoryview, start: int = 0, *, legacy: bool = False
          ) -> tuple[int, list[tuple[int, int, int]]]:
    """Read the pickle starting at ``start`` up to its STOP without running it; returns the
    offset after STOP and the large byte strings as ``(opcode offset, start, end)``. Raises
    :class:`TransportError` for an opcode that is not admitted, a memo index that skips ahead,
    a truncated argument, a large frame, or more objects than the budget allows."""
    end = len(data) if not legacy else min(len(data), start + _LEGACY_MAX)
    budget = _COST_BASE + _COST_PER_BYTE * (end - start) if not legacy else 2**20
    pos, cost, ops, memo, frame_end = start, 0, 0, 0, start
    large: list[tuple[int, int, int]] = []
    while True:
        if pos >= end:
            _refuse("the pickle ends before its STOP opcode" if end == len(data) else
                    f"a pickle of the legacy storage format is over {_LEGACY_MAX} bytes")
        code = data[pos]
        op = _OPCODES.get(code)
        if op is None or (op.name == "BINPERSID" and not legacy):
            name = _OPCODE_NAMES.get(code, "an unknown opcode")
            _refuse(f"the pickle uses {name} (0x{code:02x}) at byte {pos}, which is not allowed: "
                    "only the opcodes torch's picklers write are")
        ops += 1
        if ops > _MAX_OPS:
            _refuse(f"the pickle has more than {_MAX_OPS:,} opcodes")
        at = pos
        pos += 1
        arg = 0
        if op.fixed:
            if pos + op.fixed > end:
                _refuse(f"the pickle is truncated in {op.name} at byte {at}")
            arg = int.from_bytes(data[pos:pos + op.fixed], "little")
            pos += op.fixed
        elif op.counted:
            if pos + op.counted > end:
                _refuse(f"the pickle is truncated in {op.name} at byte {at}")
            arg = int.from_bytes(data[pos:pos + op.counted], "little")
            pos += op.counted
            if arg > end - pos:
                _refuse(f"{op.name} at byte {at} declares {arg} bytes, past the end of the pickle")
            if code in _BYTES_OPS and not legacy and arg >= _OUT_OF_BAND and pos >= frame_end:
                large.append((at, pos, pos + arg))  # a view, not a copy
            else:
                cost += arg
            pos += arg
        elif op.name == "GLOBAL":
            for _ in range(2):
                line = bytes(data[pos:min(pos + 257, end)])
                newline = line.find(b"\n")
                if newline < 0:
                    _refuse(f"GLOBAL at byte {at} has no name of at most 256 characters")
                pos += newline + 1
        cost += op.cost
        if cost > budget:
            _refuse(f"the pickle would make the unpickler hold over {budget // 2**20} MiB "
                    f"({ops:,} opcodes in {end - start:,} bytes); refused")
        if op.name == "STOP":
            return pos, large
        if op.name == "PROTO" and arg > pickle.HIGHEST_PROTOCOL:
            _refuse(f"the pickle's protocol {arg} is not supported")
        elif op.name == "FRAME":
            if arg > _MAX_FRAME or arg > end - pos:
                _refuse(f"the pickle has a frame of {arg} bytes; at most {_MAX_FRAME} inside it")
            frame_end = pos + arg
        elif op.name in ("BINPUT", "LONG_BINPUT"):
            # The unpickler makes room for index * 2 entries, zeroed: no skipping ahead.
            if arg > memo:
                _refuse(f"{op.name} at byte {at} stores memo entry {arg} after {memo} entries")
            memo += arg == memo
        elif op.name == "MEMOIZE":
            memo += 1


_OPCODE_NAMES = {ord(op.code): op.name for op in pickletools.opcodes}


# --------------------------------------------------------------------------------------------
# The flattened bucket's metadata: SGLang's dataclass, re-declared so no SGLang import is needed.
# --------------------------------------------------------------------------------------------

_META_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata``: one tensor's slice of a bucket.

    Same fields as the reference: ``flattened_tensor[start_idx:end_idx]`` holds the tensor
    ``name`` of ``shape`` and ``dtype``; ``numel`` is ``end_idx - start_idx`` (elements of the
    flat tensor: bytes when it is uint8, as the reference builds it today).
    """

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def __post_init__(self) -> None:
        self._check()

    def __setstate__(self, state: object) -> None:
        what = "FlattenedTensorMetadata state"
        if vars(self):
            _refuse(f"{what} is set twice")
        if not isinstance(state, dict) or set(state) != set(_META_FIELDS):
            _refuse(f"{what} must have exactly the fields {', '.join(_META_FIELDS)}")
        vars(self).update(state)
        self._check()

    def _check(self) -> None:
        what = "FlattenedTensorMetadata"
        if type(self.name) is not str:
            _refuse(f"{what}.name must be a str, got {type(self.name).__name__}")
        self.shape = torch.Size(_ints(f"{what}.shape", self.shape))
        _dtype(f"{what}.dtype", self.dtype)
        for field in ("start_idx", "end_idx", "numel"):
            _int(f"{what}.{field}", getattr(self, field))

    def __reduce__(self) -> NoReturn:
        raise TypeError("the local FlattenedTensorMetadata is not for pickling")


# --------------------------------------------------------------------------------------------
# The allow-list.
# --------------------------------------------------------------------------------------------

_REDUCTIONS = "torch.multiprocessing.reductions"

#: Every global a pickle may name, and what it gets instead of the real object.
ALLOWED_GLOBALS: Mapping[str, object] = {
    f"{_REDUCTIONS}.rebuild_tensor": _Global(f"{_REDUCTIONS}.rebuild_tensor", _rebuild_tensor),
    f"{_REDUCTIONS}.rebuild_typed_storage": _Global(f"{_REDUCTIONS}.rebuild_typed_storage",
                                                    _rebuild_typed_storage),
    f"{_REDUCTIONS}.rebuild_storage_empty": _Global(f"{_REDUCTIONS}.rebuild_storage_empty",
                                                    _rebuild_storage_empty),
    f"{_REDUCTIONS}.rebuild_storage_fd": _Global(f"{_REDUCTIONS}.rebuild_storage_fd", _rebuild_storage_fd),
    f"{_REDUCTIONS}.rebuild_storage_filename": _Global(f"{_REDUCTIONS}.rebuild_storage_filename",
                                                       _rebuild_storage_filename),
    f"{_REDUCTIONS}.rebuild_cuda_tensor": _Global(f"{_REDUCTIONS}.rebuild_cuda_tensor",
                                                  _rebuild_cuda_tensor),
    "sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified": _Global(
        "sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified", _rebuild_cuda_tensor),
    "sglang.srt.patch_torch._rebuild_cuda_tensor_modified": _Global(
        "sglang.srt.patch_torch._rebuild_cuda_tensor_modified", _rebuild_cuda_tensor),
    "multiprocessing.resource_sharer.DupFd": _DupFd,
    "torch._utils._rebuild_tensor_v2": _Global("torch._utils._rebuild_tensor_v2", _rebuild_tensor_v2),
    "torch._utils._rebuild_parameter": _Global("torch._utils._rebuild_parameter", _rebuild_parameter),
    "torch.storage._load_from_bytes": _Global("torch.storage._load_from_bytes", _load_from_bytes),
    "collections.OrderedDict": _Global("collections.OrderedDict", _ordered_dict),
    "torch.Size": _Global("torch.Size", _size),
    "torch.Tensor": _TENSOR,
    "torch.nn.parameter.Parameter": _PARAMETER,
    "torch.storage.UntypedStorage": _UNTYPED_STORAGE,
    "torch.storage.TypedStorage": _TYPED_STORAGE,
    "sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata": FlattenedTensorMetadata,
    # torch dtypes (torch.float32, torch.bfloat16, ...): immutable objects, added below.
}
_DTYPES = {name: obj for name, obj in vars(torch).items() if isinstance(obj, torch.dtype)}
ALLOWED_GLOBALS = types.MappingProxyType(
    {**ALLOWED_GLOBALS, **{f"torch.{name}": dt for name, dt in _DTYPES.items()}})


class _AllowListUnpickler(pickle.Unpickler):
    """Resolves only ``ALLOWED_GLOBALS``; refuses persistent ids; takes large byte strings out
    of band (``buffers``, in the order of their NEXT_BUFFER opcodes)."""

    def __init__(self, file: io.BytesIO, buffers: list[memoryview]) -> None:
        super().__init__(file, buffers=buffers)

    def find_class(self, module_name: str, global_name: str, /) -> Any:
        qualname = f"{module_name}.{global_name}"
        try:
            return ALLOWED_GLOBALS[qualname]
        except KeyError:
            pass
        _refuse(f"pickle refers to {qualname[:200]}, which is not allowed: only torch tensor and "
                "storage rebuild functions are")

    def persistent_load(self, pid: Any, /) -> NoReturn:
        _refuse("pickle uses a persistent id, which is not allowed")


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
        _refuse(f"load_format {shown} is not supported; accepted: 'safetensors', 'direct', "
                "'flattened_bucket', or none (safetensors or direct, sniffed)")


def decode_base64(payload: object) -> memoryview:
    """The bytes of a base64 entry (``str`` or ASCII bytes-like), decoded in pieces (the GIL is
    let go between them). A writable ``memoryview`` (the entry's place in the request body) is
    decoded in place, over its own text: no second buffer; anything else into a new one."""
    out: memoryview | None = None
    if isinstance(payload, str):
        if not payload.isascii():
            _refuse(f"not valid base64 ({len(payload)} characters)")
        text: memoryview | str = payload
    elif isinstance(payload, bytes | bytearray | memoryview):
        text = memoryview(payload).cast("B")
        if isinstance(payload, memoryview) and not text.readonly:
            out = text  # the decoded bytes never overtake the text still to be read
    else:
        _refuse(f"the entry must be a base64 string, got {type(payload).__name__}")
    n = len(text)
    if n == 0:
        _refuse("the entry is empty")
    invalid = f"not valid base64 ({n} characters)"
    if n % 4:
        _refuse(invalid)
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
    step = _PIECE // 4 * 4
    try:
        for i in range(0, n, step):
            piece = binascii.a2b_base64(text[i:i + step], strict_mode=True)
            out[done:done + len(piece)] = piece
            done += len(piece)
    except (binascii.Error, ValueError):
        raise TransportError(invalid) from None
    if done != size:
        _refuse(invalid)
    return out[:size]


def decode_payload(data: bytes | bytearray | memoryview, load_format: str | None, *,
                   fd_timeout: float = FD_TIMEOUT, module: str = "transformer"
                   ) -> list[tuple[str, torch.Tensor]]:
    """Decode the bytes of one entry (see :func:`decode_named_tensors`): the tensors of
    ``module`` (a bare payload, or its part of a payload keyed by module). Tensors may be views
    of ``data`` when it is writable (they keep it alive; nothing else may write it): no copy of
    the payload. Others own their memory, or map the sender's (``file_descriptor`` sharing)."""
    return decode_modules(data, load_format, [module], fd_timeout=fd_timeout)[module]


class PayloadModulesMismatch(TransportError):
    """The entry decoded, but its modules do not match ``target_modules`` (the reference's
    ``Missing tensor payload ...`` / ``Ambiguous tensor payload ...``)."""


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
    if load_format == "safetensors" or (load_format is None and _looks_like_safetensors(view)):
        return _bare(_load_safetensors(view), modules)
    token = _fd_timeout.set(fd_timeout)
    try:
        obj = _unpickle(view)
    finally:
        _fd_timeout.reset(token)
    materialize = _unflatten if load_format == "flattened_bucket" else _named_pairs
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
            _refuse(f"the pickle holds a dict with a key of type {type(key).__name__}; expected "
                    "{module name: payload}")
    missing = [m for m in modules if m not in obj]
    if missing:
        keys = list(obj)
        shown = [k[:100] for k in keys[:_SHOWN_KEYS]]
        more = f" (and {len(keys) - _SHOWN_KEYS} more)" if len(keys) > _SHOWN_KEYS else ""
        hint = ""
        if _is_bucket(obj):
            hint = " (a flattened bucket needs load_format='flattened_bucket')"
        elif all(isinstance(v, _TensorRef) for v in obj.values()):
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


# safetensors' dtype names (safetensors.torch._TYPES, the ones torch has).
_ST_DTYPES: Mapping[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _looks_like_safetensors(data: memoryview) -> bool:
    """Shaped like a safetensors file: 8-byte little-endian length N (at most
    :data:`_MAX_SAFETENSORS_HEADER`), then N bytes starting with ``{``, inside the data."""
    if len(data) < 10:
        return False
    n = int.from_bytes(data[:8], "little")
    return 2 <= n <= min(len(data) - 8, _MAX_SAFETENSORS_HEADER) and data[8] == ord("{")


def _load_safetensors(data: memoryview) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file, in the file's order, each copied once out of ``data``.

    Parsed here rather than by ``safetensors.torch.load``: that takes only ``bytes`` (one more
    copy of the payload), copies every tensor once more into a ``bytearray``, and holds the GIL
    throughout (a gigabyte stalls the event loop for seconds). The rules are the library's (known
    dtypes, ``data_offsets`` matching shape and dtype, the tensors tiling the data area exactly:
    no holes, no overlaps), but the JSON header may be at most 8 MiB, not 100 MB."""
    what = f"not a valid safetensors file ({len(data)} bytes)"
    if len(data) < 8:
        _refuse(f"{what}: shorter than its 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, _MAX_SAFETENSORS_HEADER):
        _refuse(f"{what}: its header length is past its end or over "
                f"{_MAX_SAFETENSORS_HEADER // 2**20} MiB")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except (ValueError, RecursionError):
        raise TransportError(f"{what}: the header is not JSON") from None
    if not isinstance(header, dict):
        _refuse(f"{what}: the header is not a JSON object")
    area = data[8 + n:]
    entries: list[tuple[int, int, str, torch.dtype, list[int]]] = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(type(v) is str for v in info.values()):
                _refuse(f"{what}: __metadata__ must map strings to strings")
            continue
        where = f"{what}: tensor {name[:100]!r}"
        if not isinstance(info, dict):
            _refuse(f"{where} has no dtype, shape and data_offsets")
        dtype_name = info.get("dtype")
        dtype = _ST_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            _refuse(f"{where} has dtype {str(dtype_name)[:20]!r}; accepted: "
                    f"{', '.join(_ST_DTYPES)}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if (not isinstance(shape, list) or len(shape) > _MAX_DIMS
                or not all(type(d) is int and 0 <= d < _MAX_INT for d in shape)):
            _refuse(f"{where} has a shape that is not a list of non-negative ints")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
            _refuse(f"{where} has data_offsets that are not [begin, end]")
        if math.prod(shape) * dtype.itemsize != offsets[1] - offsets[0]:
            _refuse(f"{where}: shape {shape} of {dtype} does not fill data_offsets {offsets}")
        entries.append((offsets[0], offsets[1], name, dtype, shape))
    entries.sort(key=lambda e: (e[0], e[1]))
    reached = 0
    for begin, end, name, _, _ in entries:
        if begin != reached:
            _refuse(f"{what}: the tensors' data has a hole or an overlap at byte {reached} "
                    f"(tensor {name[:100]!r})")
        reached = end
    if reached != len(area):
        _refuse(f"{what}: the tensors hold {reached} bytes but the data area has {len(area)}; "
                "the header or the data is truncated or inconsistent")
    if sys.byteorder != "little":  # every supported platform is little-endian
        _refuse("this server reads safetensors only on little-endian machines")
    return [(name, _tensor_over(area[begin:end], dtype, shape))
            for begin, end, name, dtype, shape in entries]


def _unpickle(data: memoryview) -> object:
    """Check the pickle's opcodes (:func:`_scan`), then unpickle it with the allow-list, its
    large byte strings given out of band (views of ``data``, not copies)."""
    what = f"neither a safetensors file nor a pickle this server can read ({len(data)} bytes"
    try:
        end, large = _scan(data)
    except TransportError as exc:
        raise TransportError(f"{what}: {exc})") from None
    if end != len(data):
        _refuse(f"{what}: {len(data) - end} bytes follow the pickle's STOP)")
    pieces: list[memoryview | bytes] = []
    buffers: list[memoryview] = []
    pos = 0
    for at, begin, stop in large:
        pieces += [data[pos:at], b"\x97"]  # NEXT_BUFFER
        buffers.append(data[begin:stop])
        pos = stop
    pieces.append(data[pos:])
    try:
        return _AllowListUnpickler(io.BytesIO(b"".join(pieces)), buffers).load()
    except TransportError:
        raise
    except RecursionError:
        raise TransportError(f"{what}; nested too deeply)") from None
    except Exception as exc:
        raise TransportError(f"{what}; {type(exc).__name__})") from None



def _plain_tensor(what: str, value: object) -> torch.Tensor:
    if not isinstance(value, _TensorRef):
        _refuse(f"{what} must be a tensor, got {_kind(value)}")
    return value.tensor


def _named_pairs(obj: object) -> list[tuple[str, torch.Tensor]]:
    expected = "expected a list of (name, tensor) pairs"
    if isinstance(obj, dict):
        _refuse(f"the pickle holds a dict; {expected} (a flattened bucket needs "
                "load_format='flattened_bucket')")
    if not isinstance(obj, list | tuple):
        _refuse(f"the pickle holds {_kind(obj)}; {expected}")
    out: list[tuple[str, torch.Tensor]] = []
    for i, item in enumerate(obj):
        if not isinstance(item, tuple | list) or len(item) != 2:
            _refuse(f"item {i} of the pickled list is {_kind(item)}; {expected}")
        name, value = item
        if type(name) is not str:
            _refuse(f"item {i} has a name of type {type(name).__name__}; {expected} with str names")
        out.append((name, _plain_tensor(f"item {i} ({name[:100]!r})", value)))
    return out


def _unflatten(obj: object) -> list[tuple[str, torch.Tensor]]:
    """Rebuild named tensors from ``{"flattened_tensor": flat, "metadata": [...]}`` as SGLang does.

    SGLang's ``FlattenedTensorBucket.reconstruct_tensors``:
    ``flat[start_idx:end_idx].view(dtype).reshape(shape)`` (today's buckets: flat is uint8, mixed
    dtypes); before that, ``flat[start_idx:end_idx].reshape(shape)`` then ``.to(dtype)`` if the
    dtypes differ (buckets of one dtype). Both are reproduced, after checking the offsets. The
    flat tensor must be contiguous (as ``torch.cat`` makes it): every piece is then a view, and
    the casts of the older format may allocate at most twice the flat tensor's bytes.
    """
    expected = "expected {'flattened_tensor': tensor, 'metadata': [FlattenedTensorMetadata, ...]}"
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        _refuse(f"the pickle holds {_kind(obj)}; {expected}")
    flat = _plain_tensor("flattened_tensor", obj["flattened_tensor"])
    metadata = obj["metadata"]
    if not isinstance(metadata, list | tuple):
        _refuse(f"metadata is {_kind(metadata)}; {expected}")
    if flat.dim() != 1:
        _refuse(f"flattened_tensor has {flat.dim()} dimensions; expected 1")
    if not flat.is_contiguous():
        _refuse("flattened_tensor must be contiguous (as torch.cat makes it)")
    total = flat.numel()
    cast_budget = 2 * flat.nbytes
    out: list[tuple[str, torch.Tensor]] = []
    for i, meta in enumerate(metadata):
        if not isinstance(meta, FlattenedTensorMetadata) or set(vars(meta)) != set(_META_FIELDS):
            _refuse(f"metadata[{i}] is {_kind(meta)} without its fields; {expected}")
        where = f"metadata[{i}] ({meta.name[:100]!r})"
        start, end = meta.start_idx, meta.end_idx
        if not start <= end <= total:
            _refuse(f"{where} spans [{start}, {end}), outside the flattened tensor's {total} elements")
        if meta.numel != end - start:
            _refuse(f"{where} has numel {meta.numel} but spans {end - start} elements")
        piece = flat[start:end]
        try:
            if piece.dtype == meta.dtype:
                tensor = piece.reshape(meta.shape)
            elif piece.dtype == torch.uint8:
                tensor = piece.view(meta.dtype).reshape(meta.shape)
            else:
                cast_budget -= (end - start) * meta.dtype.itemsize
                if cast_budget < 0:
                    _refuse(f"{where}: the bucket's casts would allocate more than twice the "
                            f"flattened tensor's {flat.nbytes} bytes")
                tensor = piece.reshape(meta.shape).to(meta.dtype)
        except RuntimeError:
            raise TransportError(f"{where}: {end - start} elements of {flat.dtype} do not make a "
                                 f"{meta.dtype} tensor of shape {tuple(meta.shape)}") from None
        out.append((meta.name, tensor))
    return out
