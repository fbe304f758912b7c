"""``residency drill --timeline FILE.png``: where the memory went, as a picture.

Device and host bytes over the drill's time (MiB), the lifecycle phase as coloured
background bands (computed from the report's samples), and each step marked where it
started: transitions (attach, detach, sleep, wake, update) as vertical lines with a short
label, failed steps in red, generations as ticks along the bottom. Labels that would
overlap are stacked on up to four rows; those that still do not fit keep their line only
(failures are placed first, so they are never the ones dropped). In a long drill only the
first and last transition of each kind (and every failure) is labelled.

matplotlib is an optional dependency (``pip install 'residency[plot]'``), imported only
when a picture is asked for.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .drills import DrillReport, StepOutcome

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["PHASE_COLOURS", "draw_timeline", "phase_bands"]

PHASE_COLOURS: dict[str, str] = {
    "uninitialized": "#bdbdbd",
    "awake": "#a1d99b",
    "sleeping": "#9ecae1",
    "updating_weights": "#fdae6b",
}
_TRANSITIONS = ("attach", "detach", "sleep", "wake", "update")
_PRIORITY = {"attach": 1, "detach": 1, "update": 2, "sleep": 3, "wake": 3}
_FAIL = "#d62728"
_STEP = "#444444"
_DEVICE = "#1f1f1f"
_HOST = "#7b3294"
_ROWS = 4
_MANY = 16  # more marks than this: label only the first and last of each kind
_MIN_BAND = 0.006  # the narrowest phase band drawn, as a fraction of the drill's time
_MIB = 2**20


def phase_bands(samples: Sequence[tuple[float, int, int, str]], end: float | None = None
                ) -> list[tuple[float, float, str]]:
    """``(start, end, phase)`` runs of equal phase: a phase holds from the first sample that
    shows it to the first sample that shows another (or ``end``, default the last sample)."""
    ordered = sorted(samples, key=lambda s: s[0])
    bands: list[tuple[float, float, str]] = []
    for t, _, _, phase in ordered:
        if bands and bands[-1][2] == phase:
            continue
        if bands:
            bands[-1] = (bands[-1][0], t, bands[-1][2])
        bands.append((t, t, phase))
    if bands:
        last = max(ordered[-1][0], end if end is not None else ordered[-1][0])
        bands[-1] = (bands[-1][0], last, bands[-1][2])
    return bands


def _marks(outcomes: Sequence[StepOutcome]) -> list[tuple[StepOutcome, str, bool]]:
    """The steps worth a line and a label: ``(outcome, label, failed)``.

    Transitions and failed steps; a fault armed by ``fail_next``/``cancel_after`` is named
    on the transition it made fail."""
    marks: list[tuple[StepOutcome, str, bool]] = []
    pending: str | None = None
    for o in outcomes:
        if o.step == "fail_next":
            pending = o.message.split()[1] + " fault" if len(o.message.split()) > 1 else "fault"
            continue
        if o.step == "cancel_after":
            pending = "cancelled"
            continue
        if o.step in _TRANSITIONS:
            if o.ok:
                marks.append((o, o.step, False))
            else:
                marks.append((o, f"{o.step} \u2717 {pending or 'failed'}", True))
            pending = None
        elif not o.ok:
            marks.append((o, f"{o.step} \u2717", True))
    return marks


def _place_labels(ax: Axes, marks: list[tuple[StepOutcome, str, bool]]) -> None:
    """Labels near the top of the axes, each on the lowest row where it overlaps nothing."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    # Failures first (in time order), then attach/detach, updates, sleeps and wakes.
    order = sorted(range(len(marks)), key=lambda i: (
        not marks[i][2], 0 if marks[i][2] else _PRIORITY.get(marks[i][0].step, 0),
        marks[i][0].started))
    if len(marks) > _MANY:
        # A long drill: name each kind of transition at its first and last occurrence
        # (and every failure); the lines mark the rest.
        keep = {i for i, m in enumerate(marks) if m[2]}
        for kind in {m[0].step for m in marks}:
            found = [i for i, m in enumerate(marks) if m[0].step == kind and not m[2]]
            keep.update(found[:1] + found[-1:])
        order = [i for i in order if i in keep]
    taken: list[list[tuple[float, float]]] = [[] for _ in range(_ROWS)]
    pad = 3.0  # pixels between labels on one row
    for i in order:
        o, label, failed = marks[i]
        text = ax.text(o.started, 0.0, f" {label}", transform=ax.get_xaxis_transform(),
                       ha="left", va="top", fontsize=8, color=_FAIL if failed else _STEP,
                       fontweight="bold" if failed else "normal", clip_on=False,
                       bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none",
                             "alpha": 0.75})
        box = text.get_window_extent(renderer)
        if box.x1 > ax.get_window_extent(renderer).x1:  # would run off the right: flip
            text.set_text(f"{label} ")
            text.set_horizontalalignment("right")
            box = text.get_window_extent(renderer)
        x0, x1 = box.x0 - pad, box.x1 + pad
        for row in range(_ROWS):
            if all(x1 <= a or x0 >= b for a, b in taken[row]):
                taken[row].append((x0, x1))
                text.set_y(0.985 - row * 0.065)
                break
        else:
            text.remove()  # no room: the line alone marks the step


