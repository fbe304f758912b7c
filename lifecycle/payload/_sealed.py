"""Sealed objects: what the pickle gets instead of real classes, functions, storages and
tensors; and the argument checks every rebuild function makes before torch sees them.

No attribute can be set on a sealed object and no pickle state given to it (``BUILD`` is
refused); class tokens (``torch.Tensor``...) are compared by the rebuild functions, never
called, never given to torch. A view is checked against its storage (:func:`check_view`):
``offset + sum((size_i - 1) * stride_i) + 1`` may not exceed the storage's elements
(``Tensor.set_`` would silently *grow* a resizable storage, handing out uninitialised memory
as weights), and a view may not have more elements than its storage. torch's own failures
become :class:`~lifecycle.payload.TransportError` without their messages (they may quote
handles).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from typing import Any, NoReturn

import torch

from ._errors import TransportError, refuse

MAX_DIMS = 64
MAX_INT = 2**62


# --------------------------------------------------------------------------------------------
# Sealed objects: what the pickle gets instead of real classes, functions, storages and tensors.
# --------------------------------------------------------------------------------------------


class _Sealed:
    """No attributes can be set and no pickle state given: ``BUILD`` on it is refused."""

    __slots__ = ()

    def _what(self) -> str:
        return type(self).__name__

    def __setattr__(self, name: str, value: object) -> NoReturn:
        refuse(f"pickle tries to set attribute {name!r} on {self._what()}, which is not allowed")

    def __delattr__(self, name: str) -> NoReturn:
        refuse(f"pickle tries to delete attribute {name!r} of {self._what()}, which is not allowed")

    def __setstate__(self, state: object) -> NoReturn:
        refuse(f"pickle tries to set the state of {self._what()}, which is not allowed")

    def __reduce__(self) -> NoReturn:
        raise TypeError(f"{self._what()} cannot be pickled")


class Global(_Sealed):
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
            refuse(f"pickle calls {self.qualname}, which may only be passed to a rebuild function")
        return self._call(*args)

    def __repr__(self) -> str:
        return f"<allowed {self.qualname}>"


class StorageRef(_Sealed):
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


class TensorRef(_Sealed):
    """A tensor a rebuild function made."""

    __slots__ = ("tensor",)
    tensor: torch.Tensor

    def __init__(self, tensor: torch.Tensor) -> None:
        object.__setattr__(self, "tensor", tensor)

    def _what(self) -> str:
        return "a rebuilt tensor"


# Tokens: compared by the rebuild functions, never called, never given to torch.
TENSOR = Global("torch.Tensor")
PARAMETER = Global("torch.nn.parameter.Parameter")
UNTYPED_STORAGE = Global("torch.storage.UntypedStorage")
TYPED_STORAGE = Global("torch.storage.TypedStorage")


# --------------------------------------------------------------------------------------------
# Argument checks.
# --------------------------------------------------------------------------------------------


def check_arity(what: str, args: tuple[object, ...], *counts: int) -> None:
    if len(args) not in counts:
        expected = " or ".join(str(c) for c in counts)
        refuse(f"pickle calls {what} with {len(args)} arguments; expected {expected}")


def check_int(what: str, value: object) -> int:
    if type(value) is not int or not 0 <= value < MAX_INT:
        refuse(f"{what} must be a non-negative int, got {type(value).__name__}")
    return value


def check_ints(what: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or len(value) > MAX_DIMS:
        refuse(f"{what} must be a tuple of at most {MAX_DIMS} ints, got {type(value).__name__}")
    return tuple(check_int(f"{what}[{i}]", v) for i, v in enumerate(value))


def check_bool(what: str, value: object) -> bool:
    if type(value) is not bool:
        refuse(f"{what} must be a bool, got {type(value).__name__}")
    return value


def check_dtype(what: str, value: object) -> torch.dtype:
    if not isinstance(value, torch.dtype):
        refuse(f"{what} must be a torch dtype, got {type(value).__name__}")
    return value


def check_bytes(what: str, value: object, *, limit: int = 4096) -> bytes:
    if type(value) is not bytes or len(value) > limit:
        refuse(f"{what} must be at most {limit} bytes, got {type(value).__name__}")
    return value


def check_untyped(what: str, value: object) -> torch.UntypedStorage:
    if not isinstance(value, StorageRef) or value.dtype is not None:
        refuse(f"{what} must be an untyped storage rebuilt by this pickle, got {kind_of(value)}")
    return value.untyped


def check_typed(what: str, value: object) -> StorageRef:
    if not isinstance(value, StorageRef) or value.dtype is None:
        refuse(f"{what} must be a typed storage rebuilt by this pickle, got {kind_of(value)}")
    return value


def check_tensor_class(what: str, value: object) -> None:
    if value is not TENSOR and value is not PARAMETER:
        refuse(f"{what} must be torch.Tensor or torch.nn.Parameter, got {kind_of(value)}")


def check_storage_class(what: str, value: object) -> None:
    if value is not UNTYPED_STORAGE:
        refuse(f"{what} must be torch.storage.UntypedStorage, got {kind_of(value)}")


def check_empty_hooks(what: str, value: object) -> None:
    if type(value) is not collections.OrderedDict or value:
        refuse(f"{what} must be an empty OrderedDict (backward hooks are not accepted)")


def kind_of(value: object) -> str:
    if isinstance(value, _Sealed):
        return value._what()
    return type(value).__name__


def torch_call(what: str, fn: Callable[..., Any], *args: Any, hint: str = "") -> Any:
    """Call torch; its failures become TransportError (its messages may quote handles: not kept)."""
    try:
        return fn(*args)
    except TransportError:
        raise
    except Exception as exc:
        raise TransportError(f"{what} failed ({type(exc).__name__}){hint}") from None


def check_view(what: str, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
          storage_numel: int) -> None:
    """Refuse a view that reaches past its storage (torch would grow a resizable storage, or
    read past a mapped one) or that has more elements than its storage (an overlapping view,
    which any copy would multiply)."""
    if len(size) != len(stride):
        refuse(f"{what}: size and stride have different lengths")
    numel = math.prod(size)
    if numel == 0:
        if offset > storage_numel:
            refuse(f"{what}: offset {offset} is past the end of its storage of {storage_numel} "
                    "elements")
        return
    extent = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True)) + 1
    if extent > storage_numel:
        refuse(f"{what}: a view of size {size} and stride {stride} at offset {offset} reaches "
                f"element {extent}, past the end of its storage of {storage_numel} elements")
    if numel > storage_numel:
        refuse(f"{what}: a view of {numel} elements over a storage of {storage_numel} "
                "(overlapping views are not accepted)")


def elements(ref: StorageRef) -> int:
    assert ref.dtype is not None
    return ref.untyped.nbytes() // ref.dtype.itemsize


def plain_tensor(what: str, value: object) -> torch.Tensor:
    if not isinstance(value, TensorRef):
        refuse(f"{what} must be a tensor, got {kind_of(value)}")
    return value.tensor
