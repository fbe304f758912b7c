"""The restricted unpickler: the allow-list, and the rebuild functions of plain tensors.

Why each allowed global is safe (see :data:`ALLOWED_GLOBALS`):

- ``torch.multiprocessing.reductions.rebuild_tensor`` / ``rebuild_typed_storage`` /
  ``rebuild_storage_empty``: build a tensor view over a storage the pickle already rebuilt, wrap an
  untyped storage with a dtype, or make an empty storage. Offset, sizes and strides are checked
  before torch sees them (``lifecycle.payload._sealed.check_view``).
- ``rebuild_storage_fd`` (with ``multiprocessing.resource_sharer.DupFd``),
  ``rebuild_storage_filename``, ``rebuild_cuda_tensor`` and SGLang's
  ``_rebuild_cuda_tensor_modified``: shared memory by handle (``lifecycle.payload._handles``).
- ``torch._utils._rebuild_tensor_v2`` / ``_rebuild_parameter``, ``torch.storage._load_from_bytes``,
  ``collections.OrderedDict``: plain ``pickle.dumps`` of tensors (protocol 3 or later). The
  storage is read from torch's legacy format without ``torch.load``
  (``lifecycle.payload._legacy``). Backward hooks must be empty (an ``OrderedDict()``, the only
  thing that may be built from that name).
- ``torch.Size``: a tuple of non-negative ints. ``torch.<dtype>`` (``torch.float32``...): immutable
  dtype objects. ``torch.Tensor``, ``torch.nn.parameter.Parameter``, ``torch.storage.UntypedStorage``,
  ``torch.storage.TypedStorage`` (the storage class CUDA pickles name): tokens that rebuild
  functions compare against; they cannot be called.
- ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata``: the local dataclass
  (``lifecycle.payload._bucket``).

Before it runs, the pickle's opcodes are checked (``lifecycle.payload._prescan``).
"""

from __future__ import annotations

import collections
import io
import pickle
import types
from collections.abc import Mapping
from typing import Any, NoReturn

import torch
from torch.multiprocessing import reductions

from ._bucket import FlattenedTensorMetadata
from ._errors import TransportError, refuse
from ._handles import DupFd, rebuild_cuda_tensor, rebuild_storage_fd, rebuild_storage_filename
from ._legacy import load_from_bytes
from ._prescan import scan
from ._sealed import (
    PARAMETER,
    TENSOR,
    TYPED_STORAGE,
    UNTYPED_STORAGE,
    Global,
    StorageRef,
    TensorRef,
    check_arity,
    check_bool,
    check_dtype,
    check_empty_hooks,
    check_int,
    check_ints,
    check_storage_class,
    check_tensor_class,
    check_typed,
    check_untyped,
    check_view,
    elements,
    kind_of,
    plain_tensor,
    torch_call,
)

# --------------------------------------------------------------------------------------------
# The rebuild functions the pickle may call.
# --------------------------------------------------------------------------------------------

_RT = "torch.multiprocessing.reductions.rebuild_tensor"


def _rebuild_tensor(*args: object) -> TensorRef:
    check_arity(_RT, args, 3)
    cls, storage, metadata = args
    check_tensor_class(f"{_RT} argument 1", cls)
    ref = check_typed(f"{_RT} argument 2", storage)
    if not isinstance(metadata, tuple) or len(metadata) != 4:
        refuse(f"{_RT} argument 3 must be (offset, size, stride, requires_grad)")
    offset = check_int(f"{_RT} offset", metadata[0])
    size = check_ints(f"{_RT} size", metadata[1])
    stride = check_ints(f"{_RT} stride", metadata[2])
    check_bool(f"{_RT} requires_grad", metadata[3])
    check_view(_RT, offset, size, stride, elements(ref))
    # requires_grad is dropped: the server copies weights, it never differentiates through them.
    tensor = torch_call(_RT, reductions.rebuild_tensor, torch.Tensor, ref.typed(),
                         (offset, size, stride, False))
    return TensorRef(tensor)


def _rebuild_typed_storage(*args: object) -> StorageRef:
    what = "torch.multiprocessing.reductions.rebuild_typed_storage"
    check_arity(what, args, 2)
    untyped = check_untyped(f"{what} argument 1", args[0])
    return StorageRef(untyped, check_dtype(f"{what} argument 2", args[1]))


def _rebuild_storage_empty(*args: object) -> StorageRef:
    what = "torch.multiprocessing.reductions.rebuild_storage_empty"
    check_arity(what, args, 1)
    check_storage_class(f"{what} argument 1", args[0])
    # Empty and resizable: only views of no elements may use it (see check_view).
    return StorageRef(torch.UntypedStorage(), None)  # type: ignore[no-untyped-call]


_V2 = "torch._utils._rebuild_tensor_v2"


def _rebuild_tensor_v2(*args: object) -> TensorRef:
    check_arity(_V2, args, 6, 7)
    storage, offset, size, stride, requires_grad, hooks = args[:6]
    metadata = args[6] if len(args) == 7 else None
    ref = check_typed(f"{_V2} argument 1", storage)
    offset_i = check_int(f"{_V2} offset", offset)
    size_t = check_ints(f"{_V2} size", size)
    stride_t = check_ints(f"{_V2} stride", stride)
    check_bool(f"{_V2} requires_grad", requires_grad)
    check_empty_hooks(f"{_V2} backward_hooks", hooks)
    if metadata is not None and (
        not isinstance(metadata, dict)
        or not all(type(k) is str and type(v) is bool for k, v in metadata.items())
    ):
        refuse(f"{_V2} metadata must be a dict of flags")
    check_view(_V2, offset_i, size_t, stride_t, elements(ref))
    tensor = torch_call(_V2, torch._utils._rebuild_tensor_v2, ref.typed(), offset_i,
                         size_t, stride_t, False, collections.OrderedDict(), metadata)
    return TensorRef(tensor)