def draw_timeline(report: DrillReport, path: Path) -> None:
    """Draw ``report``'s device and host bytes over time, phases and steps, as a PNG."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("drawing a timeline needs matplotlib: "
                           "pip install 'residency[plot]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    samples = sorted(report.samples, key=lambda s: s[0])
    end = max([s[0] for s in samples] + [o.started + o.seconds for o in report.outcomes]
              + [0.0])
    fig, ax = plt.subplots(figsize=(12, 5), dpi=120)
    try:
        fig.subplots_adjust(left=0.065, right=0.83, top=0.9, bottom=0.11)
        handles: list[Any] = []
        present = {b[2] for b in phase_bands(samples, end)}
        # Shortest bands last (on top), and at least _MIN_BAND of the span wide: a sleep of
        # a few milliseconds in a drill of seconds stays visible.
        min_width = _MIN_BAND * (end if end > 0 else 1.0)
        for start, stop, phase in sorted(phase_bands(samples, end),
                                         key=lambda b: b[0] - b[1]):
            ax.axvspan(start, max(stop, start + min_width),
                       color=PHASE_COLOURS.get(phase, "#eeeeee"), alpha=0.55, lw=0, zorder=0)
        times = [s[0] for s in samples]
        device = [s[1] / _MIB for s in samples]
        host = [s[2] / _MIB for s in samples]
        (dev_line,) = ax.plot(times, device, drawstyle="steps-post", color=_DEVICE, lw=2.2,
                              label="device bytes", zorder=3)
        (host_line,) = ax.plot(times, host, drawstyle="steps-post", color=_HOST, lw=1.8,
                               ls="--", label="host bytes", zorder=3)
        handles += [dev_line, host_line]
        total = report.pipeline_bytes / _MIB
        top = max([total, *device, *host, 1e-3])
        if total > 0:
            ax.axhline(total, color="#888888", lw=0.8, ls=":", zorder=1)
            handles.append(Line2D([], [], color="#888888", lw=0.8, ls=":",
                                  label=f"pipeline {total:.1f} MiB"))
        # Headroom above the data for the step labels.
        ax.set_ylim(0, top * 1.45)
        ax.set_xlim(0, end * 1.01 if end > 0 else 1.0)

        marks = _marks(report.outcomes)
        for o, _, failed in marks:
            ax.axvline(o.started, color=_FAIL if failed else _STEP, lw=1.4 if failed else 0.8,
                       ls="-" if failed else (0, (4, 2)), alpha=0.9 if failed else 0.55,
                       zorder=2)
        gens = [o.started for o in report.outcomes if o.step == "generate" and o.ok]
        if gens:
            ax.plot(gens, [0.0] * len(gens), ls="none", marker="^", ms=7, color="#2b8cbe",
                    clip_on=False, zorder=4)
            handles.append(Line2D([], [], ls="none", marker="^", ms=7, color="#2b8cbe",
                                  label="generate"))
        _place_labels(ax, marks)

        handles.append(Line2D([], [], color=_STEP, lw=0.8, ls=(0, (4, 2)),
                              label="transition (start)"))
        if any(failed for _, _, failed in marks):
            handles.append(Line2D([], [], color=_FAIL, lw=1.4, label="failed step"))
        for phase, colour in PHASE_COLOURS.items():
            if phase in present:
                handles.append(Patch(color=colour, alpha=0.55, label=phase.replace("_", " ")))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                  frameon=False, fontsize=9)

        ax.set_xlabel("seconds since the drill started")
        ax.set_ylabel("MiB")
        ax.grid(axis="y", color="white", lw=0.8, alpha=0.8)
        ax.spines[["top", "right"]].set_visible(False)
        verdict = "PASS" if report.passed else f"FAIL ({len(report.failures)} problem(s))"
        ax.set_title(f"drill {report.scenario!r} on {report.device}: pipeline {total:.1f} MiB, "
                     f"{len(report.outcomes)} steps, {verdict}", loc="left", fontsize=11,
                     color="black" if report.passed else _FAIL)
        if not samples:
            ax.text(0.5, 0.5, "no samples recorded", transform=ax.transAxes, ha="center")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, format="png")
    finally:
        plt.close(fig)
