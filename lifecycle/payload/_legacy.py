"""torch's legacy storage format: what ``pickle.dumps(tensor)`` carries inside
``torch.storage._load_from_bytes``.

torch's own ``_load_from_bytes`` is ``torch.load(weights_only=False)`` (arbitrary code); the
stand-in here never calls ``torch.load``: it reads the legacy format itself (five small
pickles, then the storage's bytes), admitting only storage classes and one storage whose
declared size is exactly the bytes that follow. Zip archives (compressed entries can declare
gigabytes) and other formats are refused.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Mapping
from typing import Any

import torch

from ._errors import TransportError, refuse
from ._memory import tensor_over
from ._prescan import scan
from ._sealed import StorageRef, check_arity, check_int

_LB = "torch.storage._load_from_bytes"


def load_from_bytes(*args: object) -> StorageRef:
    check_arity(_LB, args, 1)
    raw = args[0]
    # A memoryview: a large byte string handed over out of band (see unpickle).
    if type(raw) is not bytes and type(raw) is not memoryview:
        refuse(f"{_LB} argument must be bytes, got {type(raw).__name__}")
    # torch's own load_from_bytes is torch.load(weights_only=False): arbitrary code. Not here:
    # torch's legacy storage format, read by _legacy_storage, and nothing else.
    return _legacy_storage(memoryview(raw))


# --------------------------------------------------------------------------------------------
# torch's legacy storage format: what ``pickle.dumps(tensor)`` carries inside load_from_bytes.
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
        refuse(f"{_LB}: the storage refers to {qualname[:200]}, which is not allowed: only "
                "torch storage classes are")

    def persistent_load(self, pid: Any, /) -> _StorageRecord:
        what = f"{_LB}: the storage id"
        if (not isinstance(pid, tuple) or len(pid) not in (5, 6) or pid[0] != "storage"
                or not isinstance(pid[1], _StorageType) or type(pid[2]) is not str
                or len(pid[2]) > 64 or type(pid[3]) is not str or len(pid[3]) > 64
                or (len(pid) == 6 and pid[5] is not None)):
            refuse(f"{what} must be ('storage', storage class, key, location, numel)")
        if self.records:
            refuse(f"{what} appears twice; one storage is expected")
        record = _StorageRecord(pid[1].dtype, pid[2], check_int(f"{what}'s numel", pid[4]))
        self.records.append(record)
        return record


def _legacy_storage(raw: memoryview) -> StorageRef:
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
            end, _spans = scan(raw, pos, legacy=True)
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
        refuse(refused)
    if sys_info.get("little_endian") is not True:
        refuse(f"{_LB}: the storage was written big-endian, which this server does not read")
    if not records or main is not records[0] or keys != [records[0].key]:
        refuse(f"{_LB}: the pickle must hold exactly one storage")
    record = records[0]
    itemsize = 1 if record.dtype is None else record.dtype.itemsize
    nbytes = record.numel * itemsize
    if len(raw) - pos < 8 or int.from_bytes(raw[pos:pos + 8], "little") != record.numel:
        refuse(f"{_LB}: the storage's element count does not match its id ({record.numel})")
    pos += 8
    if len(raw) - pos != nbytes:
        refuse(f"{_LB}: the storage declares {nbytes} bytes but {len(raw) - pos} follow")
    return StorageRef(tensor_over(raw[pos:], record.dtype or torch.uint8, [nbytes // itemsize]
                                    ).untyped_storage(), record.dtype)
