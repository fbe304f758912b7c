"""Checksums of weights: the reference's component checksum, ours, and the per-tensor hash.

Three hashes, each for whom it serves:

* ``"reference"`` (:func:`reference_checksum`), what ``weights_checksum()`` answers: the
  reference system's ``compute_weights_checksum``, which trainers compare with their own after
  each weight sync. SHA-256 over the component's *parameters* (``named_parameters()``: tied
  parameters once, under their first name) sorted by name; for each, ``name.encode()`` then the
  tensor's contiguous bytes. Buffers are not in it, nor dtypes or shapes.
* ``"full"`` (:func:`lifecycle._updates.checksum`): every tensor the library manages
  (parameters, buffers, plain tensor attributes), each with its dtype and shape: what the
  library's own integrity checks use (a sleep/wake or a rolled-back update keeps buffers too).
* :func:`tensor_sha256`, per tensor, as the reference's clients compute it for
  ``/update_weights_from_tensor_checker``: SHA-256 of ``str(dtype)``, then
  ``repr(tuple(shape))``, then the contiguous bytes.

All read the bytes from wherever they live (device, host mirror, a released layer's store),
so the same weights hash the same whatever the residency. Never called on the event loop by
the controller: hashing runs in a worker thread.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Literal, get_args

import anyio
import torch
from torch import nn

from strategies.protocol import TensorStore, to_thread

from ._discard import refuse_stale
from ._errors import InvalidRequest, UnknownComponent
from ._results import RankChecksums, TensorHashCheck
from ._updates import checksum as full_checksum

if TYPE_CHECKING:
    from ._collective import Collective
    from ._components import Components
    from ._owner import Owner

__all__ = ["ALGORITHMS", "ChecksumAlgorithm", "Checksums", "check_expected", "check_hashes",
           "component_checksum", "reference_checksum", "tensor_sha256"]

ChecksumAlgorithm = Literal["reference", "full"]
ALGORITHMS: tuple[str, ...] = get_args(ChecksumAlgorithm)


def _feed(h: hashlib._Hash, t: torch.Tensor) -> None:
    """The tensor's contiguous bytes into ``h``, hashed in place (no copy into ``bytes``)."""
    local = t.detach()
    to_local = getattr(local, "to_local", None)  # a DTensor: this rank's shard
    if callable(to_local):
        local = to_local()
    c = local.to("cpu").contiguous()
    if c.numel():
        h.update((ctypes.c_char * c.nbytes).from_address(c.data_ptr()))


