"""The ``residency`` command line: exit codes, ``--json``, ``--timeline``, ``diagram``.

``main`` runs its own event loop (``anyio.run``), so these tests are synchronous."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from lifecycle._phase import TRANSITIONS
from lifecycle.cli import main
from lifecycle.cli import parse as cli_parse

pytestmark = pytest.mark.moves

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"

FAILING = """\
[drill]
name = "failing"

[[steps]]
do = "attach"

[[steps]]
do = "expect"
phase = "sleeping"
"""


@pytest.fixture
def failing_toml(tmp_path: Path) -> Path:
    path = tmp_path / "failing.toml"
    path.write_text(FAILING)
    return path


def test_default_drill_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    """The default drill exits 0 and prints a PASS with its sleep and wake steps."""
    assert main(["drill", "--size", "4MB", "--cycles", "1"]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "sleep" in out and "wake" in out


def test_failing_expectation_exits_1(failing_toml: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A scenario whose expectation fails exits 1 and prints FAIL with the expected phase."""
    assert main(["drill", str(failing_toml), "--size", "4MB"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "expected sleeping" in out


def test_shipped_scenario_runs_from_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    """The shipped basic.toml scenario runs from the command line and exits 0."""
    assert main(["drill", str(ROOT / "scripts" / "drills" / "basic.toml"), "--size", "4MB"]) == 0
    assert "basic cycle" in capsys.readouterr().out


@pytest.mark.parametrize(("toml", "needle"), [
    pytest.param('[[steps]]\ndo = "attach"\n\n[[steps]]\ndo = "teleport"\n',
                 "steps[1]: unknown step 'teleport'", id="unknown-step"),
    pytest.param("[[steps]\ndo = 'attach'\n", "invalid TOML", id="bad-toml"),
    pytest.param('[[steps]]\ndo = "wait"\nms = "soon"\n', "steps[0] (wait)", id="wrong-type"),
    pytest.param('[drill]\nsize = "huge"\n\n[[steps]]\ndo = "attach"\n', "invalid size",
                 id="bad-size-in-file"),
])
def test_bad_scenario_files_exit_2_before_anything_runs(
        tmp_path: Path, toml: str, needle: str, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An invalid scenario file exits 2 with the problem on stderr, before any pipeline is built."""
    from lifecycle.demo import DemoPipeline  # the class the drill runner builds

    def no_build(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a pipeline was built for an invalid scenario")

    monkeypatch.setattr(DemoPipeline, "build", no_build)
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    assert main(["drill", str(path)]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and captured.out == ""


def test_missing_scenario_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A scenario path that does not exist exits 2 saying it was not found."""
    assert main(["drill", str(tmp_path / "nowhere.toml")]) == 2
    assert "not found" in capsys.readouterr().err


@pytest.mark.parametrize(("args", "needle"), [
    pytest.param(["--size", "12 parsecs"], "invalid size", id="bad-size"),
    pytest.param(["--residency", "transformer=bogus"], "bogus", id="bad-residency-mode"),
    pytest.param(["--residency", "garbage"], "COMPONENT=MODE", id="bad-residency-syntax"),
    pytest.param(["--cycles", "-1"], "--cycles", id="negative-cycles"),
    pytest.param(["--device", "tpu"], "invalid device", id="bad-device"),
])
def test_bad_options_exit_2(args: list[str], needle: str,
                            capsys: pytest.CaptureFixture[str]) -> None:
    """An invalid size, residency, cycle count or device exits 2 with an error naming it on stderr."""
    assert main(["drill", "--size", "4MB", "--cycles", "1", *args]) == 2
    assert needle in capsys.readouterr().err


def test_residency_naming_an_unknown_component_exits_2(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Regression: the ValueError used to escape the drill's task group as an ExceptionGroup."""
    assert main(["drill", "--size", "4MB", "--cycles", "1", "--residency", "unet=resident"]) == 2
    assert "unet" in capsys.readouterr().err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    """No command, an unknown command or a non-integer ``--cycles`` is a usage error exiting 2."""
    for argv in ([], ["fly"], ["drill", "--cycles", "many"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2, argv
    capsys.readouterr()


def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    """``--json`` prints one JSON document with the scenario, verdict and per-step fields."""
    assert main(["drill", "--size", "4MB", "--cycles", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"scenario", "passed", "steps"} <= set(doc)
    assert doc["scenario"] == "default" and doc["passed"] is True
    assert [s["step"] for s in doc["steps"]][:2] == ["attach", "generate"]
    assert all({"seconds", "bytes_moved", "device_bytes", "phase"} <= set(s) for s in doc["steps"])


def test_json_report_of_a_failing_drill(failing_toml: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    """A failing drill's JSON report says it did not pass and names the failing step."""
    assert main(["drill", str(failing_toml), "--size", "4MB", "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["passed"] is False and doc["scenario"] == "failing"
    assert doc["failures"] and "steps[1]" in doc["failures"][0]


def test_timeline_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--timeline`` writes a PNG and prints its path."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "out.png"
    assert main(["drill", "--size", "4MB", "--cycles", "1", "--timeline", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    assert str(out) in capsys.readouterr().out


def test_timeline_without_matplotlib_says_how_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without matplotlib, drawing a timeline raises a RuntimeError naming the ``plot`` extra to
    install."""
    from lifecycle.cli.drills import DrillReport
    from lifecycle.cli.timeline import draw_timeline

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    with pytest.raises(RuntimeError, match=r"pip install 'residency\[plot\]'"):
        draw_timeline(DrillReport("x", "cpu", 0), tmp_path / "x.png")


def test_the_command_without_rich_says_which_extra_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without rich, a drill stops with a message naming the ``cli`` extra, not a traceback."""
    monkeypatch.setitem(sys.modules, "rich.console", None)  # import fails
    with pytest.raises(SystemExit, match=r"pip install 'residency\[cli\]'"):
        main(["drill", "--cycles", "0", "--size", "1MB"])


def test_the_library_works_without_the_commands_extras_and_never_loads_the_command() -> None:
    """With rich and matplotlib unavailable, a server embedding the controller attaches,
    sleeps and wakes, and no command code is imported."""
    import subprocess

    code = ("import sys, anyio; sys.modules['rich'] = sys.modules['matplotlib'] = None\n"
            "import lifecycle, strategies, lifecycle.testing, lifecycle.adapters\n"
            "from lifecycle.demo import DemoPipeline\n"
            "async def main():\n"
            "    async with lifecycle.LifecycleController('cpu') as ctl:\n"
            "        await ctl.attach(DemoPipeline.build(2**20))\n"
            "        assert (await ctl.sleep()).success and (await ctl.wake()).success\n"
            "anyio.run(main)\n"
            "sys.exit(1 if 'lifecycle.cli' in sys.modules else 0)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_diagram_is_mermaid_with_every_trigger(capsys: pytest.CaptureFixture[str]) -> None:
    """``diagram`` prints a Mermaid state diagram with one edge per transition and its trigger."""
    assert main(["diagram"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == "stateDiagram-v2"
    for t in TRANSITIONS:
        assert f"{t.source.value} --> {t.dest.value}: {t.trigger}" in out


def test_python_m_lifecycle_diagram() -> None:
    """``python -m lifecycle diagram`` exits 0 and prints the Mermaid diagram with every trigger."""
    proc = subprocess.run([sys.executable, "-m", "lifecycle", "diagram"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("stateDiagram-v2")
    for trigger in {t.trigger for t in TRANSITIONS}:
        assert f": {trigger}" in proc.stdout


def test_plan_prints_the_table_and_json_and_exits_1_when_nothing_fits(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``residency plan`` prints a row per component and the runners-up, ``--json`` the same
    as one document, and a budget nothing fits exits 1 naming the smallest feasible one."""
    assert main(["plan", "--budget", "70%", "--size", "8MB", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "transformer" in out and "predicted: peak" in out and "runners-up" in out
    assert main(["plan", "--budget", "70%", "--size", "8MB", "--device", "cpu", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {c["name"] for c in plan["components"]} == {"text_encoder", "transformer", "vae"}
    assert plan["predicted_peak_bytes"] <= plan["budget_bytes"]
    assert main(["plan", "--budget", "1000", "--size", "8MB", "--device", "cpu"]) == 1
    assert "smallest feasible budget" in capsys.readouterr().err
    assert main(["plan", "--budget", "lots", "--device", "cpu"]) == 2
    assert "invalid size" in capsys.readouterr().err


def test_drill_runs_under_an_auto_residency_and_needs_a_budget(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``drill --residency auto --budget`` plans at attach and passes; auto without a budget,
    or a budget without auto, is bad usage."""
    assert main(["drill", "--residency", "auto", "--budget", "70%", "--size", "8MB",
                 "--device", "cpu", "--cycles", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"]
    assert main(["drill", "--residency", "auto", "--device", "cpu"]) == 2
    assert "--budget" in capsys.readouterr().err
    assert main(["drill", "--budget", "1GiB", "--device", "cpu"]) == 2


def test_sleep_wake_bench_reports_the_floor_of_a_clean_sleep() -> None:
    """``bench sleep-wake --json`` reports both floor loops and the fixed cost of a clean
    sleep (nothing moved, the reference's sleep over each as a ratio) beside ours, and the
    outputs stay bit-identical."""
    proc = subprocess.run([sys.executable, "-m", "lifecycle", "bench", "sleep-wake", "--size",
                           "4MB", "--device", "cpu", "--repeats", "1", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(proc.stdout)
    results = doc["results"]
    for floor in ("floor_sleep_readable", "floor_sleep_parked", "ours_sleep_clean_fixed"):
        assert results[floor]["bytes"] == 0 and results[floor]["seconds"] > 0
        assert doc["ratios"][f"reference_sleep/{floor}"] == pytest.approx(
            results["reference_sleep"]["seconds"] / results[floor]["seconds"])
    assert doc["correct"] is True


def test_discard_bench_compares_an_rl_cycle_in_both_modes() -> None:
    """``bench discard --json``: the discarding release holds fewer host bytes after it, both
    modes generate the same images for the same weights, and the stale pipeline refused."""
    proc = subprocess.run([sys.executable, "-m", "lifecycle", "bench", "discard", "--size",
                           "4MB", "--device", "cpu", "--repeats", "1", "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc: dict[str, Any] = json.loads(proc.stdout)
    keep, discard = doc["modes"]["keep"], doc["modes"]["discard"]
    assert discard["held_after_release"]["host_bytes"] < keep["held_after_release"]["host_bytes"]
    assert set(keep["seconds"]) == {"release", "resume", "update", "generate"}
    assert doc["correct"] is True and discard["refused_while_stale"] is True


@pytest.mark.parametrize(("argv", "which", "repeats"), [
    ([], "all", None), (["all"], "all", None), (["sleep-wake"], "sleep-wake", 5),
    (["update"], "update", 3), (["residency"], "residency", 5), (["discard"], "discard", 5),
    (["discard", "--repeats", "2"], "discard", 2)])
def test_each_benchmark_has_its_own_defaults(argv: list[str], which: str,
                                             repeats: int | None) -> None:
    """``residency bench WHICH`` without options takes that benchmark's defaults (update's
    three repeats do not leak into the others, nor "all"'s unset one), and ``residency bench``
    alone is ``bench all``."""
    args = cli_parse(["bench", *argv])
    assert (args.which, args.repeats) == (which, repeats)
    if which != "residency":
        assert (args.size, args.dtype, args.malloc) == ("1GiB", "float32", "keep")
