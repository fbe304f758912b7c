"""The wire facts of the weight-update routes that every rank applies alike.

* **A rank's "GPU UUID"** (:func:`device_uuid`): on CUDA, the device's UUID as torch reports it;
  on any other device a stable string of ours, ``"<TYPE>-<uuid5>"`` of the host name, the
  device type and the rank (``CPU-1b4e...`` for rank 0 of a CPU server): the same on every
  start on one host. ``/state`` shows it (``device_uuid``), so that a client can name it in
  ``payload_gpu_uuids``. UUIDs compare after stripping a ``GPU-`` / ``MIG-`` prefix,
  case-insensitively (:func:`normalize_uuid`), as the reference compares them.
* **Which entry of ``serialized_named_tensors`` a rank takes** (:func:`pick_entry`), the
  reference's rule: without ``payload_gpu_uuids``, the only entry, or entry ``rank`` of
  ``world_size`` entries; with them (one per entry), the entry whose UUID is the rank's own.
* **An entry becomes the named tensors of the target** (:func:`decode_entry`): base64, then
  :func:`~lifecycle.payload.decode_modules` (a payload keyed by module, or a bare one
  for one target), then the checks every rank makes before the update (no empty update, names
  relative to the module).
* **Whose failure a failed update is** (:func:`trainer_failed`): a distributed update rolled
  back because the trainer's broadcast failed (it died or stalled) is the client's (400), a
  rollback for any other cause is ours (500).
"""

from __future__ import annotations

import dataclasses
import socket
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .. import LifecycleController, UpdateResult
from .._lora import LoraMergeNotFinite
from .._weight_sync import WeightSyncTransferFailed
from ..payload import (
    FD_TIMEOUT,
    PayloadModulesMismatch,
    TransportError,
    decode_base64,
    decode_modules,
)

__all__ = ["Decoded", "TensorRequest", "WireRefused", "decode_entry", "device_uuid", "group_refusal",
           "normalize_uuid", "pick_entry", "relative_names", "trainer_failed"]

_SHOWN = 8  # UUIDs or names quoted in one message


class WireRefused(ValueError):
    """A request refused before anything changed (answered 400 with this message)."""


# -- which entry a rank takes -----------------------------------------------------------------
def device_uuid(device: torch.device, rank: int) -> str:
    """This rank's "GPU UUID" (see the module doc)."""
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return str(torch.cuda.get_device_properties(index).uuid)
    name = f"residency://{socket.gethostname()}/{device.type}/{rank}"
    return f"{device.type.upper()}-{uuid.uuid5(uuid.NAMESPACE_URL, name)}"


def normalize_uuid(value: str) -> str:
    """``value`` lower-cased, without a ``GPU-`` / ``MIG-`` prefix."""
    text = value.strip().lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    return text


def _shown(values: Sequence[str]) -> str:
    parts = [v[:80] for v in values[:_SHOWN]]
    more = f" (and {len(values) - _SHOWN} more)" if len(values) > _SHOWN else ""
    return f"{parts}{more}"


def pick_entry(count: int, uuids: Sequence[str] | None, rank: int, world_size: int,
               own_uuid: str) -> int:
    """The index of the entry rank ``rank`` of ``world_size`` takes out of ``count`` entries
    (the reference's rule and messages); raises :class:`WireRefused`."""
    if not uuids:
        if count == 1:
            return 0
        if count != world_size:
            raise WireRefused(f"serialized_named_tensors size must be 1 or world_size "
                              f"({world_size}), got {count}")
        return rank
    if len(uuids) != count:
        raise WireRefused(f"payload_gpu_uuids needs one entry per payload, got {len(uuids)} "
                          f"for {count} payloads")
    normalized = [normalize_uuid(u) for u in uuids]
    mine = normalize_uuid(own_uuid)
    if mine not in normalized:
        raise WireRefused(f"no payload was exported from this worker's GPU {mine}, got "
                          f"{_shown(uuids)}")
    return normalized.index(mine)


