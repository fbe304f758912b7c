"""What the reference's RL clients put on the wire, rebuilt without importing them: torch's
multiprocessing pickler plus base64 (SGLang's ``MultiprocessingSerializer.serialize(obj,
output_str=True)``), the flattened buckets they build (one dtype flattened, or every tensor
viewed as ``uint8`` and concatenated), keyed by module as the newest diffusion client keys them,
with the bucket's metadata class pickled under the reference's module path (a stand-in class
whose ``__module__`` / ``__qualname__`` are the reference's, registered in ``sys.modules`` only
while pickling), and the two hashes clients compute (the component checksum, the per-tensor
SHA-256)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import sys
import types
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing

REFERENCE_MODULE = "sglang.srt.weight_sync.tensor_bucket"


def serialize(obj: object) -> str:
    """``MultiprocessingSerializer.serialize(obj, output_str=True)``: ForkingPickler, base64."""
    return base64.b64encode(bytes(ForkingPickler.dumps(obj))).decode()


@contextmanager
def sharing(strategy: str) -> Iterator[None]:
    """torch's tensor sharing strategy for the block (``file_system`` for a server in another
    process: fd passing needs a multiprocessing relative)."""
    before = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]
    torch.multiprocessing.set_sharing_strategy(strategy)  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(before)  # type: ignore[no-untyped-call]


@contextmanager
def reference_metadata_class() -> Iterator[Any]:
    """The reference's ``FlattenedTensorMetadata`` under its own module path, importable (by
    pickle's check) only inside the block; no SGLang is imported."""

    @dataclasses.dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = REFERENCE_MODULE
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    parts = REFERENCE_MODULE.split(".")
    names = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    assert not any(n in sys.modules for n in names), "a real sglang is installed"
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    module: Any = sys.modules[REFERENCE_MODULE]
    module.FlattenedTensorMetadata = FlattenedTensorMetadata
    try:
        yield FlattenedTensorMetadata
    finally:
        for n in names:
            del sys.modules[n]


def bucket(named: Iterable[tuple[str, torch.Tensor]], meta_cls: Any, *, as_bytes: bool = True
           ) -> dict[str, object]:
    """The reference's ``FlattenedTensorBucket``: each tensor flattened (viewed as ``uint8``
    today; one dtype flattened as it is before), concatenated, with its metadata."""
    flats, metadata, index = [], [], 0
    for name, tensor in named:
        flat = tensor.flatten().view(torch.uint8) if as_bytes else tensor.flatten()
        metadata.append(meta_cls(name=name, shape=tensor.shape, dtype=tensor.dtype,
                                 start_idx=index, end_idx=index + flat.numel(),
                                 numel=flat.numel()))
        flats.append(flat)
        index += flat.numel()
    return {"flattened_tensor": torch.cat(flats), "metadata": metadata}


def bucket_payload(named: list[tuple[str, torch.Tensor]], module: str | None = "transformer", *,
                   as_bytes: bool = True) -> str:
    """One entry as the newest diffusion client serializes a bucket: ``{module: bucket}``
    (``module`` None: the bare bucket older clients send)."""
    with reference_metadata_class() as meta_cls:
        made = bucket(named, meta_cls, as_bytes=as_bytes)
        return serialize(made if module is None else {module: made})


def reference_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The clients' ``compute_weights_checksum``: SHA-256 over the tensors sorted by name,
    each name's bytes then the tensor's contiguous CPU bytes."""
    h = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda nt: nt[0]):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def tensor_sha256(tensor: torch.Tensor) -> str:
    """The clients' per-tensor hash for ``/update_weights_from_tensor_checker``: SHA-256 of
    ``str(dtype)``, ``repr(tuple(shape))``, then the contiguous bytes."""
    h = hashlib.sha256()
    h.update(str(tensor.dtype).encode())
    h.update(repr(tuple(tensor.shape)).encode())
    h.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def parameters(module: torch.nn.Module, delta: float = 0.0) -> list[tuple[str, torch.Tensor]]:
    """The module's parameters (detached copies, shifted by ``delta``), as a trainer has them."""
    return [(n, (p.detach() + delta).contiguous()) for n, p in module.named_parameters()]
