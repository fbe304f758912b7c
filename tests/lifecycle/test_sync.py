"""The synchronous facade: blocking calls from plain threads, on an asyncio or trio portal."""

from __future__ import annotations

import inspect
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import anyio
import pytest
import torch

from lifecycle import ComponentAsleep, LifecycleController, Phase, TransitionFailed
from lifecycle._blocking import SyncLifecycleController
from lifecycle._checksum import tensor_sha256
from lifecycle._planner import ResidencyPlan
from lifecycle._results import Computed
from tests.helpers import faulty_device, fingerprints, run_pipeline, small_pipeline

pytestmark = pytest.mark.moves

Backend = Literal["asyncio", "trio"]
BACKENDS = pytest.mark.parametrize("backend", ["asyncio", "trio"])
X = torch.linspace(-1, 1, 32).reshape(2, 16)  # an input for the "transformer" component


def in_thread(fn: Callable[[], Any], timeout: float = 20.0) -> Any:
    """Run ``fn`` in a new plain thread; return its result or re-raise its error here."""
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=target)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the thread did not finish (deadlock?)"
    if "error" in out:
        raise out["error"]
    return out.get("result")


def portal_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("SyncLifecycleController-")}


def assert_outputs_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def reference_checksum(pipe: dict[str, torch.nn.Module], backend: Backend) -> dict[str, str]:
    """The checksum a fresh async controller computes for ``pipe``."""
    async def run() -> dict[str, str]:
        async with LifecycleController("cpu") as ctl:
            await ctl.attach(pipe)
            return ctl.weights_checksum()

    return anyio.run(run, backend=backend)


@BACKENDS
def test_plain_thread_drives_the_whole_lifecycle_and_close_stops_the_loop(backend: Backend) -> None:
    """A plain thread attaches, sleeps, wakes, uses, updates and checksums through blocking
    calls; close detaches, stops the portal thread and makes later calls raise."""
    pipe = small_pipeline()
    outputs = run_pipeline(pipe)
    before = portal_threads()
    sctl = SyncLifecycleController("cpu", backend=backend)
    (loop_thread,) = portal_threads() - before

    def scenario() -> dict[str, str]:
        assert sctl.attach(pipe) is Phase.AWAKE
        slept = sctl.sleep()
        report = sctl.report()
        assert slept.success and report.phase is sctl.phase is Phase.SLEEPING
        assert report.device_bytes == 0
        assert sctl.wake().success
        assert sctl.phase is Phase.AWAKE  # type: ignore[comparison-overlap]  # mypy narrowed it
        assert_outputs_equal(run_pipeline(pipe), outputs)
        with torch.no_grad(), sctl.use("transformer") as module:
            assert torch.equal(module(X), outputs[1])
        result = sctl.update_weights_from_tensors({"0.bias": torch.zeros(32)}, "transformer")
        assert result.success and result.version == sctl.weights_version == 1
        return sctl.weights_checksum()

    sums = in_thread(scenario)
    fresh = small_pipeline()
    with torch.no_grad():
        fresh["transformer"][0].bias.zero_()  # type: ignore[index]
    assert sums == reference_checksum(fresh, backend)

    sctl.close()
    assert sctl.controller.phase is Phase.UNINITIALIZED
    assert not loop_thread.is_alive()
    with pytest.raises(RuntimeError, match="SyncLifecycleController is closed"):
        sctl.sleep()
    with pytest.raises(RuntimeError, match="SyncLifecycleController is closed"):
        _ = sctl.phase
    sctl.close()  # idempotent


@BACKENDS
def test_many_threads_calling_at_once_all_get_answers_and_weights_survive(backend: Backend) -> None:
    """Four threads making ten random calls each (sleep, wake, use with a forward, checksum)
    all get answers without deadlock; the end state is consistent and weights unchanged."""
    pipe = small_pipeline()
    sums, outputs = fingerprints(pipe), run_pipeline(pipe)
    layer = faulty_device(jitter=0.0005, seed=1)  # small random copy delays: real interleavings
    with SyncLifecycleController(device_layer=layer, backend=backend) as sctl:
        sctl.attach(pipe)
        first = sctl.weights_checksum()
        answers: list[list[str]] = [[] for _ in range(4)]
        errors: list[BaseException] = []

        def worker(i: int) -> None:
            rng = random.Random(i)
            try:
                for _ in range(10):
                    op = rng.choice(["sleep", "wake", "use", "checksum"])
                    if op == "sleep":
                        assert sctl.sleep().success
                    elif op == "wake":
                        assert sctl.wake().success
                    elif op == "checksum":
                        assert sctl.weights_checksum() == first
                    else:
                        try:
                            with torch.no_grad(), sctl.use("transformer") as module:
                                assert torch.equal(module(X), outputs[1])
                        except ComponentAsleep:
                            op = "use (asleep)"
                    answers[i].append(op)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "deadlock: a thread never got an answer"
        assert errors == []
        assert [len(a) for a in answers] == [10] * 4
        assert sctl.phase in (Phase.AWAKE, Phase.SLEEPING)
        assert sctl.in_flight == 0 and sctl.transition is None
        sctl.wake()
        assert fingerprints(pipe) == sums
        assert_outputs_equal(run_pipeline(pipe), outputs)


