"""Scripted lifecycle drills: a scenario of steps run against a pipeline, with expectations.

A scenario is a list of steps (from TOML or built in). Each step is one of :data:`SCHEMA`'s
kinds; the whole scenario is validated before anything runs, and every problem names the
step (``steps[3].repeat.steps[1]``) and the valid choices. Running it gives a
:class:`DrillReport`: one :class:`StepOutcome` per executed step (seconds, bytes moved,
device and host bytes after, phase after) and a verdict.

A step that fails (a refused or rolled-back transition) fails the drill unless the very
next step is an ``expect`` with ``success = false``: fault drills say what they expect.
"""

from __future__ import annotations

import tempfile
import time
import tomllib
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import anyio
import torch

from lifecycle import HostBudgetExceeded, LifecycleController, LifecycleError, Phase
from lifecycle._units import gbps, parse_size
from lifecycle.demo import DemoPipeline
from lifecycle.demo._checkpoint import write_checkpoint
from lifecycle.testing import FaultInjection, faulty_device_layer
from strategies import ResidencyConfig

__all__ = [
    "SCHEMA",
    "DrillReport",
    "Scenario",
    "ScenarioError",
    "StepOutcome",
    "default_scenario",
    "load_scenario",
    "run_drill",
]


class ScenarioError(ValueError):
    """A scenario file or definition is invalid; nothing has run."""


# kind -> {field: (type(s), required)}
_NUM = (int, float)
SCHEMA: dict[str, dict[str, tuple[type | tuple[type, ...], bool]]] = {
    "attach": {"placed": (str, False)},
    "detach": {},
    "generate": {"steps": (int, False), "seed": (int, False), "label": (str, False)},
    "sleep": {"discard": ((bool, str, list), False)},
    "wake": {},
    "update": {"source": (str, False), "path": (str, False), "delta": (_NUM, False),
               "components": (list, False), "from": (str, False), "fraction": (_NUM, False)},
    "fail_next": {"what": (str, True), "at": (int, False)},
    "cancel_after": {"ms": (_NUM, True)},
    "wait": {"ms": (_NUM, True)},
    "checkpoint": {"name": (str, True)},
    "repeat": {"times": (int, True), "steps": (list, True)},
    "expect": {"phase": (str, False), "success": (bool, False), "message": (str, False),
               "outputs_equal": (str, False), "outputs_differ": (str, False),
               "checksum_equal": (str, False), "checksum_differ": (str, False),
               "device_bytes_zero": (bool, False), "stale": (bool, False)},
}
_CHOICES = {"fail_next.what": ("copy", "alloc"), "update.source": ("disk", "tensors"),
            "attach.placed": ("host", "device"),
            "expect.phase": tuple(p.value for p in Phase)}


@dataclass(frozen=True)
class Step:
    kind: str
    where: str
    args: Mapping[str, Any]
    body: tuple[Step, ...] = ()


@dataclass(frozen=True)
class Scenario:
    name: str
    steps: tuple[Step, ...]
    size: str | None = None
    residency: str | None = None


def _steps(raw: Any, where: str) -> tuple[Step, ...]:
    if not isinstance(raw, list) or not raw:
        raise ScenarioError(f"{where}: expected a non-empty list of steps")
    return tuple(_step(item, f"{where}[{i}]") for i, item in enumerate(raw))


def _step(raw: Any, where: str) -> Step:
    if isinstance(raw, str):
        raw = {"do": raw}
    if not isinstance(raw, Mapping) or "do" not in raw:
        raise ScenarioError(f"{where}: each step is a table with a 'do' key naming one of "
                            f"{sorted(SCHEMA)}")
    kind = raw["do"]
    if kind not in SCHEMA:
        raise ScenarioError(f"{where}: unknown step {kind!r}; valid steps: {sorted(SCHEMA)}")
    fields = SCHEMA[kind]
    args = {k: v for k, v in raw.items() if k != "do"}
    unknown = sorted(set(args) - set(fields))
    if unknown:
        raise ScenarioError(f"{where} ({kind}): unknown field(s) {unknown}; valid fields: "
                            f"{sorted(fields) or 'none'}")
    for name, (types, required) in fields.items():
        if name not in args:
            if required:
                raise ScenarioError(f"{where} ({kind}): missing required field {name!r}")
            continue
        value = args[name]
        kinds = types if isinstance(types, tuple) else (types,)
        if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, types):
            want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple)
                                                     else (types,)))
            raise ScenarioError(f"{where} ({kind}): field {name!r} must be {want}, got "
                                f"{type(value).__name__} {value!r}")
        choices = _CHOICES.get(f"{kind}.{name}")
        if choices and value not in choices:
            raise ScenarioError(f"{where} ({kind}): {name} = {value!r}; expected one of "
                                f"{list(choices)}")
    if (kind in ("wait", "cancel_after") and args["ms"] < 0) or \
            (kind == "repeat" and args["times"] < 0):
        raise ScenarioError(f"{where} ({kind}): values must be non-negative")
    if kind == "update" and not 0 < args.get("fraction", 1) <= 1:
        raise ScenarioError(f"{where} (update): fraction must be in (0, 1]")
    body = _steps(args.pop("steps"), f"{where}.steps") if kind == "repeat" else ()
    return Step(kind, where, args, body)