def _rebuild_parameter(*args: object) -> TensorRef:
    what = "torch._utils._rebuild_parameter"
    check_arity(what, args, 3)
    data, requires_grad, hooks = args
    if not isinstance(data, TensorRef):
        refuse(f"{what} argument 1 must be a tensor rebuilt by this pickle, got {kind_of(data)}")
    check_bool(f"{what} requires_grad", requires_grad)
    check_empty_hooks(f"{what} backward_hooks", hooks)
    return data  # the server wants the values, not a Parameter


def _size(*args: object) -> torch.Size:
    check_arity("torch.Size", args, 1)
    return torch.Size(check_ints("torch.Size argument", args[0]))


def _ordered_dict(*args: object) -> collections.OrderedDict[object, object]:
    check_arity("collections.OrderedDict", args, 0)
    return collections.OrderedDict()


# --------------------------------------------------------------------------------------------
# The allow-list.
# --------------------------------------------------------------------------------------------

_REDUCTIONS = "torch.multiprocessing.reductions"

#: Every global a pickle may name, and what it gets instead of the real object.
ALLOWED_GLOBALS: Mapping[str, object] = {
    f"{_REDUCTIONS}.rebuild_tensor": Global(f"{_REDUCTIONS}.rebuild_tensor", _rebuild_tensor),
    f"{_REDUCTIONS}.rebuild_typed_storage": Global(f"{_REDUCTIONS}.rebuild_typed_storage",
                                                    _rebuild_typed_storage),
    f"{_REDUCTIONS}.rebuild_storage_empty": Global(f"{_REDUCTIONS}.rebuild_storage_empty",
                                                    _rebuild_storage_empty),
    f"{_REDUCTIONS}.rebuild_storage_fd": Global(f"{_REDUCTIONS}.rebuild_storage_fd", rebuild_storage_fd),
    f"{_REDUCTIONS}.rebuild_storage_filename": Global(f"{_REDUCTIONS}.rebuild_storage_filename",
                                                       rebuild_storage_filename),
    f"{_REDUCTIONS}.rebuild_cuda_tensor": Global(f"{_REDUCTIONS}.rebuild_cuda_tensor",
                                                  rebuild_cuda_tensor),
    "sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified": Global(
        "sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified", rebuild_cuda_tensor),
    "sglang.srt.patch_torch._rebuild_cuda_tensor_modified": Global(
        "sglang.srt.patch_torch._rebuild_cuda_tensor_modified", rebuild_cuda_tensor),
    "multiprocessing.resource_sharer.DupFd": DupFd,
    "torch._utils._rebuild_tensor_v2": Global("torch._utils._rebuild_tensor_v2", _rebuild_tensor_v2),
    "torch._utils._rebuild_parameter": Global("torch._utils._rebuild_parameter", _rebuild_parameter),
    "torch.storage._load_from_bytes": Global("torch.storage._load_from_bytes", load_from_bytes),
    "collections.OrderedDict": Global("collections.OrderedDict", _ordered_dict),
    "torch.Size": Global("torch.Size", _size),
    "torch.Tensor": TENSOR,
    "torch.nn.parameter.Parameter": PARAMETER,
    "torch.storage.UntypedStorage": UNTYPED_STORAGE,
    "torch.storage.TypedStorage": TYPED_STORAGE,
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
        refuse(f"pickle refers to {qualname[:200]}, which is not allowed: only torch tensor and "
                "storage rebuild functions are")

    def persistent_load(self, pid: Any, /) -> NoReturn:
        refuse("pickle uses a persistent id, which is not allowed")


def unpickle(data: memoryview) -> object:
    """Check the pickle's opcodes (:func:`scan`), then unpickle it with the allow-list, its
    large byte strings given out of band (views of ``data``, not copies)."""
    what = f"neither a safetensors file nor a pickle this server can read ({len(data)} bytes"
    try:
        end, large = scan(data)
    except TransportError as exc:
        raise TransportError(f"{what}: {exc})") from None
    if end != len(data):
        refuse(f"{what}: {len(data) - end} bytes follow the pickle's STOP)")
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


def named_pairs(obj: object) -> list[tuple[str, torch.Tensor]]:
    expected = "expected a list of (name, tensor) pairs"
    if isinstance(obj, dict):
        refuse(f"the pickle holds a dict; {expected} (a flattened bucket needs "
                "load_format='flattened_bucket')")
    if not isinstance(obj, list | tuple):
        refuse(f"the pickle holds {kind_of(obj)}; {expected}")
    out: list[tuple[str, torch.Tensor]] = []
    for i, item in enumerate(obj):
        if not isinstance(item, tuple | list) or len(item) != 2:
            refuse(f"item {i} of the pickled list is {kind_of(item)}; {expected}")
        name, value = item
        if type(name) is not str:
            refuse(f"item {i} has a name of type {type(name).__name__}; {expected} with str names")
        out.append((name, plain_tensor(f"item {i} ({name[:100]!r})", value)))
    return out
