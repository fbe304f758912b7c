"""Turning what the user passes into named components."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["components_of"]


def components_of(pipeline: Any) -> dict[str, nn.Module]:
    """The ``nn.Module`` entries of a mapping, of ``pipeline.modules`` (the reference's
    pipelines) or of ``pipeline.components`` (diffusers); other entries are ignored."""
    source: object = pipeline
    if not isinstance(pipeline, Mapping):
        for attr in ("modules", "components"):
            candidate = getattr(pipeline, attr, None)
            if isinstance(candidate, Mapping):
                source = candidate
                break
        else:
            raise TypeError(
                f"cannot attach a {type(pipeline).__name__}: expected a Mapping[str, nn.Module], "
                "or an object with a `modules` or `components` mapping")
    assert isinstance(source, Mapping)
    found = {str(k): v for k, v in source.items() if isinstance(v, nn.Module)}
    if not found:
        raise ValueError(f"pipeline has no nn.Module components (entries: {sorted(map(str, source))})")
    owners: dict[int, str] = {}
    for name, module in found.items():
        for sub in module.modules():
            other = owners.setdefault(id(sub), name)
            if other != name:
                raise ValueError(f"components {other!r} and {name!r} share the module "
                                 f"{type(sub).__name__}; each component must own its modules")
    return found
