"""Scripted drills: the shipped scenarios pass, bad scenarios are refused before anything
runs (naming the step and the valid choices), and the report tells failures apart."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from lifecycle.cli.drills import (
    SCHEMA,
    DrillReport,
    ScenarioError,
    StepOutcome,
    default_scenario,
    load_scenario,
    parse_scenario,
    run_drill,
)

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

DRILLS = Path(__file__).resolve().parents[2] / "scripts" / "drills"
SIZE = "4MB"


def _scenario(*steps: dict[str, Any], **drill: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"steps": list(steps)}
    if drill:
        data["drill"] = drill
    return data


# -- the shipped scenarios -------------------------------------------------------------

def _check_rl_loop(report: DrillReport) -> None:
    updates = [o for o in report.outcomes if o.step == "update"]
    assert len(updates) == 5 and all(o.ok and o.bytes_moved > 0 for o in updates)


def _check_faults(report: DrillReport) -> None:
    """The fault drill passes because the failures it expects really happen."""
    failed = [(o.step, o.phase) for o in report.outcomes if not o.ok]
    assert ("sleep", "awake") in failed and ("wake", "sleeping") in failed
    assert any(step == "update" for step, _ in failed)


def _check_rl_discard(report: DrillReport) -> None:
    """After the first (which fills the mirrors of the components it keeps), a discarding
    release copies nothing; the generations it expects to be refused really are."""
    sleeps = [o for o in report.outcomes if o.step == "sleep"]
    assert len(sleeps) == 3 and all(o.ok for o in sleeps)
    assert [o.bytes_moved for o in sleeps[1:]] == [0, 0]
    refused = [o for o in report.outcomes if o.step == "generate" and not o.ok]
    assert len(refused) == 6 and all("Update weights first" in o.message for o in refused)


@pytest.mark.parametrize("name", ["basic", "rl_loop", "faults", "rl_discard"])
async def test_example_scenario_passes(name: str) -> None:
    """Each shipped scenario passes with every expectation met, and rl_loop, faults and
    rl_discard really update, fail and refuse where they say."""
    scenario = load_scenario(DRILLS / f"{name}.toml")
    report = await run_drill(scenario, size="8MB")
    assert report.passed, report.verdict
    assert report.outcomes and report.samples
    assert all(o.ok or o.step != "expect" for o in report.outcomes), report.verdict
    {"rl_loop": _check_rl_loop, "faults": _check_faults,
     "rl_discard": _check_rl_discard}.get(name, lambda r: None)(report)


def test_example_scenarios_say_what_they_do() -> None:
    """Each example starts with a comment explaining the drill and has a name."""
    for name in ("basic", "rl_loop", "faults", "rl_discard"):
        path = DRILLS / f"{name}.toml"
        assert path.read_text().startswith("#"), path
        assert load_scenario(path).name != name  # [drill] name set, not the file stem
    rl = load_scenario(DRILLS / "rl_loop.toml")
    assert rl.residency and "layerwise-offload" in rl.residency


async def test_default_scenario_passes() -> None:
    """The default scenario passes, and every one of its sleeps ends with nothing on the device."""
    scenario = default_scenario(cycles=2)
    report = await run_drill(scenario, size=SIZE)
    assert report.passed, report.verdict
    kinds = [o.step for o in report.outcomes]
    assert kinds.count("sleep") == 2 and kinds.count("wake") == 2
    sleeps = [o for o in report.outcomes if o.step == "sleep"]
    assert all(o.device_bytes == 0 and o.phase == "sleeping" for o in sleeps)


# -- validation --------------------------------------------------------------------------

@pytest.mark.parametrize(("data", "needles"), [
    pytest.param(_scenario({"do": "attach"}, {"do": "explode"}),
                 ["steps[1]", "unknown step 'explode'", "'sleep'", "'wake'", "'repeat'"],
                 id="unknown-step"),
    pytest.param(_scenario({"do": "wait", "ms": "10"}),
                 ["steps[0] (wait)", "'ms'", "int or float", "str"], id="wrong-type"),
    pytest.param(_scenario({"do": "repeat", "times": True, "steps": [{"do": "sleep"}]}),
                 ["steps[0] (repeat)", "'times'", "must be int", "bool"], id="bool-is-not-int"),
    pytest.param(_scenario({"do": "attach"}, {"do": "checkpoint"}),
                 ["steps[1] (checkpoint)", "missing required field 'name'"], id="missing-field"),
    pytest.param(_scenario({"do": "fail_next", "what": "disk"}),
                 ["steps[0] (fail_next)", "'disk'", "['copy', 'alloc']"], id="bad-choice"),
    pytest.param(_scenario({"do": "expect", "phase": "asleep"}),
                 ["steps[0] (expect)", "'asleep'", "'sleeping'", "'awake'"], id="bad-phase"),
    pytest.param(_scenario({"do": "update", "source": "network"}),
                 ["steps[0] (update)", "['disk', 'tensors']"], id="bad-source"),
    pytest.param(_scenario({"do": "sleep", "ms": 3}),
                 ["steps[0] (sleep)", "unknown field(s) ['ms']", "valid fields: ['discard']"],
                 id="unknown-field"),
    pytest.param(_scenario({"do": "attach"}, {"do": "generate"},
                           {"do": "repeat", "times": 2, "steps": [{"do": "slep"}]}),
                 ["steps[2].steps[0]", "unknown step 'slep'", "'sleep'"], id="nested-repeat"),
    pytest.param(_scenario({"do": "repeat", "times": 1, "steps": [
        {"do": "repeat", "times": 1, "steps": [{"do": "wake"}, {"do": "wait"}]}]}),
                 ["steps[0].steps[0].steps[1] (wait)", "missing required field 'ms'"],
                 id="doubly-nested"),
    pytest.param(_scenario({"do": "repeat", "times": 2, "steps": []}),
                 ["steps[0].steps", "non-empty list"], id="empty-repeat"),
    pytest.param(_scenario({"do": "wait", "ms": -5}),
                 ["steps[0] (wait)", "non-negative"], id="negative-wait"),
    pytest.param(_scenario({"what": "copy"}),
                 ["steps[0]", "'do'", "'attach'"], id="no-do-key"),
    pytest.param({"steps": []}, ["steps", "non-empty list"], id="no-steps"),
    pytest.param({"stepz": [{"do": "attach"}]}, ["unknown top-level key(s) ['stepz']", "[drill]"],
                 id="unknown-top-level-key"),
    pytest.param(_scenario({"do": "attach"}, size="12 parsecs"),
                 ["[drill]", "invalid size '12 parsecs'"], id="bad-size"),
    pytest.param(_scenario({"do": "attach"}, cycles=3),
                 ["[drill]", "['cycles']", "'residency'"], id="unknown-drill-key"),
])
def test_invalid_scenarios_are_refused_with_the_step_and_the_choices(
        data: dict[str, Any], needles: list[str]) -> None:
    """An invalid scenario is refused with a ScenarioError naming the step path and the valid
    choices."""
    with pytest.raises(ScenarioError) as info:
        parse_scenario(data)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"


def test_every_step_kind_is_in_the_unknown_step_message() -> None:
    """The unknown-step message lists every step kind the schema knows."""
    with pytest.raises(ScenarioError) as info:
        parse_scenario(_scenario({"do": "nap"}))
    for kind in SCHEMA:
        assert repr(kind) in str(info.value)


async def test_a_bad_step_anywhere_is_refused_before_anything_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The error is in the last step: nothing (not even the pipeline) is built."""
    from lifecycle.demo import DemoPipeline  # the class the drill runner builds

    def no_build(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the pipeline was built for an invalid scenario")

    monkeypatch.setattr(DemoPipeline, "build", no_build)
    path = tmp_path / "late.toml"
    path.write_text('[[steps]]\ndo = "attach"\n\n[[steps]]\ndo = "sleep"\n\n'
                    '[[steps]]\ndo = "repeat"\ntimes = 2\n\n  [[steps.steps]]\n  do = "wake"\n\n'
                    '  [[steps.steps]]\n  do = "expect"\n  outputs_equal = 1\n')
    with pytest.raises(ScenarioError, match=r"steps\[2\]\.steps\[1\] \(expect\)"):
        load_scenario(path)


def test_bad_toml_and_missing_files_are_scenario_errors(tmp_path: Path) -> None:
    """Invalid TOML and a missing scenario file are both ScenarioErrors."""
    bad = tmp_path / "bad.toml"
    bad.write_text("[[steps]\ndo = attach\n")
    with pytest.raises(ScenarioError, match="invalid TOML"):
        load_scenario(bad)
    with pytest.raises(ScenarioError, match="not found"):
        load_scenario(tmp_path / "missing.toml")


def test_string_steps_and_repeats_are_flattened() -> None:
    """Steps given as bare strings and nested repeats parse into steps with their kinds and paths."""
    scenario = parse_scenario({"drill": {"name": "short", "size": "4MB"},
                               "steps": ["attach", {"do": "repeat", "times": 3,
                                                    "steps": ["sleep", "wake"]}]})
    assert scenario.name == "short" and scenario.size == "4MB"
    assert [s.kind for s in scenario.steps] == ["attach", "repeat"]
    assert [s.kind for s in scenario.steps[1].body] == ["sleep", "wake"]
    assert scenario.steps[1].body[1].where == "steps[1].steps[1]"


# -- failures in the report ----------------------------------------------------------

async def test_a_failing_expectation_fails_the_drill_naming_the_step() -> None:
    """A failed expectation fails the drill naming the step and the mismatch, and the drill goes on."""
    scenario = parse_scenario(_scenario(
        {"do": "attach"}, {"do": "generate", "label": "first"},
        {"do": "expect", "phase": "sleeping"}, {"do": "sleep"}))
    report = await run_drill(scenario, size=SIZE)
    assert not report.passed
    assert len(report.failures) == 1
    assert "steps[2] expect" in report.failures[0]
    assert "phase is awake, expected sleeping" in report.failures[0]
    assert report.verdict.startswith("FAIL") and "steps[2]" in report.verdict
    # the drill goes on after a failed expectation
    assert [o.step for o in report.outcomes] == ["attach", "generate", "expect", "sleep"]
    assert report.outcomes[-1].phase == "sleeping"


async def test_a_failing_comparison_names_the_label() -> None:
    """A failed ``outputs_equal`` or ``checksum_equal`` names the label it compared with."""
    scenario = parse_scenario(_scenario(
        {"do": "attach"}, {"do": "generate", "label": "first"},
        {"do": "generate", "seed": 1}, {"do": "expect", "outputs_equal": "first"},
        {"do": "expect", "checksum_equal": "nowhere"}))
    report = await run_drill(scenario, size=SIZE)
    assert not report.passed
    assert any("steps[3]" in f and "'first'" in f for f in report.failures), report.failures
    assert any("steps[4]" in f and "'nowhere'" in f for f in report.failures), report.failures


async def test_an_unexpected_failed_step_fails_the_drill() -> None:
    """A rolled-back sleep not followed by ``expect success=false`` is a drill failure."""
    scenario = parse_scenario(_scenario(
        {"do": "attach", "placed": "device"}, {"do": "fail_next", "what": "copy"},
        {"do": "sleep"}, {"do": "expect", "phase": "awake"}))
    report = await run_drill(scenario, size=SIZE)
    assert not report.passed
    assert len(report.failures) == 1 and report.failures[0].startswith("steps[2] sleep"), \
        report.failures
    assert "rolled back" in report.failures[0]
    assert report.outcomes[2].ok is False


async def test_an_expected_failed_step_does_not_fail_the_drill() -> None:
    """A rolled-back sleep followed by ``expect success=false`` leaves the drill passing."""
    scenario = parse_scenario(_scenario(
        {"do": "attach", "placed": "device"}, {"do": "fail_next", "what": "copy"},
        {"do": "sleep"},
        {"do": "expect", "success": False, "phase": "awake", "message": "rolled back"}))
    report = await run_drill(scenario, size=SIZE)
    assert report.passed, report.verdict


async def test_a_pipeline_placed_on_the_device_copies_every_byte_at_its_first_sleep() -> None:
    """``placed = "device"`` puts the pipeline in the device's memory before attach (as
    ``model.to("cuda")``): attach keeps no host copy, so the first sleep copies every byte and
    the wake gives the same image; a value other than host or device is refused naming both."""
    scenario = parse_scenario(_scenario(
        {"do": "attach", "placed": "device"}, {"do": "generate", "label": "first"},
        {"do": "sleep"}, {"do": "wake"}, {"do": "generate"},
        {"do": "expect", "outputs_equal": "first"}))
    report = await run_drill(scenario, size=SIZE)
    assert report.passed, report.verdict
    assert report.outcomes[2].step == "sleep"
    assert report.outcomes[2].bytes_moved == report.pipeline_bytes
    with pytest.raises(ScenarioError, match=r"placed.*'host', 'device'"):
        parse_scenario(_scenario({"do": "attach", "placed": "gpu"}))


async def test_expecting_a_failure_that_did_not_happen_fails() -> None:
    """Expecting a failure after a step that succeeded fails the drill naming the step."""
    scenario = parse_scenario(_scenario(
        {"do": "attach"}, {"do": "sleep"}, {"do": "expect", "success": False}))
    report = await run_drill(scenario, size=SIZE)
    assert not report.passed
    assert "steps[2] expect" in report.failures[0] and "success=True" in report.failures[0]


async def test_report_as_dict_is_json(tmp_path: Path) -> None:
    """``as_dict()`` round-trips through JSON with every step field, steps in start order."""
    report = await run_drill(default_scenario(cycles=1), size=SIZE)
    doc = json.loads(json.dumps(report.as_dict()))
    assert doc["scenario"] == "default" and doc["passed"] is True
    assert doc["device"] == report.device and doc["pipeline_bytes"] == report.pipeline_bytes
    assert len(doc["steps"]) == len(report.outcomes)
    first = doc["steps"][0]
    for key in ("index", "step", "ok", "message", "seconds", "bytes_moved", "device_bytes",
                "host_bytes", "phase", "started", "gbps"):
        assert key in first
    starts = [s["started"] for s in doc["steps"]]
    assert starts == sorted(starts)


async def test_samples_follow_the_phases() -> None:
    """Samples are in time order, cover the awake and sleeping phases, and reach zero device bytes
    asleep."""
    report = await run_drill(default_scenario(cycles=1), size=SIZE)
    times = [s[0] for s in report.samples]
    assert times == sorted(times)
    phases = {s[3] for s in report.samples}
    assert {"awake", "sleeping"} <= phases  # (attach may finish before the first sample)
    # Asleep, the device holds nothing but a wake's buffers while they are being filled
    # (the report counts moves in flight): each sleep step itself ends at zero.
    assert [o.device_bytes for o in report.outcomes if o.step == "sleep"] == [0]
    sleeping = [dev for _, dev, _, phase in report.samples if phase == "sleeping"]
    assert sleeping and min(sleeping) == 0


# -- the timeline's phase bands (matplotlib-free part) ---------------------------------

def test_phase_bands_come_from_the_samples() -> None:
    """Phase bands run from each phase change to the next (or to ``end``), in time order whatever the
    samples' order."""
    from lifecycle.cli.timeline import phase_bands

    samples = [(0.0, 0, 0, "uninitialized"), (0.5, 10, 0, "awake"), (0.6, 10, 0, "awake"),
               (1.0, 0, 10, "sleeping"), (1.2, 10, 10, "awake")]
    assert phase_bands(samples, end=2.0) == [(0.0, 0.5, "uninitialized"), (0.5, 1.0, "awake"),
                                            (1.0, 1.2, "sleeping"), (1.2, 2.0, "awake")]
    assert phase_bands(list(reversed(samples)))[-1] == (1.2, 1.2, "awake")
    assert phase_bands([]) == []


def test_timeline_of_a_failing_report(tmp_path: Path) -> None:
    """Failures, fault labels, many steps and a label at the right edge all draw."""
    pytest.importorskip("matplotlib")
    from lifecycle.cli.timeline import draw_timeline

    report = DrillReport("synthetic", "cpu", 8 * 2**20)
    t = 0.0
    for i in range(40):
        kind = ["fail_next", "sleep", "wake", "generate", "update"][i % 5]
        ok = not (kind == "sleep" and i % 10 == 1)
        report.outcomes.append(StepOutcome(f"steps[{i}]", kind, ok, "next copy #1 will fail"
                                           if kind == "fail_next" else "x", 0.01, 0,
                                           0, 0, "awake", t))
        report.samples.append((t, 8 * 2**20 * (i % 2), 2**20, ["awake", "sleeping"][i % 2]))
        t += 0.05
    report.failures.append("steps[1] sleep: rolled back")
    out = tmp_path / "sub" / "t.png"
    draw_timeline(report, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- regressions -----------------------------------------------------------------------

async def test_update_of_an_unknown_component_is_a_failed_step_not_a_crash() -> None:
    """An update naming an unknown component is a failed step that a following expect can accept."""
    scenario = parse_scenario(_scenario(
        {"do": "attach"}, {"do": "update", "components": ["unet"]},
        {"do": "expect", "success": False, "message": "unet"}))
    report = await run_drill(scenario, size=SIZE)
    assert report.passed, report.verdict  # the failure was expected by the next step
    assert report.outcomes[1].ok is False


async def test_a_crashing_step_raises_its_own_error_and_cleans_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected error in a step comes out as itself (not an ExceptionGroup) and the
    drill's temporary directory is removed."""
    import lifecycle.cli.drills as drills

    execute = drills._Runner.execute

    async def crash_on_sleep(self: Any, step: Any) -> Any:
        if step.kind == "sleep":
            raise RuntimeError("boom")
        return await execute(self, step)

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(drills._Runner, "execute", crash_on_sleep)
    scenario = parse_scenario(_scenario({"do": "attach"}, {"do": "sleep"}))
    with pytest.raises(RuntimeError, match="boom"):
        await run_drill(scenario, size=SIZE)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("residency-drill-")] == []


async def test_a_residency_naming_no_component_is_refused_before_anything_runs() -> None:
    """A residency naming a component the pipeline lacks raises ValueError before the drill runs."""
    with pytest.raises(ValueError, match="unet"):
        await run_drill(default_scenario(), size=SIZE, residency="unet=resident")


async def test_errors_inside_a_request_are_not_wrapped() -> None:
    """ComponentAsleep raised inside a ``ctl.request`` (a use entered while asleep) comes out as itself,
    not in an ExceptionGroup."""
    from lifecycle import ComponentAsleep, LifecycleController
    from lifecycle.demo import DemoPipeline

    ctl = LifecycleController("cpu")
    await ctl.attach(DemoPipeline.build(2**20))
    await ctl.sleep()
    with pytest.raises(ComponentAsleep):
        async with ctl.request(["text_encoder", "transformer"]), ctl.use("text_encoder"):
            pass
