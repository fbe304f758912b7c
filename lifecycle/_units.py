"""Bytes and rates as people write and read them: the one parser of sizes (budgets, the
demo's size, command options), the one formatter of byte counts, the one GB/s."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "gbps", "parse_size"]

_UNITS = {"": 1, "b": 1,
          "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12,
          "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30, "gib": 2**30,
          "ti": 2**40, "tib": 2**40}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes in ``text``: ``"1000"``, ``"512k"``, ``"256MB"``, ``"1.5GiB"`` (case-insensitive).

    Decimal units (k, KB, MB, GB, TB) are powers of 1000, binary ones (KiB, MiB, GiB, TiB)
    powers of 1024; a fractional result is rounded down to whole bytes."""
    match = _SIZE_RE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(f"invalid size {text!r}; expected a number with an optional unit, "
                         "e.g. '1000', '512k', '256MB', '1.5GiB' (units: B, k/KB, MB, GB, TB "
                         "are powers of 1000; KiB, MiB, GiB, TiB powers of 1024)")
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit it reaches, two decimals: ``"1.50 GiB"``,
    ``"512 B"``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def gbps(nbytes: float, seconds: float) -> float:
    """Bytes per second in GB/s (decimal), 0 for no time."""
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0
