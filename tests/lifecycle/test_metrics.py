"""ControllerMetrics: counts from the library's events, state read at scrape time."""

from __future__ import annotations

import gc
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
import prometheus_client
import pytest
import torch
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from lifecycle import (
    LifecycleController,
    Phase,
    SyncLifecycleController,
    TransitionFailed,
    UpdateResult,
)
from lifecycle.metrics import ControllerMetrics
from tests.helpers import faulty_device, small_pipeline

pytestmark = [pytest.mark.anyio, pytest.mark.moves]

Key = tuple[str, ...]
Make = Callable[..., LifecycleController]


@pytest.fixture
async def make() -> AsyncIterator[Make]:
    """``make(...)``: a LifecycleController, closed after the test however it ends (a
    background mirror refresh still running would otherwise outlive the test)."""
    async with AsyncExitStack() as stack:
        def new(*args: Any, **kwargs: Any) -> LifecycleController:
            ctl = LifecycleController(*args, **kwargs)
            stack.push_async_callback(ctl.aclose)
            return ctl

        yield new


def series(metrics: ControllerMetrics, sample: str, *labels: str) -> dict[Key, float]:
    """``{label values: value}`` of every sample named ``sample`` in ``metrics.render()``."""
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name == sample:
                assert set(s.labels) == set(labels), (sample, s.labels)
                out[tuple(s.labels[k] for k in labels)] = s.value
    return out


def counted(metrics: ControllerMetrics) -> dict[Key, float]:
    """The transition counts that are not zero: ``{(trigger, outcome): n}``."""
    found = series(metrics, "residency_transitions_total", "trigger", "outcome")
    return {k: v for k, v in found.items() if v}


def timed(metrics: ControllerMetrics) -> dict[str, float]:
    """How many committed transitions the histogram holds, per trigger (when not zero)."""
    found = series(metrics, "residency_transition_seconds_count", "trigger")
    return {k[0]: v for k, v in found.items() if v}


def moved(metrics: ControllerMetrics) -> dict[str, float]:
    return {k[0]: v for k, v in series(metrics, "residency_bytes_moved_total", "direction").items()}


def phase_gauge(metrics: ControllerMetrics) -> dict[str, float]:
    return {k[0]: v for k, v in series(metrics, "residency_phase", "phase").items()}


def single(metrics: ControllerMetrics, sample: str) -> float:
    return series(metrics, sample)[()]


def placement(metrics: ControllerMetrics) -> dict[str, tuple[float, float]]:
    device = series(metrics, "residency_device_bytes", "component")
    host = series(metrics, "residency_host_bytes", "component")
    assert device.keys() == host.keys()
    return {k[0]: (device[k], host[k]) for k in device}


def reported(ctl: LifecycleController) -> dict[str, tuple[float, float]]:
    return {n: (float(c.device_bytes), float(c.host_bytes)) for n, c in ctl.report().components.items()}


def transformer_state(pipe: dict[str, nn.Module], delta: float = 1.0) -> dict[str, torch.Tensor]:
    return {k: (v + delta).contiguous() for k, v in pipe["transformer"].state_dict().items()}


def make_dirty(pipe: dict[str, nn.Module]) -> None:
    """Every weight written in place (unchanged values): the next sleep copies them all."""
    with torch.no_grad():
        for module in pipe.values():
            for p in module.parameters():
                p.mul_(1)


