"""Tests for residency configuration: parsing, selectors, precedence and layer resolution."""

from __future__ import annotations

import dataclasses
import re
from types import MappingProxyType

import pytest
from hypothesis import given
from hypothesis import strategies as st

from strategies._config import (
    DIT_GROUP,
    RESIDENCY_POLICIES,
    VAE_GROUP,
    LayerwiseTuning,
    ResidencyConfig,
    ResidencyMode,
    group_of,
)

pytestmark = pytest.mark.moves

MODES = "component-offload, layerwise-offload, resident, resident-stable, snapshot-offload"
GROUPS = "groups: all, dit, image_encoder, text_encoder, vae"
EXPECTED_MODES = {
    "vae": ResidencyMode.COMPONENT_OFFLOAD,
    "transformer": ResidencyMode.LAYERWISE_OFFLOAD,
}


def raises_exactly(message: str) -> pytest.RaisesExc[ValueError]:
    """Expect a ValueError whose whole message is ``message``."""
    return pytest.raises(ValueError, match=f"^{re.escape(message)}$")


# --- constants and groups -------------------------------------------------------------


def test_mode_values_are_the_documented_names() -> None:
    """Each mode's value is the spelling used on the command line."""
    assert [mode.value for mode in ResidencyMode] == [
        "resident",
        "resident-stable",
        "component-offload",
        "snapshot-offload",
        "layerwise-offload",
    ]


def test_policies_and_groups_are_the_documented_tuples() -> None:
    """The policy and group constants hold exactly the documented names."""
    assert RESIDENCY_POLICIES == ("leading", "strided", "first_last")
    assert DIT_GROUP == ("transformer", "transformer_2", "video_dit", "video_dit_2", "audio_dit")
    assert VAE_GROUP == ("vae", "video_vae", "audio_vae")


@pytest.mark.parametrize(
    ("component", "group"),
    [
        ("transformer", "dit"),
        ("transformer_2", "dit"),
        ("video_dit", "dit"),
        ("audio_dit", "dit"),
        ("text_encoder", "text_encoder"),
        ("text_encoder_2", "text_encoder"),
        ("clip_text_encoder", "text_encoder"),
        ("image_encoder", "image_encoder"),
        ("siglip_image_encoder", "image_encoder"),
        ("vae", "vae"),
        ("video_vae", "vae"),
        ("audio_vae", "vae"),
        ("Video-VAE", "vae"),
        ("scheduler", None),
        ("transformer_3", None),
        ("my_text_encoder_wrapper", None),
    ],
)
def test_group_of_classifies_component_names(component: str, group: str | None) -> None:
    """Components fall into the dit, text_encoder, image_encoder or vae group, or none."""
    assert group_of(component) == group


# --- input forms ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "vae=component-offload,transformer=layerwise-offload",
        " vae = component-offload , transformer=layerwise-offload ,",
        ["vae=component-offload", "transformer=layerwise-offload"],
        ("vae=component-offload,transformer=layerwise-offload",),
        {"vae": "component-offload", "transformer": ResidencyMode.LAYERWISE_OFFLOAD},
        '{"vae": "component-offload", "transformer": "layerwise-offload"}',
    ],
)
def test_every_input_form_parses_to_the_same_modes(value: object) -> None:
    """Strings, lists, tuples, mappings and JSON objects all give the same modes."""
    config = ResidencyConfig.parse(value)  # type: ignore[arg-type]
    assert dict(config.modes) == EXPECTED_MODES


@pytest.mark.parametrize("value", [None, "", "  ", [], {}, "{}"])
def test_empty_inputs_give_an_empty_config(value: object) -> None:
    """None, empty strings, lists, mappings and JSON objects mean no selectors at all."""
    assert ResidencyConfig.parse(value) == ResidencyConfig()  # type: ignore[arg-type]


def test_parse_returns_a_config_unchanged_without_tuning() -> None:
    """A ResidencyConfig given to parse comes back as the very same object."""
    config = ResidencyConfig.parse("vae=resident", prefetch="dit=2")
    assert ResidencyConfig.parse(config) is config