def parse_scenario(data: Mapping[str, Any], name: str = "scenario") -> Scenario:
    """Validate a scenario given as data (the TOML document's shape)."""
    unknown = sorted(set(data) - {"drill", "steps"})
    if unknown:
        raise ScenarioError(f"unknown top-level key(s) {unknown}; expected [drill] and "
                            "[[steps]]")
    meta = data.get("drill", {})
    if not isinstance(meta, Mapping):
        raise ScenarioError("[drill] must be a table")
    bad = sorted(set(meta) - {"name", "size", "residency"})
    if bad:
        raise ScenarioError(f"[drill]: unknown key(s) {bad}; valid: ['name', 'residency', 'size']")
    if "size" in meta:
        try:
            parse_size(str(meta["size"]))
        except ValueError as exc:
            raise ScenarioError(f"[drill]: {exc}") from None
    return Scenario(str(meta.get("name", name)), _steps(data.get("steps"), "steps"),
                    meta.get("size"), meta.get("residency"))


def load_scenario(path: str | Path) -> Scenario:
    """Read and validate a TOML scenario file."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ScenarioError(f"scenario file not found: {p}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(f"{p}: invalid TOML: {exc}") from None
    return parse_scenario(data, p.stem)


def default_scenario(cycles: int = 1) -> Scenario:
    """attach, generate, then ``cycles`` x (sleep, expect no device bytes, wake, generate,
    expect outputs equal to the first)."""
    cycle = [{"do": "sleep"}, {"do": "expect", "phase": "sleeping", "device_bytes_zero": True},
             {"do": "wake"}, {"do": "generate"}, {"do": "expect", "outputs_equal": "first"}]
    return parse_scenario({"drill": {"name": "default"}, "steps": [
        {"do": "attach"}, {"do": "generate", "label": "first"},
        {"do": "checkpoint", "name": "start"},
        {"do": "repeat", "times": cycles, "steps": cycle},
        {"do": "expect", "checksum_equal": "start"}]})


@dataclass(frozen=True)
class StepOutcome:
    index: str
    step: str
    ok: bool
    message: str
    seconds: float
    bytes_moved: int
    device_bytes: int
    host_bytes: int
    phase: str
    started: float = 0.0  # seconds since the drill started
    # The host bytes after the step by kind: page-locked, pageable, only in checkpoint files.
    pinned_bytes: int = 0
    pageable_bytes: int = 0
    file_backed_bytes: int = 0

    @property
    def gbps(self) -> float:
        return gbps(self.bytes_moved, self.seconds)


@dataclass
class DrillReport:
    scenario: str
    device: str
    pipeline_bytes: int
    outcomes: list[StepOutcome] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    samples: list[tuple[float, int, int, str]] = field(default_factory=list)
    host_budget: int | None = None  # the controller's host and pin budgets (None: no cap)
    pin_budget: int | None = None
    peak_host_bytes: int = 0  # the most host bytes the device layer held at once

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def verdict(self) -> str:
        if self.passed:
            return f"PASS: {len(self.outcomes)} steps, every expectation met"
        return f"FAIL: {len(self.failures)} problem(s): " + "; ".join(self.failures)

    def as_dict(self) -> dict[str, Any]:
        return {"scenario": self.scenario, "device": self.device,
                "pipeline_bytes": self.pipeline_bytes, "passed": self.passed,
                "host_budget": self.host_budget, "pin_budget": self.pin_budget,
                "peak_host_bytes": self.peak_host_bytes,
                "verdict": self.verdict, "failures": self.failures,
                "steps": [asdict(o) | {"gbps": o.gbps} for o in self.outcomes]}


class _Runner:
    def __init__(self, ctl: LifecycleController, pipe: DemoPipeline, layer: FaultInjection,
                 report: DrillReport, on_step: Callable[[StepOutcome], None] | None) -> None:
        self.ctl = ctl
        self.pipe = pipe
        self.layer = layer
        self.report = report
        self.on_step = on_step
        self.outputs: dict[str, torch.Tensor] = {}
        self.checksums: dict[str, dict[str, str]] = {}
        self.states: dict[str, dict[str, dict[str, torch.Tensor]]] = {}  # checkpoint copies
        self.last_output: torch.Tensor | None = None
        self.last: tuple[bool, str] = (True, "")
        self.cancel_ms: float | None = None
        self.t0 = time.perf_counter()
        self.tmp = tempfile.TemporaryDirectory(prefix="residency-drill-")

    def flat(self, steps: Sequence[Step]) -> Iterator[tuple[Step, Step | None]]:
        """Steps in execution order, each with the step after it."""
        order: list[Step] = []

        def walk(seq: Sequence[Step]) -> None:
            for s in seq:
                if s.kind == "repeat":
                    for _ in range(s.args["times"]):
                        walk(s.body)
                else:
                    order.append(s)
        walk(steps)
        for i, s in enumerate(order):
            yield s, order[i + 1] if i + 1 < len(order) else None

    async def run(self, scenario: Scenario) -> None:
        try:
            await self._run(scenario)
        except BaseExceptionGroup as group:  # the sampler never raises: unwrap the step's error
            if len(group.exceptions) == 1:
                raise group.exceptions[0]  # noqa: B904
            raise
        finally:
            self.tmp.cleanup()

    async def _run(self, scenario: Scenario) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.sample)
            for step, nxt in self.flat(scenario.steps):
                start = time.perf_counter()
                bytes_moved = 0
                try:
                    ok, message, bytes_moved = await self.execute(step)
                except (LifecycleError, HostBudgetExceeded) as exc:
                    ok, message = False, f"{type(exc).__name__}: {exc}"
                if step.kind != "expect":
                    self.last = (ok, message)
                    expected_failure = nxt is not None and nxt.kind == "expect" and \
                        nxt.args.get("success") is False
                    if not ok and not expected_failure:
                        self.report.failures.append(f"{step.where} {step.kind}: {message}")
                elif not ok:
                    self.report.failures.append(f"{step.where} expect: {message}")
                rep = self.ctl.report()
                outcome = StepOutcome(step.where, step.kind, ok, message,
                                      time.perf_counter() - start, bytes_moved,
                                      rep.device_bytes, rep.host_bytes, rep.phase.value,
                                      start - self.t0, rep.pinned_bytes, rep.pageable_bytes,
                                      rep.file_backed_bytes)
                self.report.peak_host_bytes = rep.peak_host_bytes
                self.report.outcomes.append(outcome)
                self.record()
                if self.on_step:
                    self.on_step(outcome)
            tg.cancel_scope.cancel()

    def record(self) -> None:
        rep = self.ctl.report()
        self.report.samples.append((time.perf_counter() - self.t0, rep.device_bytes,
                                    rep.host_bytes, rep.phase.value))

    async def sample(self) -> None:
        while True:
            self.record()
            await anyio.sleep(0.02)

    async def transition(self, call: Callable[[], Any]) -> Any:
        ms, self.cancel_ms = self.cancel_ms, None
        if ms is None:
            return await call()
        with anyio.move_on_after(ms / 1000) as scope:
            return await call()
        if scope.cancelled_caught:
            raise _Cancelled(f"cancelled after {ms:g} ms; phase is {self.ctl.phase.value}")
        return None

    async def execute(self, step: Step) -> tuple[bool, str, int]:
        try:
            return await _RUNNERS[step.kind](self, step.args)
        except _Cancelled as exc:
            return False, str(exc), 0

    async def attach(self, a: Mapping[str, Any]) -> tuple[bool, str, int]:
        # placed = "host" (the default): the pipeline as built, in host memory; attach keeps
        # its tensors as the mirrors, so a sleep before any update copies nothing. "device":
        # first put in the device's memory (model.to("cuda")), so the first sleep copies all.
        if a.get("placed") == "device" and self.ctl.phase is Phase.UNINITIALIZED:
            self.layer.place(*self.pipe.modules.values())
        await self.transition(lambda: self.ctl.attach(self.pipe))
        return True, f"attached {len(self.ctl.components)} components", 0

    async def detach(self, a: Mapping[str, Any]) -> tuple[bool, str, int]:
        await self.transition(self.ctl.detach)
        return True, "detached", 0

    async def sleep(self, a: Mapping[str, Any]) -> tuple[bool, str, int]:
        r = await self.transition(lambda: self.ctl.sleep(a.get("discard", False)))
        return r.success, r.message, r.bytes_moved

    async def wake(self, a: Mapping[str, Any]) -> tuple[bool, str, int]:
        r = await self.transition(self.ctl.wake)
        return r.success, r.message, r.bytes_moved

    async def generate(self, a: Mapping[str, Any]) -> tuple[bool, str, int]:
        out = await self.pipe.generate(ctl=self.ctl, steps=a.get("steps", 3), seed=a.get("seed", 0))
        self.last_output = out
        if "label" in a:
            self.outputs[a["label"]] = out
        return True, f"image {tuple(out.shape)}", 0

    async def fail_next(self, a: Mapping[str, Any]) -> tuple[bool, str, int]:
        self.layer.arm(**{f"{a['what']}_at": a.get("at", 1)})
        return True, f"next {a['what']} #{a.get('at', 1)} will fail", 0

    async def cancel_after(self, a: Mapping[str, Any]) -> tuple[bool, str, int]:
        self.cancel_ms = float(a["ms"])
        return True, f"next transition cancelled after {a['ms']:g} ms", 0

    async def wait(self, a: Mapping[str, Any]) -> tuple[bool, str, int]:
        await anyio.sleep(a["ms"] / 1000)
        return True, f"waited {a['ms']:g} ms", 0

    async def checkpoint(self, a: Mapping[str, Any]) -> tuple[bool, str, int]:
        self.checksums[a["name"]] = self.ctl.weights_checksum(algorithm="full")
        # The weights themselves too: an update may bring them back (`update from=...`).
        self.states[a["name"]] = {name: {k: v.detach().clone() for k, v in m.state_dict().items()}
                                  for name, m in self.ctl.components.items()}
        return True, f"checksums and weights recorded as {a['name']!r}", 0

    async def update(self, a: Mapping[str, Any]) -> tuple[bool, str, int]:
        names = a.get("components") or ["transformer"]
        unknown = [n for n in names if n not in self.ctl.components]
        if unknown:
            return False, (f"update names unknown component(s) {unknown}; components: "
                           f"{sorted(self.ctl.components)}"), 0
        if "from" in a and a["from"] not in self.states:
            return False, f"no checkpoint named {a['from']!r} to update from", 0
        states = self.new_states(names, a)
        if a.get("source", "disk") == "tensors":
            r = await self.transition(
                lambda: self.ctl.update_weights_from_tensors(states[names[0]], names[0]))
        else:
            path = a.get("path") or self.write_checkpoint(states)
            r = await self.transition(lambda: self.ctl.update_weights_from_disk(path, names))
        return r.success, r.message, r.bytes_written

    def new_states(self, names: Sequence[str], a: Mapping[str, Any]
                   ) -> dict[str, dict[str, torch.Tensor]]:
        """The weights an update step writes: the component's (or those a checkpoint recorded,
        ``from``) plus ``delta`` where floating point; only the first ``fraction`` of them by
        name (a partial update). Without ``from``, floating-point tensors only."""
        delta = float(a.get("delta", 0.001))
        out = {}
        for name in names:
            source = self.states[a["from"]][name] if "from" in a else \
                {k: v for k, v in self.ctl.components[name].state_dict().items()
                 if v.is_floating_point()}
            keys = sorted(source)
            keys = keys[:max(1, round(len(keys) * float(a.get("fraction", 1))))]
            out[name] = {k: source[k] + delta if source[k].is_floating_point() else source[k]
                         for k in keys}
        return out

    def write_checkpoint(self, states: Mapping[str, Mapping[str, torch.Tensor]]) -> str:
        root = Path(self.tmp.name) / f"ckpt-{len(list(Path(self.tmp.name).iterdir()))}"
        return str(write_checkpoint(states, root))

    async def expect(self, a: Mapping[str, Any]) -> tuple[bool, str, int]:
        problems: list[str] = []
        ok, message = self.last
        if "phase" in a and self.ctl.phase.value != a["phase"]:
            problems.append(f"phase is {self.ctl.phase.value}, expected {a['phase']}")
        if "success" in a and ok is not a["success"]:
            problems.append(f"last step success={ok}, expected {a['success']} ({message})")
        if "message" in a and a["message"] not in message:
            problems.append(f"last message {message!r} lacks {a['message']!r}")
        if a.get("device_bytes_zero") and self.ctl.report().device_bytes:
            problems.append(f"{self.ctl.report().device_bytes} device bytes left")
        if "stale" in a and bool(self.ctl.stale) is not a["stale"]:
            problems.append(f"stale components {dict(self.ctl.stale)}, expected "
                            f"{'some' if a['stale'] else 'none'}")
        for key, same in (("outputs_equal", True), ("outputs_differ", False)):
            if key in a:
                ref = self.outputs.get(a[key])
                if ref is None or self.last_output is None:
                    problems.append(f"no output labelled {a[key]!r} to compare with")
                elif torch.equal(ref, self.last_output) is not same:
                    problems.append(f"output {'differs from' if same else 'equals'} {a[key]!r}")
        for key, same in (("checksum_equal", True), ("checksum_differ", False)):
            if key in a:
                ref_sums = self.checksums.get(a[key])
                if ref_sums is None:
                    problems.append(f"no checkpoint named {a[key]!r}")
                elif (self.ctl.weights_checksum(algorithm="full") == ref_sums) is not same:
                    problems.append(f"checksums {'differ from' if same else 'equal'} {a[key]!r}")
        return not problems, "; ".join(problems) or "met", 0


class _Cancelled(Exception):
    pass


_Run = Callable[[_Runner, Mapping[str, Any]], Awaitable[tuple[bool, str, int]]]
# Step kind -> its runner: one entry per kind of SCHEMA but "repeat" (flattened at load).
_RUNNERS: dict[str, _Run] = {
    "attach": _Runner.attach, "detach": _Runner.detach, "sleep": _Runner.sleep,
    "wake": _Runner.wake, "generate": _Runner.generate, "update": _Runner.update,
    "fail_next": _Runner.fail_next, "cancel_after": _Runner.cancel_after, "wait": _Runner.wait,
    "checkpoint": _Runner.checkpoint, "expect": _Runner.expect,
}
assert set(_RUNNERS) == set(SCHEMA) - {"repeat"}


async def run_drill(scenario: Scenario, *, device: str | None = None, size: str | None = None,
                    residency: str | None = None, seed: int = 0,
                    on_step: Callable[[StepOutcome], None] | None = None,
                    on_progress: Callable[[str, int, int], None] | None = None,
                    budget: str | None = None, host_budget: str | None = None,
                    pin_budget: str | None = None) -> DrillReport:
    """Build the demo pipeline and run ``scenario`` against a fresh controller.

    ``on_step`` is told each step's outcome; ``on_progress`` the bytes of moves in flight.
    ``residency="auto"`` plans the residency under ``budget`` at attach; ``host_budget`` /
    ``pin_budget``: the controller's (a step they refuse fails with the numbers)."""
    size_bytes = parse_size(size or scenario.size or "64MB")
    wanted = residency or scenario.residency
    auto = wanted is not None and wanted.strip().lower() == "auto"
    if auto and budget is None:
        raise ValueError("--residency auto needs --budget (e.g. 300MB or 50%)")
    if budget is not None and not auto:
        raise ValueError("--budget is used with --residency auto")
    config: ResidencyConfig | str = "auto" if auto else ResidencyConfig.parse(wanted)
    if isinstance(config, ResidencyConfig):
        config.validate_components(DemoPipeline.COMPONENTS)  # bad usage, before anything runs
    pipe = DemoPipeline.build(size_bytes, seed=seed)
    # The drill's own device layer, so that fail_next steps inject real faults.
    layer = faulty_device_layer(device)
    ctl = LifecycleController(device_layer=layer, residency=config, progress=on_progress,
                              device_budget=budget, host_budget=host_budget,
                              pin_budget=pin_budget)
    report = DrillReport(scenario.name, str(ctl.device), pipe.nbytes,
                         host_budget=ctl.host_budgets.host, pin_budget=ctl.host_budgets.pin)
    await _Runner(ctl, pipe, layer, report, on_step).run(scenario)
    return report
