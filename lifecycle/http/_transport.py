"""Decoding ``POST /update_weights_from_tensor`` payloads: safetensors, or the reference's pickles.

The reference server (SGLang) takes ``serialized_named_tensors``: base64 of a pickle written by
torch's multiprocessing pickler (``ForkingPickler``; SGLang's ``MultiprocessingSerializer``). The
pickle does not carry tensor data: it carries *handles* to memory the sender shares on the same
host (a file descriptor passed over a Unix socket, a ``/dev/shm`` segment name, or a CUDA IPC
handle), plus either a list of ``(name, tensor)`` pairs (``load_format`` omitted or ``"direct"``)
or, for ``load_format="flattened_bucket"``, ``{"flattened_tensor": flat, "metadata": [...]}``
where each ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` names a slice of
``flat``.

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

Why each allowed global is safe (see ``ALLOWED_GLOBALS``):

- ``torch.multiprocessing.reductions.rebuild_tensor`` / ``rebuild_typed_storage`` /
  ``rebuild_storage_empty``: build a tensor view over a storage the pickle already rebuilt, wrap an
  untyped storage with a dtype, or make an empty storage. Offsets, sizes and strides are checked to
  be non-negative ints; ``Tensor.set_`` checks them against the storage's size.
- ``torch.multiprocessing.reductions.rebuild_storage_fd`` with ``multiprocessing.resource_sharer.DupFd``
  (``file_descriptor`` sharing): asks the sender's resource-sharer listener for a file descriptor and
  maps it. The listener address must be a multiprocessing listener socket path
  (``.../pymp-*/listener-*``), so a payload cannot make the server connect to arbitrary sockets (TCP
  or otherwise), and the connection is authenticated with this process's multiprocessing authkey.
- ``torch.multiprocessing.reductions.rebuild_storage_filename`` (``file_system`` sharing): maps a
  named shared-memory segment. The name must be torch's (``/torch_<digits>_...``), the manager
  socket torch's (``.../torch-shm-dir-*/manager.sock``), and the requested size must not exceed the
  segment's (torch would otherwise grow the segment).
- ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` and SGLang's UUID-aware
  ``_rebuild_cuda_tensor_modified`` (``sglang.srt.utils.patch_torch``, formerly
  ``sglang.srt.patch_torch``; clients that import SGLang emit it): open a CUDA IPC handle. The
  device may be an index or a device UUID; the reference-counter file must be torch's and its offset
  inside torch's counter file (``CUDA_IPC_REF_COUNTER_FILE_SIZE``).
- ``torch._utils._rebuild_tensor_v2`` / ``_rebuild_parameter``, ``torch.storage._load_from_bytes``,
  ``collections.OrderedDict``: plain ``pickle.dumps`` of tensors. torch's own
  ``_load_from_bytes`` is ``torch.load(weights_only=False)`` (arbitrary code); the stand-in calls
  ``torch.load(weights_only=True, map_location="cpu")`` and accepts only a storage back. Backward
  hooks must be empty (an ``OrderedDict()``, the only thing that may be built from that name).
- ``torch.Size``: a tuple of non-negative ints. ``torch.<dtype>`` (``torch.float32``...): immutable
  dtype objects. ``torch.Tensor``, ``torch.nn.parameter.Parameter``, ``torch.storage.UntypedStorage``,
  ``torch.storage.TypedStorage`` (the storage class CUDA pickles name): tokens that rebuild
  functions compare against; they cannot be called.
- ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata``: mapped to the local dataclass
  :class:`FlattenedTensorMetadata` (same six fields), whose state is validated; no SGLang import.

What the allow-list cannot remove: the pickle path trusts the *host*. Its handles point at memory
the sender shares on this machine, so the tensors returned alias the sender's memory (copy them
before the sender may reuse it), fd passing needs the sender alive and sharing this process's
multiprocessing authkey (a multiprocessing relative: unrelated processes fail authentication) and
works once per payload, ``file_system`` segments vanish when the sender exits, and a local user who
can create torch-named segments or multiprocessing sockets can feed them to the server. Serve the
pickle formats only to trusted, same-host trainers; safetensors is the recommended path.

Safetensors (recommended)
-------------------------
``load_format="safetensors"`` (or no ``load_format``: the bytes are sniffed) carries the data
itself and runs no code. A client::

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

import base64
import binascii
import collections
import dataclasses
import io
import json
import os
import pickle
import re
import types
from collections.abc import Callable, Mapping
from multiprocessing import resource_sharer
from typing import Any, NoReturn

import safetensors.torch
import torch
from torch.multiprocessing import reductions

__all__ = [
    "ALLOWED_GLOBALS",
    "LOAD_FORMATS",
    "FlattenedTensorMetadata",
    "TransportError",
    "decode_named_tensors",
]

#: ``load_format`` values :func:`decode_named_tensors` accepts (``None``: sniffed).
LOAD_FORMATS: tuple[str | None, ...] = (None, "direct", "flattened_bucket", "safetensors")

_MAX_DIMS = 64
_MAX_INT = 2**62
# torch/csrc/CudaIPCTypes.h: each reference-counter file holds this many int64 counters.
_CUDA_IPC_REF_COUNTER_FILE_SIZE = 10000
_SHM_HANDLE = re.compile(rb"/torch_[0-9A-Za-z_]+")
_SHM_MANAGER = re.compile(
    rb"/(?:[^/\x00]+/)*(?:torch-shm-dir-[^/\x00]+/manager\.sock|torch-shm-socket-[^/\x00]+)")
_LISTENER = re.compile(r"/(?:[^/\x00]+/)*pymp-[^/\x00]+/listener-[^/\x00]+")


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
    if len(stride) != len(size):
        _refuse(f"{_RT}: size and stride have different lengths")
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
            "send safetensors or use the file_system strategy instead")


def _rebuild_storage_fd(*args: object) -> _StorageRef:
    _arity(_FD, args, 3)
    cls, df, size = args
    _storage_class(f"{_FD} argument 1", cls)
    if not isinstance(df, _DupFd) or not hasattr(df, "ident"):
        _refuse(f"{_FD} argument 2 must be a multiprocessing.resource_sharer.DupFd with its state")
    _int(f"{_FD} size", size)
    real = object.__new__(resource_sharer.DupFd)
    object.__setattr__(real, "_id", df.ident)  # what DupFd.detach() reads: (address, key)
    storage = _torch_call(_FD, reductions.rebuild_storage_fd, torch.UntypedStorage, real, size,
                          hint=_FD_HINT)
    return _StorageRef(storage, None)


_FN = "torch.multiprocessing.reductions.rebuild_storage_filename"
_FN_HINT = ": file_system sharing needs the sender alive on this host"


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
    nbytes = _int(f"{_FN} size", size)
    if dtype is not None:
        nbytes *= _dtype(f"{_FN} dtype", dtype).itemsize
    segment = b"/dev/shm" + handle
    if os.path.isdir("/dev/shm"):
        try:
            available = os.stat(segment).st_size
        except OSError:
            raise TransportError(f"{_FN}: the shared-memory segment does not exist{_FN_HINT}") from None
        if nbytes > available:
            _refuse(f"{_FN}: asks for {nbytes} bytes of a {available}-byte shared-memory segment")
    storage = _torch_call(_FN, reductions.rebuild_storage_filename, torch.UntypedStorage, manager,
                          handle, size, dtype, hint=_FN_HINT)
    if isinstance(storage, torch.storage.TypedStorage):
        return _StorageRef(storage._untyped_storage, storage.dtype)
    return _StorageRef(storage, None)


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
    checked = (
        torch.Tensor, size_t, stride_t, _int(f"{_CU} offset", offset), real_storage_cls,
        _dtype(f"{_CU} dtype", dtype), _cuda_device(f"{_CU} device", device), storage_handle,
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
    size_t = _ints(f"{_V2} size", size)
    stride_t = _ints(f"{_V2} stride", stride)
    if len(size_t) != len(stride_t):
        _refuse(f"{_V2}: size and stride have different lengths")
    _bool(f"{_V2} requires_grad", requires_grad)
    _empty_hooks(f"{_V2} backward_hooks", hooks)
    if metadata is not None and (
        not isinstance(metadata, dict)
        or not all(type(k) is str and type(v) is bool for k, v in metadata.items())
    ):
        _refuse(f"{_V2} metadata must be a dict of flags")
    tensor = _torch_call(_V2, torch._utils._rebuild_tensor_v2, ref.typed(), _int(f"{_V2} offset", offset),
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


def _load_from_bytes(*args: object) -> _StorageRef:
    what = "torch.storage._load_from_bytes"
    _arity(what, args, 1)
    raw = args[0]
    if type(raw) is not bytes:
        _refuse(f"{what} argument must be bytes, got {type(raw).__name__}")
    # torch's own _load_from_bytes is torch.load(weights_only=False): arbitrary code. Not here.
    loaded = _torch_call(what, lambda: torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu"))
    if type(loaded) is torch.storage.TypedStorage:
        return _StorageRef(loaded._untyped_storage, loaded.dtype)
    if type(loaded) is torch.UntypedStorage:
        return _StorageRef(loaded, None)
    _refuse(f"{what} did not hold a storage (got {type(loaded).__name__})")


def _size(*args: object) -> torch.Size:
    _arity("torch.Size", args, 1)
    return torch.Size(_ints("torch.Size argument", args[0]))


def _ordered_dict(*args: object) -> collections.OrderedDict[object, object]:
    _arity("collections.OrderedDict", args, 0)
    return collections.OrderedDict()


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
    """Resolves only ``ALLOWED_GLOBALS``; refuses persistent ids."""

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


def decode_named_tensors(payload: str, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """Decode one ``serialized_named_tensors`` entry into ``(name, tensor)`` pairs.

    ``load_format``: ``"safetensors"``; ``"direct"`` (a pickled list of pairs);
    ``"flattened_bucket"`` (a pickled bucket); ``None`` (safetensors if the bytes are a
    safetensors file, else ``"direct"``). Raises :class:`TransportError`.
    """
    if load_format not in LOAD_FORMATS:
        shown = repr(load_format)[:60] if isinstance(load_format, str) else type(load_format).__name__
        _refuse(f"load_format {shown} is not supported; accepted: 'safetensors', 'direct', "
                "'flattened_bucket', or none (safetensors or direct, sniffed)")
    data = _b64decode(payload)
    if load_format == "safetensors" or (load_format is None and _looks_like_safetensors(data)):
        return _load_safetensors(data)
    obj = _unpickle(data)
    if load_format == "flattened_bucket":
        return _unflatten(obj)
    return _named_pairs(obj)


def _b64decode(payload: object) -> bytes:
    if not isinstance(payload, str):
        _refuse(f"the entry must be a base64 string, got {type(payload).__name__}")
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise TransportError(f"not valid base64 ({len(payload)} characters)") from None
    if not data:
        _refuse("the entry is empty")
    return data


def _safetensors_header(data: bytes) -> dict[str, Any] | None:
    """The header if the data is shaped like a safetensors file: 8-byte little-endian length N,
    then N bytes of a JSON object, inside the data; else None."""
    if len(data) < 10:
        return None
    n = int.from_bytes(data[:8], "little")
    if not 2 <= n <= len(data) - 8:
        return None
    header = data[8:8 + n]
    if header.lstrip()[:1] != b"{":
        return None
    try:
        parsed = json.loads(header)
    except ValueError:
        return None
    return parsed if isinstance(parsed, dict) else None


def _looks_like_safetensors(data: bytes) -> bool:
    return _safetensors_header(data) is not None


def _load_safetensors(data: bytes) -> list[tuple[str, torch.Tensor]]:
    try:
        tensors = safetensors.torch.load(data)
    except Exception as exc:
        raise TransportError(f"not a valid safetensors file ({len(data)} bytes; {type(exc).__name__}): "
                             "the header or the data is truncated or inconsistent") from None
    # safetensors.torch.load's dict order is arbitrary (0.8: a hash map): return the file's order,
    # the order of the tensors' data.
    header = _safetensors_header(data) or {}

    def position(name: str) -> int:
        entry = header.get(name)
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        return offsets[0] if isinstance(offsets, list) and offsets and type(offsets[0]) is int else 0

    order = {name: (position(name), i) for i, name in enumerate(header)}
    return sorted(tensors.items(), key=lambda item: order.get(item[0], (0, len(order))))


def _unpickle(data: bytes) -> object:
    try:
        return _AllowListUnpickler(io.BytesIO(data)).load()
    except TransportError:
        raise
    except Exception as exc:
        raise TransportError(f"neither a safetensors file nor a pickle this server can read "
                             f"({len(data)} bytes; {type(exc).__name__})") from None


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
    dtypes differ (buckets of one dtype). Both are reproduced, after checking the offsets.
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
    total = flat.numel()
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
                tensor = piece.reshape(meta.shape).to(meta.dtype)
        except RuntimeError:
            raise TransportError(f"{where}: {end - start} elements of {flat.dtype} do not make a "
                                 f"{meta.dtype} tensor of shape {tuple(meta.shape)}") from None
        out.append((meta.name, tensor))
    return out