def test_parse_replaces_only_the_tuning_maps_given_with_a_config() -> None:
    """Tuning keywords given with a config replace those maps and keep the rest."""
    config = ResidencyConfig.parse("vae=resident", prefetch="dit=2", policy="dit=strided")
    updated = ResidencyConfig.parse(config, resident_layers="dit=3")
    assert dict(updated.modes) == {"vae": ResidencyMode.RESIDENT}
    assert dict(updated.prefetch) == {"dit": 2.0}
    assert dict(updated.resident_layers) == {"dit": 3.0}
    assert dict(updated.policy) == {"dit": "strided"}


def test_list_entries_may_hold_several_comma_separated_entries() -> None:
    """Each list element is split on commas like a plain string."""
    config = ResidencyConfig.parse(
        ["vae=resident,dit=layerwise-offload", "text_encoder=snapshot-offload"]
    )
    assert dict(config.modes) == {
        "vae": ResidencyMode.RESIDENT,
        "dit": ResidencyMode.LAYERWISE_OFFLOAD,
        "text_encoder": ResidencyMode.SNAPSHOT_OFFLOAD,
    }


@pytest.mark.parametrize("value", [5, 1.5, b"vae=resident", {"vae"}])
def test_unsupported_input_types_raise_type_error_naming_the_forms(value: object) -> None:
    """Anything but None, a string, a list, a tuple or a mapping is a TypeError."""
    with pytest.raises(TypeError, match="must be None, a 'component=value"):
        ResidencyConfig.parse(value)  # type: ignore[arg-type]


def test_non_string_list_entries_raise_type_error() -> None:
    """A list may only hold strings."""
    with pytest.raises(TypeError, match=re.escape("list entries must be strings, got 3")):
        ResidencyConfig.parse(["vae=resident", 3])  # type: ignore[list-item]


def test_tuning_maps_accept_every_input_form() -> None:
    """Tuning maps take strings, lists, mappings and JSON objects, numbers or numeric text."""
    config = ResidencyConfig.parse(
        prefetch='{"dit": 0.5, "vae": "2"}',
        resident_layers=["transformer=3", "video-dit=0.25"],
        policy={"DIT": " Strided "},
    )
    assert dict(config.prefetch) == {"dit": 0.5, "vae": 2.0}
    assert dict(config.resident_layers) == {"transformer": 3.0, "video_dit": 0.25}
    assert dict(config.policy) == {"dit": "strided"}


# --- normalisation --------------------------------------------------------------------


def test_selectors_and_modes_are_normalised() -> None:
    """Selectors become lowercase with underscores; modes lowercase with dashes."""
    config = ResidencyConfig.parse(" Text-Encoder-2 = COMPONENT_OFFLOAD , VAE=Snapshot_Offload")
    assert dict(config.modes) == {
        "text_encoder_2": ResidencyMode.COMPONENT_OFFLOAD,
        "vae": ResidencyMode.SNAPSHOT_OFFLOAD,
    }


def test_entries_split_on_the_first_equals_sign() -> None:
    """Only the first '=' separates selector from value, so the rest belongs to the value."""
    with raises_exactly(
        f"Invalid component residency mode 'resident=x' for 'vae'; expected one of: {MODES}"
        " (did you mean 'resident'?)"
    ):
        ResidencyConfig.parse("vae=resident=x")


def test_to_string_is_canonical_and_round_trips() -> None:
    """to_string sorts selectors and parses back to an equal config."""
    config = ResidencyConfig.parse("VAE=component_offload, all=resident ,dit=layerwise-offload")
    text = config.to_string()
    assert text == "all=resident,dit=layerwise-offload,vae=component-offload"
    assert ResidencyConfig.parse(text) == config


def test_direct_construction_normalises_and_validates_like_parse() -> None:
    """Building a ResidencyConfig directly applies the same normalisation and checks."""
    config = ResidencyConfig(modes={"Video-VAE": "Resident"})  # type: ignore[dict-item]
    assert config == ResidencyConfig.parse("video_vae=resident")
    with raises_exactly("prefetch for 'dit' must be non-negative, got -2.0"):
        ResidencyConfig(prefetch={"dit": -2})


# --- precedence -----------------------------------------------------------------------


def test_default_mode_is_resident() -> None:
    """A component no selector matches is resident."""
    assert ResidencyConfig.parse().mode_for("transformer") is ResidencyMode.RESIDENT