async def test_transitions_are_counted_by_trigger_and_outcome(make: Make) -> None:
    """Attach, sleep, a no-op sleep, wake, a committed and a refused update give exactly
    those counts, durations for the committed ones and the bytes each moved (a pipeline on
    the device at attach: its sleep copies)."""
    ctl = make("cpu")
    pipe = small_pipeline()
    ctl.device_layer.place(*pipe.values())
    with ControllerMetrics(ctl) as metrics:
        assert counted(metrics) == {} and timed(metrics) == {}
        await ctl.attach(pipe)
        slept = await ctl.sleep()
        assert (await ctl.sleep()).success  # already sleeping: a no-op
        woke = await ctl.wake()
        updated = await ctl.update_weights_from_tensors(transformer_state(pipe), "transformer")
        refused = await ctl.update_weights_from_tensors({"no.such.weight": torch.zeros(1)},
                                                        "transformer")
        assert updated.success and not refused.success
        assert counted(metrics) == {
            ("attach", "committed"): 1, ("sleep", "committed"): 1, ("sleep", "noop"): 1,
            ("wake", "committed"): 1, ("update_from_tensors", "committed"): 1,
            ("update_from_tensors", "refused"): 1,
        }
        assert timed(metrics) == {"attach": 1, "sleep": 1, "wake": 1, "update_from_tensors": 1}
        assert slept.bytes_moved > 0 and woke.bytes_moved > 0 and updated.bytes_written > 0
        assert moved(metrics) == {"to_host": slept.bytes_moved, "to_device": woke.bytes_moved,
                                  "written": updated.bytes_written}
        assert single(metrics, "residency_weights_version") == ctl.weights_version == 1


async def test_unseen_series_are_exported_at_zero(make: Make) -> None:
    """Before any transition every trigger's committed count, histogram and byte direction
    are already exported, at zero, and no request series exists yet."""
    metrics = ControllerMetrics(make("cpu"))
    transitions = series(metrics, "residency_transitions_total", "trigger", "outcome")
    assert {("sleep", "committed"), ("wake", "cancelled"), ("detach", "noop"),
            ("update_from_disk", "refused")} <= transitions.keys()
    assert set(transitions.values()) == {0.0}
    assert set(series(metrics, "residency_transition_seconds_count", "trigger")) == {
        (t,) for t in ("attach", "detach", "sleep", "wake", "update_from_disk",
                       "update_from_tensors", "update_from_distributed")}
    assert moved(metrics) == {"to_host": 0, "to_device": 0, "written": 0}
    assert series(metrics, "residency_requests_total", "path", "status") == {}
    metrics.close()


async def test_phase_gauge_follows_the_controller(make: Make) -> None:
    """The phase gauge is 1 for the current phase and 0 for the three others, through
    attach, sleep, wake, a weight update in progress and detach."""
    layer = faulty_device()
    ctl = make(device_layer=layer)
    pipe = small_pipeline()
    metrics = ControllerMetrics(ctl)

    def expect(phase: Phase) -> None:
        assert phase_gauge(metrics) == {p.value: float(p is phase) for p in Phase}

    expect(Phase.UNINITIALIZED)
    await ctl.attach(pipe)
    expect(Phase.AWAKE)
    await ctl.sleep()
    expect(Phase.SLEEPING)
    await ctl.wake()
    expect(Phase.AWAKE)
    layer.copy_delay = 0.02  # slow enough to scrape while the update writes
    result: list[UpdateResult] = []
    async with anyio.create_task_group() as tg:
        async def update() -> None:
            result.append(await ctl.update_weights_from_tensors(transformer_state(pipe)))

        tg.start_soon(update)
        with anyio.fail_after(5):
            while ctl.phase is not Phase.UPDATING_WEIGHTS:
                await anyio.sleep(0.001)
        expect(Phase.UPDATING_WEIGHTS)
    assert result[0].success
    layer.copy_delay = 0.0
    expect(Phase.AWAKE)
    await ctl.detach()
    expect(Phase.UNINITIALIZED)
    metrics.close()


