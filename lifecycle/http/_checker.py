"""SGLang's ``/weights_checker`` on one rank: ``snapshot`` keeps the per-tensor SHA-256 of
every parameter and buffer of every component (the reference keeps host copies; hashes are
enough to name what differs, at a few bytes per tensor), ``reset_tensors`` writes random
values into every one of them as one update (all or nothing, through the host mirrors like any
update: a sleep after it keeps them), and ``compare`` names every tensor whose hash differs
from the snapshot. The reference's use: snapshot, reset, sync the weights from the trainer,
compare (a complete sync matches)."""

from __future__ import annotations

import torch

from .. import LifecycleController, WeightsDiscarded

__all__ = ["WeightsChecker"]

_SHOWN = 20


def _random_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        return torch.randn(t.shape, generator=gen).to(t.dtype)
    if t.dtype == torch.bool:
        return torch.randint(0, 2, t.shape, generator=gen).bool()
    return torch.randint(0, 100, t.shape, generator=gen).to(t.dtype)


class WeightsChecker:
    """One rank's snapshot (see the module doc)."""

    def __init__(self) -> None:
        self.snapshot: dict[str, dict[str, str]] | None = None
        self._resets = 0

    async def handle(self, ctl: LifecycleController, action: str) -> tuple[bool, str]:
        """``(success, message)`` of ``action``."""
        try:
            if action == "snapshot":
                self.snapshot = await ctl.tensor_hashes()
                count = sum(len(h) for h in self.snapshot.values())
                return True, f"snapshot of {count} tensor(s) taken"
            if action == "reset_tensors":
                return await self._reset(ctl)
            return await self._compare(ctl)
        except WeightsDiscarded as exc:
            return False, str(exc)

    async def _reset(self, ctl: LifecycleController) -> tuple[bool, str]:
        self._resets += 1
        gen = torch.Generator().manual_seed(self._resets)  # the same values on every rank
        modules: dict[str, list[tuple[str, torch.Tensor]]] = {}
        for name, module in ctl.components.items():
            found: dict[str, torch.Tensor] = dict(module.named_parameters())
            found.update(module.named_buffers())
            store = ctl.strategy(name).store
            for tensor_name in sorted(found):
                model = store.tensor_named(tensor_name)
                if model is not None:
                    modules.setdefault(name, []).append(
                        (tensor_name, _random_like(model, gen)))
        result = await ctl.update_weights_from_modules(modules)
        if not result.success:
            return False, result.message
        count = sum(len(v) for v in modules.values())
        return True, f"reset {count} tensor(s) of {sorted(modules)} to random values"

    async def _compare(self, ctl: LifecycleController) -> tuple[bool, str]:
        if self.snapshot is None:
            return False, "no snapshot to compare with: call action 'snapshot' first"
        now = await ctl.tensor_hashes()
        differ = [f"{c}.{n}" for c, hashes in self.snapshot.items() for n, h in hashes.items()
                  if now.get(c, {}).get(n) != h]
        differ += [f"{c}.{n}" for c, hashes in now.items() for n in hashes
                   if n not in self.snapshot.get(c, {})]
        checked = sum(len(h) for h in self.snapshot.values())
        if not differ:
            return True, f"all {checked} tensor(s) match the snapshot"
        more = f" (and {len(differ) - _SHOWN} more)" if len(differ) > _SHOWN else ""
        return False, (f"{len(differ)} of {checked} tensor(s) differ from the snapshot: "
                       f"{differ[:_SHOWN]}{more}")
