"""Residency configuration: which mode each component runs in, and how layers stream.

A configuration maps *selectors* to values. A selector is an exact component name, a
group (``dit``, ``text_encoder``, ``image_encoder``, ``vae``) or ``all``; lookups use the
most specific one (exact > group > ``all`` > default). Everything is validated when the
configuration is built, so a typo fails at start-up with a message naming the offending
entry, the valid choices and the closest one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import functools
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import TypeVar

__all__ = [
    "DIT_GROUP",
    "RESIDENCY_POLICIES",
    "VAE_GROUP",
    "LayerwiseTuning",
    "ResidencyConfig",
    "ResidencyMode",
    "group_of",
]

_T = TypeVar("_T")

# Accepted input forms for the selector maps (checked at runtime too).
_Spec = str | list[str] | tuple[str, ...] | Mapping[str, object] | None


class ResidencyMode(enum.Enum):
    """Where a component's weights live between uses."""

    RESIDENT = "resident"
    #: Resident, in a virtual-memory arena whose addresses survive sleep and wake (CUDA graphs
    #: captured on it replay after a wake): :mod:`strategies.devices._vmm`.
    RESIDENT_STABLE = "resident-stable"
    COMPONENT_OFFLOAD = "component-offload"
    SNAPSHOT_OFFLOAD = "snapshot-offload"
    LAYERWISE_OFFLOAD = "layerwise-offload"


RESIDENCY_POLICIES: tuple[str, ...] = ("leading", "strided", "first_last")
# A policy may also be a callable over ``(index, name, bytes)`` of each layer (definition
# order across the block lists, the layer's dotted name, its bytes) returning whether it is
# resident: :class:`LayerwiseTuning` calls it once per layer when the strategy is built.
LayerPicker = Callable[[int, str, int], bool]
Policy = str | LayerPicker
DIT_GROUP: tuple[str, ...] = (
    "transformer",
    "transformer_2",
    "video_dit",
    "video_dit_2",
    "audio_dit",
)
VAE_GROUP: tuple[str, ...] = ("vae", "video_vae", "audio_vae")

_ALL = "all"
_GROUPS: tuple[str, ...] = (_ALL, "dit", "image_encoder", "text_encoder", "vae")
_MODES_OPTION = "Component residency"
_MODE_CHOICES: tuple[str, ...] = tuple(sorted(mode.value for mode in ResidencyMode))
# Names other tools use for our modes: hinted at, never accepted silently.
_MODE_ALIASES: Mapping[str, str] = {
    "gpu": ResidencyMode.RESIDENT.value,
    "cpu-offload": ResidencyMode.COMPONENT_OFFLOAD.value,
    "offload": ResidencyMode.COMPONENT_OFFLOAD.value,
    "layerwise": ResidencyMode.LAYERWISE_OFFLOAD.value,
    "layer-wise": ResidencyMode.LAYERWISE_OFFLOAD.value,
    "snapshot": ResidencyMode.SNAPSHOT_OFFLOAD.value,
}


def _normalise_selector(name: str) -> str:
    return name.strip().replace("-", "_").lower()


def group_of(component: str) -> str | None:
    """Return the group (``dit``, ``text_encoder``, ``image_encoder``, ``vae``) of a component."""
    name = _normalise_selector(component)
    if name in DIT_GROUP:
        return "dit"
    if name in VAE_GROUP:
        return "vae"
    for group in ("text_encoder", "image_encoder"):
        if name.startswith(group) or name.endswith(group):
            return group
    return None


def _closest(
    word: str, choices: Iterable[str], aliases: Mapping[str, str] | None = None
) -> str | None:
    if aliases and word in aliases:
        return aliases[word]
    matches = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return matches[0] if matches else None


def _check_number(option: str, value: float, component: str | None = None) -> float:
    where = f" for {component!r}" if component is not None else ""
    number = float(value)
    if not math.isfinite(number):
        raise ValueError(f"{option}{where} must be a finite number, got {number}")
    if number < 0:
        raise ValueError(f"{option}{where} must be non-negative, got {number}")
    return number