async def test_placement_and_state_gauges_are_read_at_scrape_time(make: Make) -> None:
    """Device and host bytes per component equal ``ctl.report()`` after every transition,
    components appear with attach and disappear with detach, and in_flight and
    weights_version are the controller's own."""
    ctl = make("cpu", residency="vae=component-offload")
    pipe = small_pipeline()
    with ControllerMetrics(ctl) as metrics:
        assert placement(metrics) == {}
        await ctl.attach(pipe)
        assert placement(metrics) == reported(ctl)
        assert set(placement(metrics)) == {"text_encoder", "transformer", "vae"}
        assert placement(metrics)["vae"][0] == 0  # offloaded: nothing on the device tier
        async with ctl.use("transformer"):
            assert single(metrics, "residency_in_flight") == ctl.in_flight == 1
        assert single(metrics, "residency_in_flight") == 0
        await ctl.sleep()
        assert placement(metrics) == reported(ctl)
        assert all(device == 0 for device, _ in placement(metrics).values())
        await ctl.wake()
        assert placement(metrics) == reported(ctl)
        for version in (1, 2):
            await ctl.update_weights_from_tensors(transformer_state(pipe, version))
            assert single(metrics, "residency_weights_version") == ctl.weights_version == version
        await ctl.detach()
        assert placement(metrics) == {}


async def test_rolled_back_sleep_counts_as_rolled_back(make: Make) -> None:
    """A dirty sleep whose first copy fails counts once as rolled_back, not as committed,
    and adds no duration."""
    layer = faulty_device()
    ctl = make(device_layer=layer)
    pipe = small_pipeline()
    with ControllerMetrics(ctl) as metrics:
        await ctl.attach(pipe)
        await ctl.sleep()
        await ctl.wake()
        make_dirty(pipe)
        layer.arm(copy_at=1)
        with pytest.raises(TransitionFailed):
            await ctl.sleep()
        assert ctl.phase is Phase.AWAKE
        assert counted(metrics) == {("attach", "committed"): 1, ("sleep", "committed"): 1,
                                    ("wake", "committed"): 1, ("sleep", "rolled_back"): 1}
        assert timed(metrics) == {"attach": 1, "sleep": 1, "wake": 1}
        assert phase_gauge(metrics)["awake"] == 1


async def test_cancelled_sleep_counts_as_cancelled(make: Make) -> None:
    """A sleep cancelled while it copies (a pipeline on the device at attach: no mirrors
    yet) counts once as cancelled."""
    layer = faulty_device()
    ctl = make(device_layer=layer)
    pipe = small_pipeline()
    layer.place(*pipe.values())
    with ControllerMetrics(ctl) as metrics:
        await ctl.attach(pipe)
        layer.copy_delay = 0.005
        copies = layer.copies
        async with anyio.create_task_group() as tg:
            tg.start_soon(ctl.sleep)
            with anyio.fail_after(5):
                while layer.copies == copies:  # cancel once it copies, not before it starts
                    await anyio.sleep(0.001)
            tg.cancel_scope.cancel()
        assert ctl.phase is Phase.AWAKE
        assert counted(metrics) == {("attach", "committed"): 1, ("sleep", "cancelled"): 1}
        assert timed(metrics) == {"attach": 1}


async def test_controllers_with_different_ranks_do_not_mix_counts(make: Make) -> None:
    """Two controllers of one process, ranks 0 and 1: each one's metrics count only its
    own transitions and bytes."""
    ctl0, ctl1 = make("cpu", rank=0), make("cpu", rank=1)
    with ControllerMetrics(ctl0) as m0, ControllerMetrics(ctl1) as m1:
        await ctl0.attach(small_pipeline())
        await ctl1.attach(small_pipeline(seed=1))
        slept = await ctl1.sleep()
        await ctl1.sleep()
        assert counted(m0) == {("attach", "committed"): 1}
        assert counted(m1) == {("attach", "committed"): 1, ("sleep", "committed"): 1,
                               ("sleep", "noop"): 1}
        assert moved(m0) == {"to_host": 0, "to_device": 0, "written": 0}
        assert moved(m1)["to_host"] == slept.bytes_moved
        assert phase_gauge(m0)["awake"] == phase_gauge(m1)["sleeping"] == 1


