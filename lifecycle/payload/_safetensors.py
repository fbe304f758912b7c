"""Safetensors uploads (recommended).

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
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping

import torch

from ._errors import TransportError, refuse
from ._memory import tensor_over
from ._sealed import MAX_DIMS, MAX_INT

# The bound on a safetensors header: the format allows 100 MB, but parsing JSON holds the GIL
# (a structure-heavy 100 MB header took 6.5 s here, the event loop stalled meanwhile); 8 MiB
# (about 80,000 tensors in one upload) stays under half a second.
_MAX_SAFETENSORS_HEADER = 8 * 2**20


# safetensors' dtype names (safetensors.torch._TYPES, the ones torch has).
_ST_DTYPES: Mapping[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def looks_like_safetensors(data: memoryview) -> bool:
    """Shaped like a safetensors file: 8-byte little-endian length N (at most
    :data:`_MAX_SAFETENSORS_HEADER`), then N bytes starting with ``{``, inside the data."""
    if len(data) < 10:
        return False
    n = int.from_bytes(data[:8], "little")
    return 2 <= n <= min(len(data) - 8, _MAX_SAFETENSORS_HEADER) and data[8] == ord("{")


def load_safetensors(data: memoryview) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a safetensors file, in the file's order, each copied once out of ``data``.

    Parsed here rather than by ``safetensors.torch.load``: that takes only ``bytes`` (one more
    copy of the payload), copies every tensor once more into a ``bytearray``, and holds the GIL
    throughout (a gigabyte stalls the event loop for seconds). The rules are the library's (known
    dtypes, ``data_offsets`` matching shape and dtype, the tensors tiling the data area exactly:
    no holes, no overlaps), but the JSON header may be at most 8 MiB, not 100 MB."""
    what = f"not a valid safetensors file ({len(data)} bytes)"
    if len(data) < 8:
        refuse(f"{what}: shorter than its 8-byte header length")
    n = int.from_bytes(data[:8], "little")
    if n > min(len(data) - 8, _MAX_SAFETENSORS_HEADER):
        refuse(f"{what}: its header length is past its end or over "
                f"{_MAX_SAFETENSORS_HEADER // 2**20} MiB")
    try:
        header = json.loads(bytes(data[8:8 + n]))
    except (ValueError, RecursionError):
        raise TransportError(f"{what}: the header is not JSON") from None
    if not isinstance(header, dict):
        refuse(f"{what}: the header is not a JSON object")
    area = data[8 + n:]
    entries: list[tuple[int, int, str, torch.dtype, list[int]]] = []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(type(v) is str for v in info.values()):
                refuse(f"{what}: __metadata__ must map strings to strings")
            continue
        where = f"{what}: tensor {name[:100]!r}"
        if not isinstance(info, dict):
            refuse(f"{where} has no dtype, shape and data_offsets")
        dtype_name = info.get("dtype")
        dtype = _ST_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
        if dtype is None:
            refuse(f"{where} has dtype {str(dtype_name)[:20]!r}; accepted: "
                    f"{', '.join(_ST_DTYPES)}")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if (not isinstance(shape, list) or len(shape) > MAX_DIMS
                or not all(type(d) is int and 0 <= d < MAX_INT for d in shape)):
            refuse(f"{where} has a shape that is not a list of non-negative ints")
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(type(o) is int for o in offsets) or not 0 <= offsets[0] <= offsets[1]):
            refuse(f"{where} has data_offsets that are not [begin, end]")
        if math.prod(shape) * dtype.itemsize != offsets[1] - offsets[0]:
            refuse(f"{where}: shape {shape} of {dtype} does not fill data_offsets {offsets}")
        entries.append((offsets[0], offsets[1], name, dtype, shape))
    entries.sort(key=lambda e: (e[0], e[1]))
    reached = 0
    for begin, end, name, _, _ in entries:
        if begin != reached:
            refuse(f"{what}: the tensors' data has a hole or an overlap at byte {reached} "
                    f"(tensor {name[:100]!r})")
        reached = end
    if reached != len(area):
        refuse(f"{what}: the tensors hold {reached} bytes but the data area has {len(area)}; "
                "the header or the data is truncated or inconsistent")
    if sys.byteorder != "little":  # every supported platform is little-endian
        refuse("this server reads safetensors only on little-endian machines")
    return [(name, tensor_over(area[begin:end], dtype, shape))
            for begin, end, name, dtype, shape in entries]