def _check_policy(policy: Policy, component: str | None = None) -> Policy:
    if callable(policy) or policy in RESIDENCY_POLICIES:
        return policy
    where = f" for component {component!r}" if component is not None else ""
    message = (f"unknown residency policy {policy!r}{where}, expected one of "
               f"{RESIDENCY_POLICIES} or a callable (index, name, bytes) -> bool")
    hint = _closest(str(policy), RESIDENCY_POLICIES)
    raise ValueError(message + (f"; did you mean {hint!r}?" if hint else ""))


@dataclasses.dataclass(frozen=True)
class LayerwiseTuning:
    """How one layerwise-offloaded component streams its layers.

    ``prefetch``: how many streamed layers are copied ahead of the one running. ``0`` is no
    read-ahead at all (each layer is copied when its forward starts: one layer at a time);
    a value strictly between 0 and 1 is a ratio of the layer count (``1 + round(p * (n -
    1))``); 1 or more is a count (truncated). ``resident_layers`` below 1 is a ratio,
    otherwise a count of layers kept on the device for the whole use; ``policy`` picks which
    layers those are: ``leading``, ``strided``, ``first_last`` (half of them from each end,
    the extra one first; with ``resident_layers`` 0, the first and the last layer), or a
    callable over each layer's ``(index, name, bytes)`` returning whether it is resident
    (``resident_layers`` is then not used).
    """

    prefetch: float = 1.0
    resident_layers: float = 0.0
    policy: Policy = "leading"

    def __post_init__(self) -> None:
        resident = _check_number("resident_layers", self.resident_layers)
        object.__setattr__(self, "prefetch", _check_number("prefetch", self.prefetch))
        object.__setattr__(self, "resident_layers", resident)
        _check_policy(self.policy)

    def pick(self, layers: Sequence[tuple[str, int]]) -> frozenset[int] | None:
        """A callable policy's resident layers: the indices of ``layers`` (``(name,
        bytes)`` in definition order) it returns True for; None for a named policy.

        Raises ``ValueError`` naming the layer when the callable raises or returns anything
        but a bool."""
        picker = self.policy
        if not callable(picker):
            return None
        picked: set[int] = set()
        for index, (name, nbytes) in enumerate(layers):
            try:
                answer = picker(index, name, nbytes)
            except Exception as exc:
                raise ValueError(f"residency policy {_name_of(picker)} raised for layer "
                                 f"{index} ({name!r}): {type(exc).__name__}: {exc}") from None
            if not isinstance(answer, bool):
                raise ValueError(f"residency policy {_name_of(picker)} must return a bool "
                                 f"for layer {index} ({name!r}), got {answer!r}")
            if answer:
                picked.add(index)
        return frozenset(picked)

    def resolve(self, num_layers: int, picked: Iterable[int] | None = None
                ) -> tuple[int, tuple[int, ...]]:
        """Return ``(prefetch_count, resident_layer_indices)`` for a block list of ``num_layers``.

        ``picked``: with a callable policy, the positions it picked (see :meth:`pick`). The
        prefetch count never exceeds the number of streamed layers (0 when none is).
        """
        if num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {num_layers}")
        if callable(self.policy):
            if picked is None:
                raise ValueError("a callable residency policy needs the layers it picked")
            resident = tuple(sorted(p for p in set(picked) if 0 <= p < num_layers))
        else:
            resident = self._resident_indices(num_layers)
        streamed = num_layers - len(resident)
        if self.prefetch == 0:
            wanted = 0  # no read-ahead: one streamed layer on the device at a time
        elif self.prefetch < 1:
            wanted = 1 + round(self.prefetch * (num_layers - 1))
        else:
            wanted = int(self.prefetch)
        return min(wanted, streamed), resident

    def _resident_count(self, n: int) -> int:
        r = self.resident_layers
        if r <= 0:
            return 0
        if r < 1:
            return max(1, round(r * n))
        return min(n, int(r))

    def _resident_indices(self, n: int) -> tuple[int, ...]:
        count = self._resident_count(n)
        if self.policy == "first_last":
            count = count or min(2, n)
            front = (count + 1) // 2
            return tuple(range(front)) + tuple(range(n - (count - front), n))
        if self.policy == "leading" or count in (0, n):
            return tuple(range(count))
        # Consecutive values i*n/s (s streamed layers) are more than 1 apart when count > 0,
        # so their roundings are distinct and the largest, round(n - n/s), is at most n - 1:
        # exactly s streamed indices, hence exactly `count` resident ones.
        streamed_count = n - count
        streamed = {round(i * n / streamed_count) for i in range(streamed_count)}
        return tuple(index for index in range(n) if index not in streamed)