def test_exact_selector_beats_group_and_all() -> None:
    """An exact component name wins over its group and over all."""
    config = ResidencyConfig.parse(
        "all=snapshot-offload,dit=component-offload,transformer_2=layerwise-offload"
    )
    assert config.mode_for("transformer_2") is ResidencyMode.LAYERWISE_OFFLOAD
    assert config.mode_for("transformer") is ResidencyMode.COMPONENT_OFFLOAD
    assert config.mode_for("scheduler") is ResidencyMode.SNAPSHOT_OFFLOAD


def test_group_selectors_reach_every_member() -> None:
    """Group selectors apply to every component of their group."""
    config = ResidencyConfig.parse(
        "text_encoder=component-offload,image_encoder=snapshot-offload,vae=layerwise-offload"
    )
    assert config.mode_for("clip_text_encoder") is ResidencyMode.COMPONENT_OFFLOAD
    assert config.mode_for("text_encoder_2") is ResidencyMode.COMPONENT_OFFLOAD
    assert config.mode_for("image_encoder") is ResidencyMode.SNAPSHOT_OFFLOAD
    assert config.mode_for("video_vae") is ResidencyMode.LAYERWISE_OFFLOAD
    assert config.mode_for("transformer") is ResidencyMode.RESIDENT


def test_component_names_are_normalised_for_lookup() -> None:
    """A component spelled with dashes or capitals finds its selector."""
    config = ResidencyConfig.parse("text_encoder_2=component-offload")
    assert config.mode_for("Text-Encoder-2") is ResidencyMode.COMPONENT_OFFLOAD


def test_layerwise_tuning_defaults() -> None:
    """Without tuning maps a component gets prefetch 1, no resident layers, leading."""
    assert ResidencyConfig.parse().layerwise_tuning_for("transformer") == LayerwiseTuning(
        prefetch=1.0, resident_layers=0.0, policy="leading"
    )


def test_layerwise_tuning_resolves_each_map_with_the_same_precedence() -> None:
    """Each tuning setting is looked up exact > group > all on its own."""
    config = ResidencyConfig.parse(
        prefetch="all=3,dit=2,transformer=0.5",
        resident_layers="dit=4",
        policy="all=strided",
    )
    assert config.layerwise_tuning_for("transformer") == LayerwiseTuning(0.5, 4.0, "strided")
    assert config.layerwise_tuning_for("video_dit") == LayerwiseTuning(2.0, 4.0, "strided")
    assert config.layerwise_tuning_for("vae") == LayerwiseTuning(3.0, 0.0, "strided")


# --- error messages -------------------------------------------------------------------


def test_entry_without_equals_is_rejected() -> None:
    """A mode entry must be COMPONENT=MODE."""
    with raises_exactly("Component residency must use COMPONENT=MODE, got 'vae'"):
        ResidencyConfig.parse("dit=resident, vae")


def test_empty_selector_is_rejected() -> None:
    """A mode entry needs a selector before '='."""
    with raises_exactly("Component residency selector cannot be empty"):
        ResidencyConfig.parse(" =resident")


def test_unknown_mode_without_close_match_lists_the_modes() -> None:
    """An unknown mode names the entry and every valid mode."""
    with raises_exactly(
        f"Invalid component residency mode 'bogus' for 'vae'; expected one of: {MODES}"
    ):
        ResidencyConfig.parse("vae=bogus")


@pytest.mark.parametrize(
    ("mode", "shown", "hint"),
    [
        ("resdent", "resdent", "resident"),
        ("component_offlod", "component-offlod", "component-offload"),
        ("snapshot-ofload", "snapshot-ofload", "snapshot-offload"),
        ("gpu", "gpu", "resident"),
        ("cpu_offload", "cpu-offload", "component-offload"),
        ("offload", "offload", "component-offload"),
        ("layerwise", "layerwise", "layerwise-offload"),
        ("layer_wise", "layer-wise", "layerwise-offload"),
        ("snapshot", "snapshot", "snapshot-offload"),
    ],
)
def test_unknown_mode_suggests_the_closest_mode(mode: str, shown: str, hint: str) -> None:
    """Typos and other tools' names are hinted at, never accepted."""
    message = (
        f"Invalid component residency mode {shown!r} for 'vae'; expected one of: {MODES}"
        f" (did you mean {hint!r}?)"
    )
    with raises_exactly(message):
        ResidencyConfig.parse(f"vae={mode}")


