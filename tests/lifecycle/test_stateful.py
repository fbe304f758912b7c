"""Model-based stateful test: random sequences of lifecycle calls, faults, cancellations
and concurrent callers, checked against a model after every step.

Profiles: ``ci`` (default, well under a minute per backend) and ``deep`` (thousands of
examples): ``HYPOTHESIS_PROFILE=deep pytest tests/lifecycle/test_stateful.py`` or
``python scripts/deep_stateful.py``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from safetensors.torch import save_file

from lifecycle import (
    ComponentAsleep,
    LifecycleController,
    OccupationResult,
    Phase,
    TransitionFailed,
    TransitionRejected,
    UpdateResult,
    WeightsDiscarded,
    WeightUpdateWhileSleeping,
)
from tests.helpers import faulty_device, fingerprints, small_pipeline

pytestmark = pytest.mark.moves

settings.register_profile("ci", max_examples=25, stateful_step_count=15, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("deep", max_examples=2000, stateful_step_count=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])

RESIDENCY = "text_encoder=layerwise-offload,vae=component-offload"
Faults = st.one_of(st.none(), st.tuples(st.sampled_from(["copy", "alloc"]),
                                        st.integers(1, 12)))


def _states() -> dict[str, dict[str, torch.Tensor]]:
    """Transformer weights by name: the original and two updates."""
    base = small_pipeline()["transformer"].state_dict()
    return {"orig": {k: v.clone() for k, v in base.items()},
            "A": {k: v + 0.5 for k, v in base.items()},
            "B": {k: v - 0.25 for k, v in base.items()}}


STATES = _states()


def _expected_sums() -> dict[str, dict[str, str]]:
    out = {}
    for name, state in STATES.items():
        pipe = small_pipeline()
        pipe["transformer"].load_state_dict(state)
        out[name] = fingerprints(pipe)
    return out


SUMS = _expected_sums()


class LifecycleMachine(RuleBasedStateMachine):
    backend = "asyncio"

    def __init__(self) -> None:
        super().__init__()
        self._portal_cm = anyio.from_thread.start_blocking_portal(self.backend)
        self.portal = self._portal_cm.__enter__()
        self.tmp = tempfile.TemporaryDirectory()
        for name in ("A", "B"):
            (Path(self.tmp.name) / name / "transformer").mkdir(parents=True)
            save_file(STATES[name], str(Path(self.tmp.name) / name / "transformer" / "w.safetensors"))
        self.pipe = small_pipeline()
        self.layer = faulty_device()
        self.ctl = self.portal.call(self._make)
        self.phase = Phase.UNINITIALIZED
        # The transformer's weights ("orig", "A", "B"), None while stale (discarded by a sleep
        # and not wholly updated since: undefined values, it serves nothing).
        self.weights: str | None = "orig"
        # The transformer's weights are the bytes of the checkpoint files a disk update read
        # (strategies._filebacked): a sleep keeps no host copy of them (its tensors hold
        # placeholders while asleep) and a wake reads them back from those files. Forgotten by
        # any other update.
        self.file_backed = False
        self.awake_bytes: int | None = None

    async def _make(self) -> LifecycleController:
        return LifecycleController(device_layer=self.layer, residency=RESIDENCY, drain_timeout=5.0)

    def teardown(self) -> None:
        # Closed before its loop ends: an open controller's copies still in flight would be
        # freed by the garbage collector later, in another example (reported there).
        self.portal.call(self.ctl.aclose)
        self._portal_cm.__exit__(None, None, None)
        self.tmp.cleanup()

    def run(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        async def call() -> Any:
            with anyio.fail_after(20):  # a deadlock fails the test instead of hanging it
                return await fn()
        return self.portal.call(call)

    def arm(self, fault: tuple[str, int] | None) -> None:
        self.layer.arm(**({f"{fault[0]}_at": fault[1]} if fault else {}))

    # -- rules ---------------------------------------------------------------------------
    @rule()
    def attach(self) -> None:
        if self.phase is Phase.UNINITIALIZED:
            assert self.run(lambda: self.ctl.attach(self.pipe)) is Phase.AWAKE
            self.phase = Phase.AWAKE
            if self.awake_bytes is None:
                self.awake_bytes = self.ctl.report().device_bytes
        else:
            with pytest.raises(TransitionRejected):
                self.run(lambda: self.ctl.attach(self.pipe))

    @property
    def stale(self) -> bool:
        return self.weights is None

    @rule()
    def detach(self) -> None:
        assert self.run(self.ctl.detach) is Phase.UNINITIALIZED
        self.phase = Phase.UNINITIALIZED
        if self.stale:  # the module keeps undefined values: give it known ones again
            self.pipe["transformer"].load_state_dict(STATES["orig"])
            self.weights = "orig"
        self.file_backed = False  # an attach records no files

    @rule(fault=Faults, trigger=st.sampled_from(["sleep", "wake"]), discard=st.booleans())
    def occupation(self, fault: tuple[str, int] | None, trigger: str, discard: bool) -> None:
        self.arm(fault)
        faults = self.layer.faults
        target = Phase.SLEEPING if trigger == "sleep" else Phase.AWAKE
        call = (lambda: self.ctl.sleep(discard=["transformer"])) if trigger == "sleep" and \
            discard else getattr(self.ctl, trigger)
        try:
            result = self.run(call)
        except TransitionFailed:
            assert self.layer.faults == faults + 1, "only an injected fault may fail a move"
            assert self.ctl.phase is self.phase
        else:
            assert isinstance(result, OccupationResult)
            if self.phase is Phase.UNINITIALIZED:
                assert (result.success, result.message) == (False, "pipeline not initialized")
            elif self.phase is target:
                assert result.success and result.message.startswith("already")
            else:
                assert result.success
                self.phase = target
                # A discarding sleep (or any sleep while stale) drops the transformer.
                dropped = trigger == "sleep" and (discard or self.stale)
                assert result.discarded == (("transformer",) if dropped else ())
                if dropped:
                    self.weights = None
        self.arm(None)

    @rule(fault=Faults, source=st.sampled_from(["tensors", "disk"]), valid=st.booleans(),
          partial=st.booleans())
    def update(self, fault: tuple[str, int] | None, source: str, valid: bool,
               partial: bool) -> None:
        new = "A" if self.weights != "A" else "B"
        partial = partial and self.stale and source == "tensors"  # (a partial write of
        # fresh weights would leave a mix the model does not track)
        self.arm(fault)
        faults = self.layer.faults

        async def call() -> UpdateResult:
            if source == "disk":
                path = Path(self.tmp.name) / new if valid else Path(self.tmp.name) / "missing"
                return await self.ctl.update_weights_from_disk(path)
            state = STATES[new] if valid else {"nope": torch.zeros(1)}
            if partial:
                state = dict(list(state.items())[:1])
            return await self.ctl.update_weights_from_tensors(state)

        if self.phase is Phase.SLEEPING:
            with pytest.raises(WeightUpdateWhileSleeping):
                self.run(call)
        else:
            result = self.run(call)
            if self.phase is Phase.UNINITIALIZED or not valid:
                assert not result.success
            elif result.success:
                if partial:
                    assert result.stale == {"transformer": len(STATES[new]) - 1}
                else:
                    self.weights = new
                    assert result.stale == {}
                self.file_backed = source == "disk"
            else:
                assert self.layer.faults == faults + 1 and "rolled back" in result.message
        self.arm(None)

    @rule(component=st.sampled_from(["text_encoder", "transformer", "vae"]))
    def use(self, component: str) -> None:
        async def call() -> None:
            async with self.ctl.use(component) as m:
                if component == "transformer":
                    m(torch.ones(1, 16))
                elif component == "vae":
                    m(torch.ones(1, 4, 5, 5))
                else:
                    m(torch.arange(4).reshape(1, 4))

        if self.phase is Phase.AWAKE and component == "transformer" and self.stale:
            with pytest.raises(WeightsDiscarded):
                self.run(call)
        elif self.phase is Phase.AWAKE:
            self.run(call)
        else:
            with pytest.raises(ComponentAsleep if self.phase is Phase.SLEEPING
                               else TransitionRejected):
                self.run(call)

    @precondition(lambda self: self.phase is not Phase.UNINITIALIZED)
    @rule(trigger=st.sampled_from(["sleep", "wake", "update"]),
          delay_ms=st.integers(0, 6))
    def cancelled(self, trigger: str, delay_ms: int) -> None:
        """The call is cancelled after a few ms of slow copies: either it committed or it
        left everything as it was."""
        if trigger == "update" and self.phase is Phase.SLEEPING:
            return
        new = "A" if self.weights != "A" else "B"
        self.layer.copy_delay = 0.0005

        async def call() -> None:
            with anyio.move_on_after(delay_ms / 1000):
                if trigger == "update":
                    await self.ctl.update_weights_from_tensors(STATES[new])
                else:
                    await getattr(self.ctl, trigger)()

        try:
            self.run(call)
        finally:
            self.layer.copy_delay = 0.0
        self.phase = self.ctl.phase  # either outcome is valid; invariants check the truth
        if trigger == "update" and not self.ctl.stale and fingerprints(self.pipe) == SUMS[new]:
            self.weights, self.file_backed = new, False

    @precondition(lambda self: self.phase is not Phase.UNINITIALIZED)
    @rule(calls=st.lists(st.sampled_from(["sleep", "wake", "use", "update"]), min_size=2,
                         max_size=8))
    def concurrent(self, calls: list[str]) -> None:
        """Several tasks call at once; every call gets an answer, none interleave."""
        answers: list[str] = []
        new = "A" if self.weights != "A" else "B"

        async def one(kind: str) -> None:
            try:
                if kind == "use":
                    async with self.ctl.use("transformer") as m:
                        m(torch.ones(1, 16))
                elif kind == "update":
                    await self.ctl.update_weights_from_tensors(STATES[new])
                else:
                    await getattr(self.ctl, kind)()
            except (ComponentAsleep, WeightUpdateWhileSleeping, WeightsDiscarded):
                pass
            answers.append(kind)

        async def all_calls() -> None:
            async with anyio.create_task_group() as tg:
                for kind in calls:
                    tg.start_soon(one, kind)

        self.run(all_calls)
        assert sorted(answers) == sorted(calls)
        self.phase = self.ctl.phase
        if not self.ctl.stale and fingerprints(self.pipe) == SUMS[new]:
            self.weights, self.file_backed = new, False

    # -- invariants ----------------------------------------------------------------------
    @invariant()
    def phase_matches_the_model(self) -> None:
        assert self.ctl.phase is self.phase
        assert self.ctl.transition is None

    @invariant()
    def weights_are_the_models_version(self) -> None:
        sums = fingerprints(self.pipe)
        # Stale: the transformer's values are undefined; file-backed and asleep: its weights
        # are in their files only (its tensors hold placeholders until the wake reads them).
        if self.weights is None or (self.file_backed and self.phase is Phase.SLEEPING):
            sums.pop("transformer")
        assert sums.items() <= SUMS[self.weights or "orig"].items()

    @invariant()
    def file_backing_is_the_models(self) -> None:
        if self.phase is Phase.SLEEPING:
            held = self.ctl.report().components["transformer"].file_backed_bytes
            assert (held > 0) == (self.file_backed and not self.stale)

    @invariant()
    def the_stale_set_is_the_models(self) -> None:
        assert dict(self.ctl.stale).keys() == ({"transformer"} if self.stale else set())

    @invariant()
    def device_bytes_match_the_phase(self) -> None:
        report = self.ctl.report()
        if self.phase is Phase.SLEEPING:
            assert report.device_bytes == 0
        elif self.phase is Phase.AWAKE:
            assert report.device_bytes == self.awake_bytes

    @invariant()
    def no_lease_is_leaked(self) -> None:
        assert self.ctl.in_flight == 0


class AsyncioMachine(LifecycleMachine):
    backend = "asyncio"


class TrioMachine(LifecycleMachine):
    backend = "trio"


profile = settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
TestLifecycleOnAsyncio = settings(profile)(AsyncioMachine).TestCase
TestLifecycleOnTrio = settings(profile)(TrioMachine).TestCase