def _name_of(picker: LayerPicker) -> str:
    return repr(getattr(picker, "__name__", type(picker).__name__))


def _entries(value: object, option: str) -> list[tuple[str, object]]:
    """Flatten any accepted input form into raw ``(selector, value)`` pairs."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            try:
                return _entries(json.loads(text), option)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{option} is not a valid JSON object: {exc}") from None
        return [_split_entry(piece.strip(), option) for piece in text.split(",") if piece.strip()]
    if isinstance(value, (list, tuple)):
        pairs: list[tuple[str, object]] = []
        for item in value:
            if not isinstance(item, str):
                raise TypeError(f"{option} list entries must be strings, got {item!r}")
            pairs.extend(_entries(item, option))
        return pairs
    if isinstance(value, Mapping):
        return [(str(key), item) for key, item in value.items()]
    raise TypeError(
        f"{option} must be None, a 'component=value[,...]' string, a JSON object string, "
        f"a list or tuple of such strings, or a mapping; got {type(value).__name__}"
    )


def _split_entry(entry: str, option: str) -> tuple[str, object]:
    selector, sep, value = entry.partition("=")
    if not sep:
        usage = "COMPONENT=MODE" if option == _MODES_OPTION else "component=value entries"
        raise ValueError(f"{option} must use {usage}, got {entry!r}")
    return selector, value


def _selector_map(
    value: object, option: str, convert: Callable[[str, object], _T]
) -> dict[str, _T]:
    """Normalise selectors, refuse duplicates and convert every value, all before returning."""
    result: dict[str, _T] = {}
    spelled: dict[str, str] = {}
    pairs = value if option == _LAYERS_OPTION else _entries(value, option)
    assert isinstance(pairs, list)
    for raw_selector, raw_value in pairs:
        selector = _normalise_selector(raw_selector)
        if not selector:
            raise ValueError(f"{option} selector cannot be empty")
        if selector in result:
            raise ValueError(
                f"duplicate residency selector {selector!r} in {option.lower()} "
                f"(given as {spelled[selector]!r} and {raw_selector.strip()!r})"
            )
        spelled[selector] = raw_selector.strip()
        result[selector] = convert(selector, raw_value)
    return result


def _to_mode(selector: str, raw: object) -> ResidencyMode:
    if isinstance(raw, ResidencyMode):
        return raw
    text = str(raw).strip().replace("_", "-").lower()
    try:
        return ResidencyMode(text)
    except ValueError:
        message = (
            f"Invalid component residency mode {text!r} for {selector!r}; "
            f"expected one of: {', '.join(_MODE_CHOICES)}"
        )
        hint = _closest(text, _MODE_CHOICES, _MODE_ALIASES)
        raise ValueError(message + (f" (did you mean {hint!r}?)" if hint else "")) from None


def _to_number(option: str, selector: str, raw: object) -> float:
    number: float | None = None
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        number = float(raw)
    elif isinstance(raw, str):
        with contextlib.suppress(ValueError):
            number = float(raw)
    if number is None:
        raise ValueError(f"{option} for {selector!r} must be a number, got {raw!r}")
    return _check_number(option, number, selector)


def _to_policy(selector: str, raw: object) -> Policy:
    if callable(raw):
        return _check_policy(raw, selector)
    return _check_policy(str(raw).strip().lower(), selector)


_LAYERS_OPTION = "layers"


def _layer_entries(value: object) -> list[tuple[str, object]]:
    """``layers`` entries: like the other maps, but a value may name several block lists.

    In a string, an entry without ``=`` continues the previous selector's list, so
    ``"transformer=transformer_blocks,single_transformer_blocks,vae=decoder.up_blocks"``
    reads as written; ``+`` also separates names. A mapping's value may be a list."""
    if isinstance(value, str) and not value.strip().startswith("{"):
        pairs: list[tuple[str, object]] = []
        for piece in (p.strip() for p in value.split(",")):
            if not piece:
                continue
            if "=" in piece:
                pairs.append(_split_entry(piece, _LAYERS_OPTION))
            elif pairs:
                selector, names = pairs[-1]
                pairs[-1] = (selector, f"{names}+{piece}")
            else:
                raise ValueError(f"layers must start with COMPONENT=BLOCK_LIST, got {piece!r}")
        return pairs
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return _layer_entries(",".join(value))
    return _entries(value, _LAYERS_OPTION)