def test_duplicate_selector_is_rejected() -> None:
    """Two entries that normalise to the same selector are an error, not an override."""
    with pytest.raises(ValueError, match=re.escape("duplicate residency selector 'text_encoder'")):
        ResidencyConfig.parse("text_encoder=resident,Text-Encoder=component-offload")


def test_duplicate_selector_in_a_tuning_map_is_rejected() -> None:
    """Tuning maps refuse duplicate selectors too, naming the map."""
    with raises_exactly(
        "duplicate residency selector 'dit' in prefetch (given as 'dit' and 'DIT')"
    ):
        ResidencyConfig.parse(prefetch={"dit": 1, "DIT": 2})


@pytest.mark.parametrize("option", ["prefetch", "resident_layers", "policy"])
def test_tuning_entry_without_equals_is_rejected(option: str) -> None:
    """A tuning entry must be component=value."""
    with raises_exactly(f"{option} must use component=value entries, got 'dit'"):
        ResidencyConfig.parse(**{option: "dit"})


@pytest.mark.parametrize("option", ["prefetch", "resident_layers"])
@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("abc", "must be a number, got 'abc'"),
        ("", "must be a number, got ''"),
        (True, "must be a number, got True"),
        ([1], "must be a number, got [1]"),
        (-1, "must be non-negative, got -1.0"),
        ("-0.5", "must be non-negative, got -0.5"),
        ("nan", "must be a finite number, got nan"),
        (float("inf"), "must be a finite number, got inf"),
    ],
)
def test_bad_tuning_numbers_are_rejected(option: str, raw: object, message: str) -> None:
    """Tuning numbers must be finite and non-negative numbers."""
    with raises_exactly(f"{option} for 'dit' {message}"):
        ResidencyConfig.parse(**{option: {"dit": raw}})


def test_unknown_policy_without_close_match() -> None:
    """An unknown policy names the selector and the valid policies."""
    with raises_exactly(
        "unknown residency policy 'layerwise' for component 'dit', "
        "expected one of ('leading', 'strided', 'first_last') or a callable "
        "(index, name, bytes) -> bool"
    ):
        ResidencyConfig.parse(policy="dit=layerwise")


@pytest.mark.parametrize(("policy", "hint"), [("stride", "strided"), ("Leadng", "leading")])
def test_unknown_policy_suggests_the_closest_policy(policy: str, hint: str) -> None:
    """A policy typo is hinted at with the closest valid policy."""
    with raises_exactly(
        f"unknown residency policy {policy.lower()!r} for component 'video_dit', "
        "expected one of ('leading', 'strided', 'first_last') or a callable "
        f"(index, name, bytes) -> bool; did you mean {hint!r}?"
    ):
        ResidencyConfig.parse(policy=f"Video-DiT={policy}")


def test_policy_case_and_whitespace_are_normalised_but_underscores_are_not() -> None:
    """'Leading ' is accepted as leading, while 'layer_wise' stays invalid."""
    assert dict(ResidencyConfig.parse(policy="dit=Leading ").policy) == {"dit": "leading"}
    with pytest.raises(ValueError, match="unknown residency policy 'layer_wise'"):
        ResidencyConfig.parse(policy="dit=layer_wise")


def test_invalid_json_is_rejected_with_the_option_name() -> None:
    """A string starting with '{' must be a valid JSON object."""
    with pytest.raises(ValueError, match=r"^resident_layers is not a valid JSON object: "):
        ResidencyConfig.parse(resident_layers='{"dit": 1,}')
    with pytest.raises(ValueError, match=r"^Component residency is not a valid JSON object: "):
        ResidencyConfig.parse("{vae: resident}")


def test_every_entry_is_validated_before_parse_returns() -> None:
    """A bad entry after good ones still fails parse, whichever map it is in."""
    with pytest.raises(ValueError, match="policy 'nope' for component 'vae'"):
        ResidencyConfig.parse("dit=resident", prefetch="dit=1", policy="dit=leading,vae=nope")


# --- validate_components --------------------------------------------------------------


def test_validate_components_accepts_exact_names_groups_and_all() -> None:
    """Exact selectors naming components, groups and all all pass."""
    config = ResidencyConfig.parse(
        "all=resident,dit=layerwise-offload,text_encoder=component-offload,Text-Encoder-2=resident",
        prefetch="transformer=2",
        policy="image_encoder=strided",
    )
    config.validate_components(["transformer", "text_encoder_2", "vae"])


