"""Which components a partial sleep or wake names: component names or the configuration's
selector groups (``dit``, ``text_encoder``, ``image_encoder``, ``vae``: see
:func:`strategies.group_of`) or ``all``; and, on the wire, the reference's memory ``tags``.

A tag is a component name, a group, ``all``, or ``weights`` (the reference's tag for every
weight: the whole pipeline). The reference's other tags (``kv_cache``, ``cuda_graph``) name
memory a diffusion pipeline does not hold: a call naming only those releases or resumes the
whole pipeline, as the reference's diffusion server does (it ignores tags). Any other string
is refused, naming what is valid: a misspelled component must not release everything.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from strategies import group_of

from ._errors import InvalidRequest

__all__ = ["GROUPS", "LLM_TAGS", "resolve_components", "resolve_tags"]

#: Selectors that name several components.
GROUPS: tuple[str, ...] = ("all", "dit", "image_encoder", "text_encoder", "vae")
#: The reference's tags for memory a diffusion pipeline does not hold.
LLM_TAGS: frozenset[str] = frozenset({"kv_cache", "cuda_graph"})
_SHOWN = 5


def _valid(components: Collection[str], field: str) -> str:
    return (f"{field} name components {sorted(components)} or groups {list(GROUPS)}"
            + (" (or 'weights'; 'kv_cache' and 'cuda_graph' are accepted and name the whole "
               "pipeline)" if field == "tags" else ""))


def _one(selector: str, components: Collection[str]) -> frozenset[str] | None:
    """The components ``selector`` names, or None when it is no name and no group."""
    if selector in components:
        return frozenset({selector})
    key = selector.strip().replace("-", "_").lower()
    if key == "all":
        return frozenset(components)
    if key in GROUPS:
        return frozenset(c for c in components if group_of(c) == key)
    return None


def resolve_components(selectors: Sequence[str] | str | None, components: Collection[str],
                       field: str = "components") -> frozenset[str]:
    """The components ``selectors`` name (None: all of them); :class:`InvalidRequest`
    naming what is valid for a selector that names nothing the pipeline holds."""
    if selectors is None:
        return frozenset(components)
    if isinstance(selectors, str):
        selectors = [s for s in (p.strip() for p in selectors.split(",")) if s]
    if not isinstance(selectors, Sequence) or not all(isinstance(s, str) for s in selectors):
        raise InvalidRequest(field, f"{field} must be a list of component names or groups, "
                                    f"got {type(selectors).__name__}")
    if not selectors:
        raise InvalidRequest(field, f"{field} is empty; {_valid(components, field)}")
    out: set[str] = set()
    unknown: list[str] = []
    for s in selectors:
        found = _one(s, components)
        if not found:
            unknown.append(s)
        else:
            out |= found
    if unknown:
        shown = ", ".join(repr(s[:60]) for s in unknown[:_SHOWN])
        raise InvalidRequest(field, f"{field} {shown} name(s) nothing this pipeline holds; "
                                    f"{_valid(components, field)}")
    return frozenset(out)


def resolve_tags(tags: Sequence[str] | None, components: Collection[str]) -> frozenset[str]:
    """The components the reference's ``tags`` name (see the module doc): every one for
    None, ``weights``, or only :data:`LLM_TAGS`; raises :class:`InvalidRequest`."""
    if tags is None:
        return frozenset(components)
    if not isinstance(tags, list | tuple) or not all(isinstance(t, str) for t in tags):
        raise InvalidRequest("tags", "tags must be a list of strings")
    named = [t for t in tags if t not in LLM_TAGS]
    if not named or "weights" in named:
        return frozenset(components)
    return resolve_components(named, components, "tags")