async def test_events_after_close_are_not_counted(make: Make) -> None:
    """After close() (called twice: idempotent) transitions no longer count, while the
    scrape still answers with the current state."""
    ctl = make("cpu")
    metrics = ControllerMetrics(ctl)
    await ctl.attach(small_pipeline())
    metrics.close()
    metrics.close()
    assert metrics.closed
    await ctl.sleep()
    await ctl.wake()
    assert counted(metrics) == {("attach", "committed"): 1}
    assert moved(metrics) == {"to_host": 0, "to_device": 0, "written": 0}
    assert phase_gauge(metrics)["awake"] == 1
    with ControllerMetrics(ctl) as scoped:
        pass
    assert scoped.closed
    await ctl.sleep()
    assert counted(scoped) == {}


async def test_metrics_dropped_without_close_stop_counting(make: Make) -> None:
    """An unreferenced ControllerMetrics is not kept alive by its event sink, and the
    controller's later events then go nowhere."""
    ctl = make("cpu")
    metrics = ControllerMetrics(ctl)
    ref = weakref.ref(metrics)
    del metrics
    gc.collect()
    assert ref() is None
    await ctl.attach(small_pipeline())
    await ctl.sleep()


def test_requests_are_counted_by_path_and_status() -> None:
    """count_request counts per (path, status code)."""
    metrics = ControllerMetrics(LifecycleController("cpu"))
    metrics.count_request("/health", 200)
    metrics.count_request("/health", 200)
    metrics.count_request("/update_weights_from_disk", 400)
    assert series(metrics, "residency_requests_total", "path", "status") == {
        ("/health", "200"): 2, ("/update_weights_from_disk", "400"): 1}
    metrics.close()


def test_registry_is_private_unless_one_is_passed() -> None:
    """Without a registry the metrics live in a fresh one (never the global default); a
    registry passed in gets them, and registering twice there fails without a trace."""
    ctl = LifecycleController("cpu")
    with ControllerMetrics(ctl) as own:
        assert own.registry is not prometheus_client.REGISTRY
        assert prometheus_client.REGISTRY.get_sample_value("residency_in_flight") is None
        assert own.content_type == prometheus_client.CONTENT_TYPE_LATEST
        assert own.render() == prometheus_client.generate_latest(own.registry)
    shared = CollectorRegistry()
    with ControllerMetrics(ctl, registry=shared) as first:
        assert first.registry is shared
        assert shared.get_sample_value("residency_phase", {"phase": "uninitialized"}) == 1
        before = prometheus_client.generate_latest(shared)
        with pytest.raises(ValueError, match="Duplicated"):
            ControllerMetrics(ctl, registry=shared)
        assert prometheus_client.generate_latest(shared) == before


def test_a_sync_controller_is_watched_through_its_controller() -> None:
    """A SyncLifecycleController's transitions (run in its portal thread) are counted."""
    with SyncLifecycleController("cpu") as sync, ControllerMetrics(sync) as metrics:
        sync.attach(small_pipeline())
        sync.sleep()
        assert counted(metrics) == {("attach", "committed"): 1, ("sleep", "committed"): 1}
        assert phase_gauge(metrics)["sleeping"] == 1


async def test_two_controllers_of_one_rank_keep_their_own_counts(make: Make) -> None:
    """Events name their controller: two controllers with the same rank in one process
    never count each other's transitions."""
    from tests.helpers import small_pipeline

    a, b = make("cpu"), make("cpu")
    with ControllerMetrics(a) as ma, ControllerMetrics(b) as mb:
        await a.attach(small_pipeline())
        await b.attach(small_pipeline())
        await a.sleep()
        text_a, text_b = ma.render().decode(), mb.render().decode()
    assert 'residency_transitions_total{outcome="committed",trigger="sleep"} 1.0' in text_a
    assert 'residency_transitions_total{outcome="committed",trigger="sleep"} 0.0' in text_b
