"""SGLang's flattened buckets: ``{"flattened_tensor": flat, "metadata": [...]}``.

``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` is mapped to the local
dataclass :class:`FlattenedTensorMetadata` (same six fields), whose state is validated; no
SGLang import. :func:`unflatten` checks every slice against the flat tensor before taking it.
"""

from __future__ import annotations

import dataclasses
from typing import NoReturn

import torch

from ._errors import TransportError, refuse
from ._sealed import check_dtype, check_int, check_ints, kind_of, plain_tensor

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
            refuse(f"{what} is set twice")
        if not isinstance(state, dict) or set(state) != set(_META_FIELDS):
            refuse(f"{what} must have exactly the fields {', '.join(_META_FIELDS)}")
        vars(self).update(state)
        self._check()

    def _check(self) -> None:
        what = "FlattenedTensorMetadata"
        if type(self.name) is not str:
            refuse(f"{what}.name must be a str, got {type(self.name).__name__}")
        self.shape = torch.Size(check_ints(f"{what}.shape", self.shape))
        check_dtype(f"{what}.dtype", self.dtype)
        for field in ("start_idx", "end_idx", "numel"):
            check_int(f"{what}.{field}", getattr(self, field))

    def __reduce__(self) -> NoReturn:
        raise TypeError("the local FlattenedTensorMetadata is not for pickling")


def unflatten(obj: object) -> list[tuple[str, torch.Tensor]]:
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
        refuse(f"the pickle holds {kind_of(obj)}; {expected}")
    flat = plain_tensor("flattened_tensor", obj["flattened_tensor"])
    metadata = obj["metadata"]
    if not isinstance(metadata, list | tuple):
        refuse(f"metadata is {kind_of(metadata)}; {expected}")
    if flat.dim() != 1:
        refuse(f"flattened_tensor has {flat.dim()} dimensions; expected 1")
    if not flat.is_contiguous():
        refuse("flattened_tensor must be contiguous (as torch.cat makes it)")
    total = flat.numel()
    cast_budget = 2 * flat.nbytes
    out: list[tuple[str, torch.Tensor]] = []
    for i, meta in enumerate(metadata):
        if not isinstance(meta, FlattenedTensorMetadata) or set(vars(meta)) != set(_META_FIELDS):
            refuse(f"metadata[{i}] is {kind_of(meta)} without its fields; {expected}")
        where = f"metadata[{i}] ({meta.name[:100]!r})"
        start, end = meta.start_idx, meta.end_idx
        if not start <= end <= total:
            refuse(f"{where} spans [{start}, {end}), outside the flattened tensor's {total} elements")
        if meta.numel != end - start:
            refuse(f"{where} has numel {meta.numel} but spans {end - start} elements")
        piece = flat[start:end]
        try:
            if piece.dtype == meta.dtype:
                tensor = piece.reshape(meta.shape)
            elif piece.dtype == torch.uint8:
                tensor = piece.view(meta.dtype).reshape(meta.shape)
            else:
                cast_budget -= (end - start) * meta.dtype.itemsize
                if cast_budget < 0:
                    refuse(f"{where}: the bucket's casts would allocate more than twice the "
                            f"flattened tensor's {flat.nbytes} bytes")
                tensor = piece.reshape(meta.shape).to(meta.dtype)
        except RuntimeError:
            raise TransportError(f"{where}: {end - start} elements of {flat.dtype} do not make a "
                                 f"{meta.dtype} tensor of shape {tuple(meta.shape)}") from None
        out.append((meta.name, tensor))
    return out