def _to_layers(selector: str, raw: object) -> tuple[str, ...]:
    items = raw.split("+") if isinstance(raw, str) else raw
    if not isinstance(items, (list, tuple)) or not all(isinstance(n, str) for n in items):
        raise ValueError(f"layers for {selector!r} must be block-list names (strings), got {raw!r}")
    names = tuple(n.strip() for n in items if n.strip())
    if not names:
        raise ValueError(f"layers for {selector!r} names no block list")
    if len(set(names)) != len(names):
        raise ValueError(f"layers for {selector!r} names a block list twice: {list(names)}")
    return names


def _parse_layers(value: object) -> Mapping[str, tuple[str, ...]]:
    if isinstance(value, Mapping) and not value:
        return MappingProxyType({})
    return MappingProxyType(_selector_map(_layer_entries(value), _LAYERS_OPTION, _to_layers))


def _parse_modes(value: object) -> Mapping[str, ResidencyMode]:
    return MappingProxyType(_selector_map(value, _MODES_OPTION, _to_mode))


def _parse_numbers(value: object, option: str) -> Mapping[str, float]:
    return MappingProxyType(_selector_map(value, option, functools.partial(_to_number, option)))


def _parse_policies(value: object) -> Mapping[str, Policy]:
    return MappingProxyType(_selector_map(value, "policy", _to_policy))


def _lookup(mapping: Mapping[str, _T], component: str, default: _T) -> _T:
    name = _normalise_selector(component)
    for selector in (name, group_of(name), _ALL):
        if selector is not None and selector in mapping:
            return mapping[selector]
    return default