# -- what an upload asks for --------------------------------------------------------------------
@dataclass(frozen=True)
class TensorRequest:
    """The fields of ``/update_weights_from_tensor`` besides its entries (JSON-able: the
    multi-rank relay sends it to every rank)."""

    targets: tuple[str, ...] = ("transformer",)
    load_format: str | None = None
    weight_update_mode: str | None = None
    lora_alpha: float | None = None
    lora_rank: int | None = None
    weight_version: str | None = None
    flush_cache: bool = False

    @classmethod
    def from_json(cls, value: Mapping[str, Any]) -> TensorRequest:
        return cls(**{**value, "targets": tuple(value["targets"])})

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "targets": list(self.targets)}

    def options(self) -> dict[str, Any]:
        """The keyword arguments of :meth:`LifecycleController.update_weights_from_tensors`."""
        return {"weight_update_mode": self.weight_update_mode, "lora_alpha": self.lora_alpha,
                "lora_rank": self.lora_rank, "weight_version": self.weight_version,
                "flush_cache": self.flush_cache}


# The named tensors of an upload, by module (one module, or several applied as one update).
Decoded = dict[str, list[tuple[str, torch.Tensor]]]


def decode_entry(text: str | bytes | bytearray | memoryview, index: int,
                 request: TensorRequest, components: Mapping[str, nn.Module], *,
                 fd_timeout: float = FD_TIMEOUT) -> Decoded:
    """Entry ``index`` (its base64 ``text``; a writable view is decoded in place) as the named
    tensors of each of the request's targets; raises :class:`WireRefused`. Several targets
    need a payload keyed by module (the reference's rule) and are applied as one update.
    Blocking: run it in a worker thread."""
    try:
        data = decode_base64(text)
        modules = decode_modules(data, request.load_format, request.targets,
                                 fd_timeout=fd_timeout)
    except PayloadModulesMismatch as exc:
        raise WireRefused(str(exc)) from None
    except TransportError as exc:
        raise WireRefused(f"Failed to deserialize serialized_named_tensors[{index}]: {exc}"
                          ) from None
    if len(request.targets) > 1 and request.weight_update_mode == "lora_merge":
        raise WireRefused(f"a LoRA merge writes one module; got target_modules "
                          f"{list(request.targets)}: send one request per module")
    out: Decoded = {}
    for target in request.targets:
        named = modules[target]
        if not named:
            raise WireRefused(f"serialized_named_tensors[{index}] holds no tensors for "
                              f"{target!r}; an update writes at least one per module named, "
                              "nothing was updated")
        relative_names(components, named, target)
        out[target] = list(named)
    return out


def relative_names(components: Mapping[str, nn.Module], named: Sequence[tuple[str, Any]],
                   target: str) -> None:
    """Refuse names given with the module's own prefix (``transformer.x.weight`` for module
    ``transformer``): names are relative to the module, as the reference takes them."""
    module = components.get(target)
    if module is None:
        return  # the controller names the unknown module
    known = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    known.update(n for n, _ in module.named_buffers(remove_duplicate=False))
    prefix = f"{target}."
    doubled = [n for n, _ in named
               if n.startswith(prefix) and n not in known and n[len(prefix):] in known]
    if doubled:
        more = f" (and {len(doubled) - 5} more)" if len(doubled) > 5 else ""
        raise WireRefused(f"tensor names are relative to module {target!r}: {doubled[:5]}{more} "
                          f"name no tensor of it; send them without the {prefix!r} prefix (e.g. "
                          f"{doubled[0][len(prefix):]!r}); nothing was updated")


# -- distributed updates -------------------------------------------------------------------------
def group_refusal(ctl: LifecycleController, group_name: str) -> str | None:
    """Why this rank cannot take an update over ``group_name`` now (missing, broken), or
    None. Several ranks compare these before any of them starts the update, so that no rank
    waits in the update's vote for a rank that refused at once."""
    group = ctl.weight_update_groups.get(group_name)
    if group is None:
        return (f"weight update group {group_name!r} is not initialized; call "
                "init_weights_update_group first")
    if group.broken is not None:
        return (f"weight update group {group_name!r} is broken ({group.broken}); destroy it "
                "and init it again")
    return None


def trainer_failed(result: UpdateResult) -> bool:
    """A distributed update that was rolled back because the trainer's broadcast failed (the
    trainer died, stalled or left the group): the client's failure, not the server's."""
    return result.rolled_back and WeightSyncTransferFailed.__name__ in result.causes


def client_fault(result: UpdateResult) -> bool:
    """An update rolled back for what the client sent (a LoRA merge whose result is not
    finite), on any route: 400, not the server's 500."""
    return result.rolled_back and LoraMergeNotFinite.__name__ in result.causes