@BACKENDS
def test_failed_sleep_raises_transition_failed_in_the_calling_thread_and_retry_works(
        backend: Backend) -> None:
    """An injected copy failure makes sleep raise TransitionFailed in the calling thread,
    leaves the pipeline AWAKE and intact, and a retry succeeds (a pipeline on the device at
    attach: its sleep copies)."""
    pipe = small_pipeline()
    sums, outputs = fingerprints(pipe), run_pipeline(pipe)
    layer = faulty_device()
    layer.place(*pipe.values())
    with SyncLifecycleController(device_layer=layer, backend=backend) as sctl:
        sctl.attach(pipe)
        assert sctl.device_layer is layer
        device_bytes = sctl.report().device_bytes
        layer.arm(copy_at=1)

        def failing_sleep() -> None:
            with pytest.raises(TransitionFailed) as info:
                sctl.sleep()
            assert info.value.trigger == "sleep"

        in_thread(failing_sleep)
        assert layer.faults == 1
        assert sctl.phase is Phase.AWAKE and sctl.report().device_bytes == device_bytes
        assert_outputs_equal(run_pipeline(pipe), outputs)
        assert in_thread(sctl.sleep).success
        assert sctl.phase is Phase.SLEEPING  # type: ignore[comparison-overlap]  # mypy narrowed it
        sctl.wake()
        assert fingerprints(pipe) == sums


@BACKENDS
def test_with_block_closes_even_when_the_body_raises_and_use_while_asleep_raises(
        backend: Backend) -> None:
    """Leaving ``with SyncLifecycleController(...)`` by an exception still closes it; a use()
    while sleeping raises ComponentAsleep in the worker thread."""

    class Boom(Exception):
        pass

    pipe = small_pipeline()
    before = portal_threads()
    with pytest.raises(Boom), SyncLifecycleController("cpu", backend=backend) as sctl:
        sctl.attach(pipe)
        sctl.sleep()

        def use_while_asleep() -> None:
            with pytest.raises(ComponentAsleep), sctl.use("transformer"):
                pass  # pragma: no cover - never entered

        in_thread(use_while_asleep)
        assert sctl.in_flight == 0
        raise Boom
    assert sctl.controller.phase is Phase.UNINITIALIZED
    assert portal_threads() == before
    with pytest.raises(RuntimeError, match="closed"):
        sctl.wake()


@BACKENDS
def test_a_threads_request_prefetches_for_that_threads_uses(backend: Backend) -> None:
    """Inside ``with sctl.request(order)`` the thread's use() of the first component starts
    the next one's prefetch (as a request does for its own task in async code)."""
    pipe = small_pipeline()
    order = list(pipe)
    with SyncLifecycleController("cpu", residency="all=component-offload",
                                 backend=backend) as sctl:
        sctl.attach(pipe)
        with sctl.request(order):
            with sctl.use(order[0]):
                deadline = time.monotonic() + 5
                while sctl.in_flight < 2:  # our lease + the prefetch of order[1]
                    assert time.monotonic() < deadline, "no prefetch started"
                    time.sleep(0.001)
            with torch.no_grad(), sctl.use(order[1]) as module:
                assert module(X).shape == (2, 16)
        assert sctl.in_flight == 0
        assert sctl.report().device_bytes == 0


@BACKENDS
def test_close_inside_a_use_of_the_same_thread_raises_instead_of_deadlocking(
        backend: Backend) -> None:
    """close() from within the calling thread's own use() raises RuntimeError at once."""
    with SyncLifecycleController("cpu", backend=backend) as sctl:
        sctl.attach(small_pipeline())
        with sctl.use("vae"), pytest.raises(RuntimeError, match="wait for itself"):
            sctl.close()
        assert sctl.phase is Phase.AWAKE


@BACKENDS
def test_a_constructor_error_propagates_and_leaves_no_loop_thread(backend: Backend) -> None:
    """A controller that cannot be built raises its own error and stops the portal thread."""
    before = portal_threads()
    with pytest.raises(ValueError, match="residency mode"):
        SyncLifecycleController("cpu", residency="vae=no-such-mode", backend=backend)
    assert portal_threads() == before