@dataclasses.dataclass(frozen=True)
class ResidencyConfig:
    """Per-component residency modes and layerwise tuning, keyed by selector.

    Build one with :meth:`parse`; direct construction normalises and validates the same way.
    The mappings are read-only views, so a config is immutable and hashable.
    """

    modes: Mapping[str, ResidencyMode] = dataclasses.field(default_factory=dict)
    prefetch: Mapping[str, float] = dataclasses.field(default_factory=dict)
    resident_layers: Mapping[str, float] = dataclasses.field(default_factory=dict)
    policy: Mapping[str, Policy] = dataclasses.field(default_factory=dict)
    layers: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "modes", _parse_modes(self.modes))
        resident = _parse_numbers(self.resident_layers, "resident_layers")
        object.__setattr__(self, "prefetch", _parse_numbers(self.prefetch, "prefetch"))
        object.__setattr__(self, "resident_layers", resident)
        object.__setattr__(self, "policy", _parse_policies(self.policy))
        object.__setattr__(self, "layers", _parse_layers(self.layers))

    def __hash__(self) -> int:
        return hash(tuple(frozenset(mapping.items()) for mapping in self._maps().values()))

    def _maps(self) -> dict[str, Mapping[str, object]]:
        return {
            "modes": self.modes,
            "prefetch": self.prefetch,
            "resident_layers": self.resident_layers,
            "policy": self.policy,
            "layers": self.layers,
        }

    @classmethod
    def parse(
        cls,
        value: ResidencyConfig | _Spec = None,
        *,
        prefetch: _Spec = None,
        resident_layers: _Spec = None,
        policy: _Spec = None,
        layers: _Spec = None,
    ) -> ResidencyConfig:
        """Build a config from ``COMPONENT=MODE`` entries and per-component tuning maps.

        Each argument may be None, ``"a=b,c=d"``, a list or tuple of such strings, a mapping
        or a JSON object string. A ``ResidencyConfig`` is returned unchanged, or with the
        tuning maps that are given replacing its own.
        """
        kept = value if isinstance(value, ResidencyConfig) else cls()
        if kept is value and prefetch is None and resident_layers is None and policy is None \
                and layers is None:
            return kept
        return cls(
            modes=kept.modes if kept is value else _parse_modes(value),
            prefetch=kept.prefetch if prefetch is None else _parse_numbers(prefetch, "prefetch"),
            resident_layers=(
                kept.resident_layers
                if resident_layers is None
                else _parse_numbers(resident_layers, "resident_layers")
            ),
            policy=kept.policy if policy is None else _parse_policies(policy),
            layers=kept.layers if layers is None else _parse_layers(layers),
        )

    def mode_for(self, component: str) -> ResidencyMode:
        """Return the mode of a component: exact name > group > ``all`` > ``resident``."""
        return _lookup(self.modes, component, ResidencyMode.RESIDENT)

    def without(self, component: str) -> ResidencyConfig:
        """This config less the exact selector of ``component`` in every map (groups and
        ``all`` stay): what is left once the component is removed."""
        name = _normalise_selector(component)
        if name in _GROUPS:
            return self
        maps = {option: {k: v for k, v in mapping.items() if k != name}
                for option, mapping in self._maps().items()}
        return ResidencyConfig(**maps)  # type: ignore[arg-type]

    def names_mode_of(self, component: str) -> bool:
        """Whether a selector of :attr:`modes` (exact, group or ``all``) reaches ``component``
        (else :meth:`mode_for` is the default)."""
        name = _normalise_selector(component)
        return any(s is not None and s in self.modes for s in (name, group_of(name), _ALL))

    def layerwise_tuning_for(self, component: str) -> LayerwiseTuning:
        """Return a component's layerwise tuning, each setting resolved like :meth:`mode_for`."""
        defaults = LayerwiseTuning()
        return LayerwiseTuning(
            prefetch=_lookup(self.prefetch, component, defaults.prefetch),
            resident_layers=_lookup(self.resident_layers, component, defaults.resident_layers),
            policy=_lookup(self.policy, component, defaults.policy),
        )

    def layers_for(self, component: str) -> tuple[str, ...] | None:
        """The block lists a layerwise component streams, if configured (else detected)."""
        return _lookup(self.layers, component, None)

    def validate_components(self, names: Iterable[str]) -> None:
        """Raise ``ValueError`` if an exact selector names none of the given components."""
        components = sorted(names)
        known = {_normalise_selector(name) for name in components}
        for option, mapping in self._maps().items():
            where = "" if option == "modes" else f" in {option}"
            for selector in sorted(mapping):
                if selector in _GROUPS or selector in known:
                    continue
                message = (
                    f"residency selector {selector!r}{where} matches no component; "
                    f"components: {components}; groups: {', '.join(_GROUPS)}"
                )
                hint = _closest(selector, sorted(known | set(_GROUPS)))
                raise ValueError(message + (f"; did you mean {hint!r}?" if hint else ""))
        for selector in sorted(self.layers):
            if selector in known and self.mode_for(selector) is not ResidencyMode.LAYERWISE_OFFLOAD:
                raise ValueError(
                    f"layers are given for component {selector!r}, but its mode is "
                    f"{self.mode_for(selector).value}; layers apply to layerwise-offload only")

    def to_string(self) -> str:
        """Return the canonical ``sel=mode,...`` form of the modes, sorted by selector."""
        return ",".join(f"{name}={self.modes[name].value}" for name in sorted(self.modes))
