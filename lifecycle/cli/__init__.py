"""The ``residency`` command: drills, the benchmark, the state diagram.

Exit codes: 0 success, 1 a drill expectation failed, 2 bad usage or a bad scenario file.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from lifecycle import InfeasibleBudget, configure_logging, mermaid
from lifecycle._units import format_bytes, parse_size

from .drills import DrillReport, ScenarioError, StepOutcome, default_scenario, load_scenario, run_drill

__all__ = ["main"]


def _rich() -> Any:
    """The ``rich`` package, or a clear exit naming the extra that brings it."""
    try:
        import rich.console
        import rich.progress
        import rich.table
    except ImportError:  # the launchers install it
        raise SystemExit("residency: this command needs the 'cli' extra: "
                         "pip install 'residency[cli]' (rich)") from None
    return rich


def _table(report: DrillReport) -> Any:
    table = _rich().table.Table(title=f"drill {report.scenario!r} on {report.device}, "
                                f"pipeline {format_bytes(report.pipeline_bytes)}", title_justify="left")
    for col, just in (("step", "left"), ("", "left"), ("outcome", "left"), ("seconds", "right"),
                      ("moved", "right"), ("GB/s", "right"), ("device after", "right"),
                      ("host pinned/pageable/file", "right"), ("phase after", "left")):
        table.add_column(col, justify=just)
    for o in report.outcomes:
        index = ".".join(re.findall(r"\[(\d+)\]", o.index))
        table.add_row(index, o.step, ("ok: " if o.ok else "FAILED: ") + o.message[:70],
                      f"{o.seconds:.4f}", format_bytes(o.bytes_moved) if o.bytes_moved else "-",
                      f"{o.gbps:.2f}" if o.bytes_moved else "-", format_bytes(o.device_bytes),
                      f"{format_bytes(o.pinned_bytes)}/{format_bytes(o.pageable_bytes)}/"
                      f"{format_bytes(o.file_backed_bytes)}", o.phase)
    return table


def _drill(args: argparse.Namespace) -> int:
    try:
        scenario = load_scenario(args.scenario) if args.scenario else default_scenario(args.cycles)
        if args.size:
            parse_size(args.size)
    except (ScenarioError, ValueError) as exc:
        print(f"residency drill: {exc}", file=sys.stderr)
        return 2
    configure_logging(json=args.log_json, level="info" if args.log_json else "warning")
    rp = _rich().progress
    err = _rich().console.Console(stderr=True)
    with rp.Progress(rp.SpinnerColumn(), rp.TextColumn("{task.description}"), rp.BarColumn(),
                     rp.DownloadColumn(), rp.TransferSpeedColumn(), rp.TimeElapsedColumn(),
                     console=err, transient=True, disable=args.json) as progress:
        steps = progress.add_task("starting", total=None)
        move = progress.add_task("move", total=None, visible=False)
        step_started = time.monotonic()

        def on_step(o: StepOutcome) -> None:
            nonlocal step_started
            step_started = time.monotonic()
            progress.update(steps, description=f"{o.index} {o.step}: {o.message[:50]}")
            progress.update(move, visible=False)

        def on_progress(trigger: str, done: int, total: int) -> None:
            # A bar only for moves that take longer than a second.
            visible = time.monotonic() - step_started > 1.0
            progress.update(move, description=trigger, completed=done, total=total,
                            visible=visible)

        try:
            report = anyio.run(lambda: run_drill(scenario, device=args.device, size=args.size,
                                                 residency=args.residency, on_step=on_step,
                                                 on_progress=on_progress, budget=args.budget,
                                                 host_budget=args.host_budget,
                                                 pin_budget=args.pin_budget))
        except (ValueError, InfeasibleBudget) as exc:  # bad residency, budget, device or size
            print(f"residency drill: {exc}", file=sys.stderr)
            return 2
    if args.timeline:
        from .timeline import draw_timeline

        draw_timeline(report, Path(args.timeline))
    if args.json:
        print(json.dumps(report.as_dict(), indent=2))
    else:
        out = _rich().console.Console(width=None if sys.stdout.isatty() else 140)
        out.print(_table(report))
        out.print(("[green]" if report.passed else "[red]") + report.verdict)
        if args.timeline:
            out.print(f"timeline written to {args.timeline}")
    return 0 if report.passed else 1


# ``residency bench WHICH``: the module (of this package) whose ``run(args)`` it is.
BENCHMARKS = {"sleep-wake": "bench_sleep_wake", "update": "bench_update",
              "residency": "bench_residency", "discard": "bench_discard", "host": "bench_host",
              "partial": "bench_partial", "mirrors": "bench_mirrors",
              "weight-sync": "bench_weight_sync", "chunks": "bench_chunks"}


def _bench(args: argparse.Namespace) -> int:
    from . import bench_sleep_wake, bench_update

    if args.which in BENCHMARKS:
        return int(importlib.import_module(f".{BENCHMARKS[args.which]}", __name__).run(args))
    # all: sleep/wake, then updates, with the same options
    first = bench_sleep_wake.run(argparse.Namespace(**{**vars(args), "repeats": args.repeats or 5}))
    print()
    return first or bench_update.run(argparse.Namespace(**{**vars(args),
                                                           "repeats": args.repeats or 3}))


def _serve(args: argparse.Namespace) -> int:
    from . import serve

    return serve.run(args)


def _plan(args: argparse.Namespace) -> int:
    from . import plan

    return plan.run(args)


def _diagram(args: argparse.Namespace) -> int:
    print(mermaid(), end="")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="residency", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("drill", help="run a lifecycle drill on the built-in demo pipeline")
    d.add_argument("scenario", nargs="?", help="scenario TOML file (default: built-in cycle)")
    d.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda when available)")
    d.add_argument("--size", help="demo pipeline weight size, e.g. 256MB, 2GB (default 64MB)")
    d.add_argument("--residency", help="component residency, e.g. 'transformer=layerwise-offload'"
                                       ", or 'auto' (planned under --budget)")
    d.add_argument("--budget", help="device budget for --residency auto, e.g. 300MB or 50%%")
    d.add_argument("--host-budget", help="host bytes the controller may hold ('8GiB', '50%%' "
                                         "of what the cgroup and the machine leave, 'auto')")
    d.add_argument("--pin-budget", help="page-locked host bytes (default: the host budget)")
    d.add_argument("--cycles", type=int, default=3, help="sleep/wake cycles of the default drill")
    d.add_argument("--json", action="store_true", help="print the report as one JSON document")
    d.add_argument("--timeline", metavar="FILE.png", help="draw device/host bytes over time")
    d.add_argument("--log-json", action="store_true", help="structured events as JSON on stderr")
    d.set_defaults(func=_drill)
    b = sub.add_parser("bench", help="benchmarks against the reference approach and the "
                                     "bandwidth limit (default: sleep-wake, then update)")
    b.set_defaults(func=_bench)
    _bench_parsers(b)
    from . import serve  # only the core's imports: cheap

    s = sub.add_parser("serve", help="serve the pipeline's control plane over HTTP",
                       description=serve.__doc__)
    serve.add_arguments(s)
    s.set_defaults(func=_serve)
    from . import plan

    p = sub.add_parser("plan", help="the residency the planner picks under a device budget",
                       description=plan.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_arguments(p)
    p.set_defaults(func=_plan)
    g = sub.add_parser("diagram", help="the lifecycle state machine as Mermaid")
    g.set_defaults(func=_diagram)
    return parser


def _bench_parsers(b: argparse.ArgumentParser) -> None:
    """``residency bench <which>``: one subparser per benchmark over parent parsers of options
    they share. Each gets parents of its own: a parent's actions are shared by its children,
    so one child's ``set_defaults`` (update's ``repeats=3``) would change the others'."""
    from . import (
        _benchkit,
        bench_chunks,
        bench_discard,
        bench_host,
        bench_mirrors,
        bench_partial,
        bench_residency,
        bench_sleep_wake,
        bench_update,
        bench_weight_sync,
    )

    def options(*, pipeline: bool = True, device: bool = True) -> list[argparse.ArgumentParser]:
        return [_benchkit.base_options(device=device),
                *([_benchkit.pipeline_options()] if pipeline else [])]

    which = b.add_subparsers(dest="which", metavar="{" + ",".join([*BENCHMARKS, "all"]) + "}")
    which.add_parser("sleep-wake", parents=options(), help="sleep/wake throughput",
                     description=bench_sleep_wake.__doc__)
    update = which.add_parser("update", parents=options(), help="weight updates",
                              description=bench_update.__doc__)
    bench_update.add_arguments(update)
    residency = which.add_parser("residency", parents=options(pipeline=False),
                                 help="latency of each mode", description=bench_residency.__doc__)
    bench_residency.add_arguments(residency)
    which.add_parser("discard", parents=options(), help="an RL cycle with discarding "
                     "releases against keeping ones", description=bench_discard.__doc__)
    host = which.add_parser("host", parents=options(), help="host bytes while asleep, "
                            "file-backed wakes, serve under a host budget",
                            description=bench_host.__doc__)
    host.add_argument("--no-serve", action="store_true",
                      help="skip the peak RSS of residency serve")
    host.set_defaults(repeats=3)
    which.add_parser("partial", parents=options(), help="release/resume of the transformer "
                     "alone against the whole pipeline", description=bench_partial.__doc__)
    mirrors = which.add_parser("mirrors", parents=options(pipeline=False, device=False),
                               help="host mirrors' page faults: shared against private "
                               "huge-page mappings", description=bench_mirrors.__doc__)
    bench_mirrors.add_arguments(mirrors)
    sync = which.add_parser("weight-sync", parents=options(pipeline=False, device=False),
                            help="process-group updates against a plain broadcast loop",
                            description=bench_weight_sync.__doc__)
    bench_weight_sync.add_arguments(sync)
    chunks = which.add_parser("chunks", parents=options(), help="a store's chunked copies: "
                              "one chunk in flight against two", description=bench_chunks.__doc__)
    chunks.set_defaults(repeats=3)
    both = which.add_parser("all", parents=options(), help="sleep-wake, then update")
    bench_update.add_arguments(both)
    both.set_defaults(repeats=None)  # each benchmark's own default (see _bench)
    # `residency bench` alone is `residency bench all` (see main). No defaults on ``b``: a
    # parent parser's defaults win over its subparsers' own.


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """The command line ``argv`` (without the program), parsed."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "bench" and args.which is None:  # `residency bench [OPTIONS]`
        args = parser.parse_args([*argv, "all"])
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if args.command == "drill" and args.cycles < 0:
        print("residency drill: --cycles must be non-negative", file=sys.stderr)
        return 2
    return int(args.func(args))
