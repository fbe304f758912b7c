"""The root of every error this project raises on purpose."""

from __future__ import annotations

__all__ = ["ResidencyError"]


class ResidencyError(Exception):
    """Base of every error of ``strategies`` and ``lifecycle``: ``except ResidencyError``
    catches each refusal and failure of the library (and nothing else)."""