def test_validate_components_rejects_an_unknown_selector_with_a_hint() -> None:
    """An exact selector matching no component names the components, groups and closest name."""
    config = ResidencyConfig.parse("transformr=layerwise-offload")
    with raises_exactly(
        "residency selector 'transformr' matches no component; "
        f"components: ['transformer', 'vae']; {GROUPS}; did you mean 'transformer'?"
    ):
        config.validate_components(["vae", "transformer"])


def test_validate_components_rejects_unknown_tuning_selectors() -> None:
    """Tuning-map selectors are checked too, and the message names the map."""
    config = ResidencyConfig.parse(resident_layers="unet=2")
    with raises_exactly(
        "residency selector 'unet' in resident_layers matches no component; "
        f"components: ['transformer']; {GROUPS}"
    ):
        config.validate_components(["transformer"])


# --- immutability ---------------------------------------------------------------------


def test_config_is_frozen_and_hashable() -> None:
    """Configs cannot be changed, and equal configs hash equally."""
    first = ResidencyConfig.parse("vae=resident", prefetch="dit=2")
    second = ResidencyConfig.parse({"VAE": "resident"}, prefetch={"dit": 2.0})
    assert first == second
    assert hash(first) == hash(second)
    assert first != ResidencyConfig.parse("vae=resident")
    assert isinstance(first.modes, MappingProxyType)
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.modes = {}  # type: ignore[misc]
    with pytest.raises(TypeError):
        first.modes["dit"] = ResidencyMode.RESIDENT  # type: ignore[index]


def test_config_does_not_alias_the_callers_mapping() -> None:
    """Changing the mapping a config was built from does not change the config."""
    source = {"vae": "resident"}
    config = ResidencyConfig.parse(source)
    source["dit"] = "component-offload"
    assert dict(config.modes) == {"vae": ResidencyMode.RESIDENT}


# --- LayerwiseTuning ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefetch", "expected"),
    [
        (0.0, 0),  # no read-ahead
        (0.25, 3),  # 1 + round(2.25)
        (0.5, 5),  # 1 + round(4.5) = 1 + 4 (round half to even)
        (0.99, 10),  # 1 + round(8.91)
        (1.0, 1),
        (2.0, 2),
        (2.9, 2),  # counts are truncated
        (50.0, 10),  # clamped to the streamed layers
    ],
)
def test_prefetch_resolves_ratios_and_counts(prefetch: float, expected: int) -> None:
    """Prefetch 0 reads nothing ahead, strictly between 0 and 1 it is a ratio of n - 1
    plus one layer, otherwise a count (n=10)."""
    assert LayerwiseTuning(prefetch=prefetch).resolve(10) == (expected, ())


@pytest.mark.parametrize(
    ("resident", "expected"),
    [
        (0.0, ()),
        (0.05, (0,)),  # max(1, round(0.5)) = max(1, 0)
        (0.25, (0, 1)),  # round(2.5) = 2 (round half to even)
        (0.35, (0, 1, 2, 3)),  # round(3.5) = 4
        (3.7, (0, 1, 2)),  # counts are truncated
        (20.0, tuple(range(10))),  # clamped to n
    ],
)
def test_leading_resident_layers_are_the_first_ones(
    resident: float, expected: tuple[int, ...]
) -> None:
    """The leading policy keeps layers 0 .. r-1 resident (n=10)."""
    assert LayerwiseTuning(resident_layers=resident).resolve(10)[1] == expected


@pytest.mark.parametrize(
    ("n", "resident", "expected"),
    [
        (8, 4.0, (1, 3, 5, 7)),  # streamed 0, 2, 4, 6
        (10, 2.0, (3, 7)),  # streamed round(i * 10 / 8): 0, 1, 2, 4, 5, 6, 8, 9
        (10, 3.0, (2, 5, 8)),
        (10, 0.05, (5,)),
        (4, 4.0, (0, 1, 2, 3)),
        (4, 0.0, ()),
    ],
)
def test_strided_policy_spreads_resident_layers(
    n: int, resident: float, expected: tuple[int, ...]
) -> None:
    """The strided policy spreads resident layers evenly between streamed ones."""
    assert LayerwiseTuning(resident_layers=resident, policy="strided").resolve(n)[1] == expected