# LifecycleController's public names the facade does not have, and what it offers instead.
# (``use`` and ``request`` are async context managers there; here they are plain ones, with
# the same names and parameters, so they are not excluded.)
NOT_IN_FACADE = {
    "aclose",  # an async close: the facade's close() (or its with-block) detaches and stops the loop
    # Blocking code has no event loop to keep serving: the facade's weights_checksum already
    # hashes in the controller's worker thread under its lock (it is weights_checksum_async).
    "weights_checksum_async",
}
# The facade's own: its lifetime, and the async controller underneath.
FACADE_ONLY = {"close", "closed", "controller"}
# Parameters taking a request: the controller's is an async callable run in its loop, the
# facade's a blocking one (e.g. through the facade's own use()), run in a worker thread.
BLOCKING_CALLABLES = {("plan", "warmup"), ("set_residency", "validate")}


def public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def test_the_facade_has_every_public_name_of_the_controller_with_the_same_parameters() -> None:
    """The facade's public names are the controller's but the excluded ones (plus its own);
    properties stay properties, and every method takes the same parameters (names, kinds,
    defaults, annotations; a request parameter takes a blocking callable instead)."""
    assert public(SyncLifecycleController) - FACADE_ONLY == \
        public(LifecycleController) - NOT_IN_FACADE
    with SyncLifecycleController("cpu") as sctl:
        for name in sorted(public(LifecycleController) - NOT_IN_FACADE):
            theirs = inspect.getattr_static(LifecycleController, name)
            ours = inspect.getattr_static(SyncLifecycleController, name)
            if isinstance(theirs, property):
                assert isinstance(ours, property | Computed), name
                continue
            expected = inspect.signature(getattr(sctl.controller, name)).parameters
            got = dict(inspect.signature(getattr(sctl, name)).parameters)
            for param in BLOCKING_CALLABLES:
                if param[0] == name:
                    got[param[1]] = got[param[1]].replace(
                        annotation=expected[param[1]].annotation)
            assert got == dict(expected), name


def blocking_request(sctl: SyncLifecycleController, order: list[str]) -> None:
    """One request through the facade's blocking use(): every component once."""
    with sctl.request(order):
        for name in order:
            with sctl.use(name):
                pass


@BACKENDS
def test_plan_with_a_blocking_warmup_then_set_residency_validates_it(backend: Backend) -> None:
    """plan() runs a blocking warm-up (using the facade's own use() from a worker thread) and
    set_residency() applies the plan and validates it with the same warm-up; the weights are
    unchanged."""
    pipe = small_pipeline()
    order = list(pipe)
    with SyncLifecycleController("cpu", backend=backend) as sctl:
        sctl.attach(pipe)
        before = sctl.weights_checksum()
        plan = sctl.plan("90%", lambda: blocking_request(sctl, order))
        assert isinstance(plan, ResidencyPlan)
        measured = sctl.controller._measurer.measurements
        assert measured is not None and measured.source == "warm-up"
        assert [u.name for u in measured.uses] == order
        change = sctl.set_residency(plan, latency_tolerance=100.0)
        assert change.success and change.validated, change.message
        assert sctl.controller.config == plan.config
        assert sctl.weights_checksum() == before


@BACKENDS
def test_reset_peak_world_size_and_the_checksums_answer_through_the_facade(
        backend: Backend) -> None:
    """world_size reads 1 without a group; reset_peak starts the peak again from what is
    held; the checksums across ranks and the per-tensor check answer as the controller's."""
    pipe = small_pipeline()
    with SyncLifecycleController("cpu", backend=backend) as sctl:
        sctl.attach(pipe)
        assert sctl.world_size == 1 and sctl.weight_update_groups == {}
        sctl.sleep()
        assert sctl.report().peak_device_bytes > 0
        sctl.reset_peak()
        assert sctl.report().peak_device_bytes == 0
        sctl.wake()
        across = sctl.weights_checksum_across_ranks(["transformer"])
        assert across.agree and across.per_rank == {
            "transformer": {0: sctl.weights_checksum(["transformer"])["transformer"]}}
        state = pipe["transformer"].state_dict()
        expected = {name: tensor_sha256(t) for name, t in state.items()}
        assert sctl.check_tensor_hashes("transformer", expected).success
        wrong = dict(expected, **{"0.bias": tensor_sha256(state["0.bias"] + 1)})
        check = sctl.check_tensor_hashes("transformer", wrong)
        assert not check.success and check.mismatched == ("0.bias",)