def reference_checksum(named_parameters: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The reference's checksum: SHA-256 over ``named_parameters`` sorted by name, each
    ``name.encode()`` then the tensor's contiguous bytes."""
    h = hashlib.sha256()
    for name, t in sorted(named_parameters, key=lambda nt: nt[0]):
        h.update(name.encode())
        _feed(h, t)
    return h.hexdigest()


def component_checksum(module: nn.Module, store: TensorStore,
                       algorithm: ChecksumAlgorithm = "reference") -> str:
    """One component's checksum by ``algorithm`` (see the module docstring)."""
    if algorithm == "reference":
        return reference_checksum(module.named_parameters())
    if algorithm == "full":
        return full_checksum(store)
    raise InvalidRequest("algorithm", f"checksum algorithm must be one of {list(ALGORITHMS)}, "
                                      f"got {algorithm!r}")


def tensor_sha256(t: torch.Tensor) -> str:
    """The reference clients' per-tensor hash: SHA-256 of ``str(dtype)``, then
    ``repr(tuple(shape))``, then the contiguous bytes."""
    h = hashlib.sha256()
    h.update(str(t.dtype).encode())
    h.update(repr(tuple(t.shape)).encode())
    _feed(h, t)
    return h.hexdigest()


def check_expected(expected: object) -> dict[str, str]:
    """``expected`` as ``{name: lower-case hex}``, or :class:`InvalidRequest`."""
    if not isinstance(expected, Mapping) or not expected:
        raise InvalidRequest("expected_named_tensors_sha256",
                             "expected_named_tensors_sha256 is required: a non-empty mapping "
                             f"of tensor name to SHA-256 hex, got {type(expected).__name__}")
    out: dict[str, str] = {}
    for name, digest in expected.items():
        if not isinstance(name, str) or not isinstance(digest, str):
            raise InvalidRequest("expected_named_tensors_sha256",
                                 "expected_named_tensors_sha256 must map names (str) to SHA-256 "
                                 f"hex strings, got {type(name).__name__}: "
                                 f"{type(digest).__name__}")
        out[name] = digest.strip().lower()
    return out


def check_hashes(store: TensorStore, target: str, expected: Mapping[str, str]
                 ) -> TensorHashCheck:
    """Compare each expected tensor's :func:`tensor_sha256` with the one of the tensor of
    that name (any of its names: parameter, buffer) in ``store``."""
    mismatched: list[str] = []
    missing: list[str] = []
    for name, digest in expected.items():
        tensor = store.tensor_named(name)
        if tensor is None:
            missing.append(name)
        elif tensor_sha256(tensor) != digest:
            mismatched.append(name)
    checked = len(expected)
    if not mismatched and not missing:
        return TensorHashCheck(True, f"all {checked} tensor(s) of {target} match", target,
                               checked)
    parts = []
    if mismatched:
        parts.append(f"{len(mismatched)} mismatched: {mismatched}")
    if missing:
        parts.append(f"{len(missing)} missing from {target}: {missing}")
    return TensorHashCheck(False, f"{len(mismatched) + len(missing)} of {checked} tensor(s) "
                           f"of {target} do not match; " + "; ".join(parts), target, checked,
                           tuple(mismatched), tuple(missing))


class Checksums:
    """One controller's checksums of its attached components (``components``): hashed in its
    worker threads (``threads``) under its lock, so that no move or update runs meanwhile, and
    gathered from every rank through its collective (``ranks``; ``owner``: the controller,
    whose rank names this rank's checksums)."""

    def __init__(self, components: Components, lock: anyio.Lock,
                 threads: anyio.CapacityLimiter, ranks: Collective, owner: Owner) -> None:
        self._components = components
        self._lock = lock
        self._threads = threads
        self._ranks = ranks
        self._owner = owner

    def now(self, names: Sequence[str] | None, algorithm: ChecksumAlgorithm) -> dict[str, str]:
        """``{component: checksum}`` of ``names`` (every component for None), in this thread;
        a stale one raises :class:`WeightsDiscarded`."""
        attached = [self._components.component(n)
                    for n in (list(self._components) if names is None else list(names))]
        refuse_stale(attached)
        return {c.name: component_checksum(c.module, c.strategy.store, algorithm) for c in attached}

    async def locked(self, names: Sequence[str] | None, algorithm: ChecksumAlgorithm
                     ) -> dict[str, str]:
        """:meth:`now` in a worker thread, under the lock."""
        async with self._lock:
            return await to_thread(
                functools.partial(self.now, names, algorithm), limiter=self._threads)

    async def across_ranks(self, names: Sequence[str] | None, algorithm: ChecksumAlgorithm
                           ) -> RankChecksums:
        """Every rank's :meth:`locked` (collective: every rank calls it)."""
        return await self._ranks.checksums(await self.locked(names, algorithm), self._owner.rank)

    async def named(self, names: Sequence[str] | None) -> dict[str, dict[str, str]]:
        """``{component: {name: tensor_sha256}}`` of every parameter and buffer of ``names``
        (every component for None), in a worker thread under the lock."""

        def hashes() -> dict[str, dict[str, str]]:
            attached = [self._components.component(n)
                        for n in (list(self._components) if names is None else list(names))]
            refuse_stale(attached)
            out: dict[str, dict[str, str]] = {}
            for c in attached:
                found: dict[str, torch.Tensor] = dict(
                    c.module.named_parameters(remove_duplicate=False))
                found.update(c.module.named_buffers(remove_duplicate=False))
                tensors = {n: c.strategy.store.tensor_named(n) for n in sorted(found)}
                out[c.name] = {n: tensor_sha256(t) for n, t in tensors.items() if t is not None}
            return out

        async with self._lock:
            return await to_thread(hashes, limiter=self._threads)

    async def copies(self, target: str, names: Sequence[str]) -> list[tuple[str, torch.Tensor]]:
        """Host copies of ``target``'s tensors ``names`` (read from wherever they are), in a
        worker thread under the lock; names it lacks are left out."""
        component = self._components.component(target)

        def read() -> list[tuple[str, torch.Tensor]]:
            out = []
            for name in names:
                t = component.strategy.store.tensor_named(name)
                if t is not None:
                    with torch.inference_mode(False):
                        out.append((name, t.detach().to("cpu", copy=True)))
            return out

        async with self._lock:
            return await to_thread(read, limiter=self._threads)

    async def tensors(self, target: str, expected: Mapping[str, str]) -> TensorHashCheck:
        """:func:`check_hashes` of ``target``'s store (checked first: ``expected``, then that
        ``target`` is attached), in a worker thread under the lock."""
        wanted = check_expected(expected)
        if target not in self._components:
            raise UnknownComponent(target, list(self._components))
        async with self._lock:
            component = self._components.component(target)
            refuse_stale([component])  # its stale tensors hold undefined values
            return await to_thread(check_hashes, component.strategy.store, target, wanted,
                                   limiter=self._threads)
