"""``resident``: every tensor on the device while awake; nothing moves around a use."""

from __future__ import annotations

from ._base import ResidencyStrategy
from ._config import ResidencyMode

__all__ = ["ResidentStrategy"]


class ResidentStrategy(ResidencyStrategy):
    mode = ResidencyMode.RESIDENT