def test_prefetch_is_zero_when_every_layer_is_resident() -> None:
    """Nothing is prefetched when no layer is streamed."""
    assert LayerwiseTuning(prefetch=3, resident_layers=6).resolve(6) == (0, tuple(range(6)))


def test_prefetch_is_clamped_to_the_streamed_layers() -> None:
    """Prefetch never exceeds the number of streamed layers."""
    assert LayerwiseTuning(prefetch=8, resident_layers=7).resolve(10) == (3, tuple(range(7)))


def test_resolve_rejects_an_empty_block_list() -> None:
    """A block list needs at least one layer."""
    with raises_exactly("num_layers must be at least 1, got 0"):
        LayerwiseTuning().resolve(0)


def test_layerwise_tuning_validates_its_fields() -> None:
    """Direct construction rejects negative or non-finite numbers and unknown policies."""
    with raises_exactly("prefetch must be non-negative, got -1.0"):
        LayerwiseTuning(prefetch=-1)
    with raises_exactly("resident_layers must be a finite number, got nan"):
        LayerwiseTuning(resident_layers=float("nan"))
    with raises_exactly(
        "unknown residency policy 'stride', expected one of ('leading', 'strided', "
        "'first_last') or a callable (index, name, bytes) -> bool; did you mean 'strided'?"
    ):
        LayerwiseTuning(policy="stride")


@given(
    data=st.data(),
    n=st.integers(min_value=1, max_value=200),
    policy=st.sampled_from(RESIDENCY_POLICIES),
    prefetch=st.floats(min_value=0, max_value=300, allow_nan=False),
)
def test_resolve_keeps_exactly_r_sorted_unique_resident_layers(
    data: st.DataObject, n: int, policy: str, prefetch: float
) -> None:
    """For any n and integer r <= n, exactly r distinct in-range layers stay, sorted
    (first_last with r = 0: the first and the last)."""
    r = data.draw(st.integers(min_value=0, max_value=n), label="r")
    count, resident = LayerwiseTuning(prefetch, float(r), policy).resolve(n)
    kept = min(2, n) if policy == "first_last" and r == 0 else r
    assert len(resident) == kept
    assert list(resident) == sorted(set(resident))
    assert all(0 <= index < n for index in resident)
    assert 0 <= count <= n - kept
    assert (count == 0) == (kept == n or prefetch == 0)


def test_a_callable_policy_passes_through_parse_and_picks_by_index_name_and_bytes() -> None:
    """A callable given in the policy map is kept as it is; pick asks it for every layer and
    resolve keeps the positions it picked."""

    def odd(index: int, name: str, nbytes: int) -> bool:
        return index % 2 == 1

    tuning = ResidencyConfig.parse(policy={"dit": odd}).layerwise_tuning_for("transformer")
    assert tuning.policy is odd
    picked = tuning.pick([("blocks.0", 8), ("blocks.1", 8), ("blocks.2", 8), ("blocks.3", 8)])
    assert picked == frozenset({1, 3})
    assert tuning.resolve(4, picked) == (1, (1, 3))
    assert LayerwiseTuning().pick([("blocks.0", 8)]) is None


def test_a_callable_policy_needs_its_picks_and_answers_bools() -> None:
    """resolve without the picks of a callable policy, and a callable answering a non-bool,
    are refused naming what is wrong."""
    tuning = LayerwiseTuning(policy=lambda i, n, b: 1)  # type: ignore[arg-type, return-value]
    with raises_exactly("a callable residency policy needs the layers it picked"):
        tuning.resolve(4)
    with raises_exactly("residency policy '<lambda>' must return a bool for layer 0 "
                        "('blocks.0'), got 1"):
        tuning.pick([("blocks.0", 8)])


@pytest.mark.parametrize(("n", "resident", "expected"), [
    (1, 0.0, (0,)),
    (2, 0.0, (0, 1)),
    (6, 0.0, (0, 5)),
    (6, 1.0, (0,)),
    (6, 4.0, (0, 1, 4, 5)),
    (6, 5.0, (0, 1, 2, 4, 5)),
])
def test_first_last_takes_half_from_each_end(n: int, resident: float,
                                            expected: tuple[int, ...]) -> None:
    """first_last: the first and the last layer by default, else half of resident_layers
    from each end, the extra one at the front."""
    assert LayerwiseTuning(resident_layers=resident, policy="first_last").resolve(n)[1] == expected
