"""The library's events go through stdlib logging: silent unless the host application
configures logging, complete when it does (a summary per committed transition, a warning per
rollback), and independent of structlog's configuration; configure_logging (JSON lines for
machines, no locals in tracebacks); the event sinks and lifecycle.testing.capture_events."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import structlog

import lifecycle
from lifecycle import LifecycleController, TransitionFailed, configure_logging
from lifecycle import _events as events
from lifecycle._owner import Owner
from lifecycle._phase import Phase
from lifecycle.testing import capture_events
from tests.helpers import faulty_device, small_pipeline

pytestmark = pytest.mark.anyio

OURS = ("lifecycle", "lifecycle.updates")


def _scrub() -> None:
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, events._StderrHandler)]:
        root.removeHandler(handler)
    for name in OURS:
        lg = logging.getLogger(name)
        for h in lg.handlers[:]:
            lg.removeHandler(h)
        lg.setLevel(logging.NOTSET)
        lg.propagate = True


@pytest.fixture(autouse=True)
def _default_logging() -> Iterator[None]:
    """Logging as an unconfigured application has it (root at WARNING, nothing of ours
    installed), whatever earlier tests did; restored afterwards."""
    root = logging.getLogger()
    level, transitions = root.level, logging.getLogger("transitions").level
    _scrub()
    root.setLevel(logging.WARNING)
    yield
    _scrub()
    root.setLevel(level)
    logging.getLogger("transitions").setLevel(transitions)


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def _listening(level: int = logging.DEBUG) -> Iterator[list[logging.LogRecord]]:
    lg = logging.getLogger("lifecycle")
    handler = _ListHandler()
    lg.addHandler(handler)
    lg.setLevel(level)
    try:
        yield handler.records
    finally:
        lg.removeHandler(handler)
        lg.setLevel(logging.NOTSET)


@contextmanager
def _no_root_handlers() -> Iterator[None]:
    root = logging.getLogger()
    saved = root.handlers[:]
    for h in saved:
        root.removeHandler(h)
    try:
        yield
    finally:
        for h in saved:
            root.addHandler(h)


def _events_of(records: list[logging.LogRecord], name: str) -> list[logging.LogRecord]:
    return [r for r in records if isinstance(r.msg, dict) and r.msg.get("event") == name]


async def _cycle(**kw: Any) -> None:
    ctl = LifecycleController("cpu", **kw)
    await ctl.attach(small_pipeline())
    await ctl.sleep()
    await ctl.wake()
    await ctl.detach()


async def test_unconfigured_application_sees_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    """With logging and structlog left at their defaults, attach/sleep/wake/detach print
    nothing of ours on stdout or stderr."""
    with _no_root_handlers():
        assert logging.getLogger("lifecycle").getEffectiveLevel() == logging.WARNING
        await _cycle()
    out, err = capfd.readouterr()
    assert out == ""
    assert not [name for name in events.EVENTS if name in err], err


def test_unconfigured_warnings_still_reach_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    """Unconfigured, a warning event reaches stderr as one readable line (logging's last
    resort), never stdout."""
    with _no_root_handlers():
        events.get_logger("lifecycle").warning(events.TRANSITION_ROLLED_BACK, trigger="sleep",
                                               error="InjectedFault: boom")
    out, err = capfd.readouterr()
    assert out == ""
    assert err == "transition.rolled_back trigger=sleep error='InjectedFault: boom'\n"


async def test_stdlib_handler_at_debug_receives_every_event_with_its_keys() -> None:
    """A stdlib handler at DEBUG on ``lifecycle`` gets transition.committed (info) and
    move.prepared (debug) records whose ``msg`` is the event dict, keys included."""
    with _listening() as records:
        await _cycle(rank=2)
    committed = _events_of(records, events.TRANSITION_COMMITTED)
    assert [r.msg["trigger"] for r in committed] == ["attach", "sleep", "wake", "detach"]  # type: ignore[index]
    assert all(r.levelno == logging.INFO and r.name == "lifecycle" for r in committed)
    # each record's location is the library code that emitted the event, not structlog's
    # nor the logging plumbing's (lifecycle._events)
    library = Path(lifecycle.__file__).parent
    assert all(Path(r.pathname).is_relative_to(library) and r.pathname != events.__file__
               for r in committed), {r.pathname for r in committed}
    sleep = committed[1].msg
    assert isinstance(sleep, dict)
    assert (sleep["source"], sleep["dest"], sleep["rank"], sleep["transition"]) == (
        "awake", "sleeping", 2, "sleep")
    assert sleep["bytes"] > 0 and "transition_id" in sleep
    moves = _events_of(records, events.MOVE_PREPARED)
    assert moves and all(r.levelno == logging.DEBUG for r in moves)
    slept = [r.msg for r in moves if r.msg["transition_id"] == sleep["transition_id"]]  # type: ignore[index]
    assert {m["component"] for m in slept} == {"text_encoder", "transformer", "vae"}  # type: ignore[index]
    assert all(m["bytes"] > 0 for m in slept)  # type: ignore[index,operator]


async def test_transition_context_ends_with_the_transition_and_keeps_the_callers() -> None:
    """Events inside a sleep carry its transition; afterwards (also after a refused call)
    the caller's own bound context variables are back as they were, and the transition's
    keys are gone."""
    ctl = LifecycleController("cpu")
    await ctl.attach(small_pipeline())
    structlog.contextvars.bind_contextvars(request="r-1", transition="outer")
    try:
        with _listening() as records:
            await ctl.sleep()
            await ctl.sleep()  # a noop: refused before anything is bound
            after = structlog.contextvars.get_contextvars()
        committed = [r.msg for r in _events_of(records, events.TRANSITION_COMMITTED)]
        assert [m["transition"] for m in committed] == ["sleep"]  # type: ignore[index]
        assert committed[0]["request"] == "r-1"  # type: ignore[index]
        assert after == {"request": "r-1", "transition": "outer"}
        structlog.contextvars.unbind_contextvars("transition")
        await ctl.wake()
        assert structlog.contextvars.get_contextvars() == {"request": "r-1"}
    finally:
        structlog.contextvars.unbind_contextvars("request", "transition")
        await ctl.detach()


async def test_a_collaborators_events_name_rank_and_controller_after_their_own_keys() -> None:
    """A sleep's per-component event (emitted by lifecycle._sleep, one of the controller's
    collaborators, whose call names neither) carries the controller's rank and id from its
    owner's logger, where a call spelling them would put them: after the call's own keys,
    before the event name, then the transition's context."""
    ctl = LifecycleController("cpu", rank=2)
    await ctl.attach(small_pipeline())
    with _listening() as records:
        await ctl.sleep()
    move = _events_of(records, events.MOVE_PREPARED)[0].msg
    assert isinstance(move, dict)
    own = ["component", "to", "units", "bytes", "seconds", "gbps", "rank", "controller", "event"]
    assert list(move)[:len(own)] == own  # then the context variables (in their own order)
    assert set(list(move)[len(own):]) == {"transition", "transition_id", "level"}
    assert (move["rank"], move["controller"]) == (2, ctl.id)
    (summary,) = [r.msg for r in _events_of(records, events.TRANSITION_COMMITTED)]  # the controller's
    assert list(summary)[:11] == ["trigger", "source", "dest", "outcome", "seconds", "bytes",
                                  "released", "gbps", "rank", "controller", "event"]
    await ctl.detach()


def test_an_owners_logger_names_the_rank_the_controller_has_at_each_event() -> None:
    """The owner reads its controller at each event: a rank that changed (a rebind) is the
    one named next; the plain rendering and the event sinks see the same keys."""

    controller = LifecycleController("cpu")
    owner = Owner(controller)
    with _listening() as records, capture_events() as seen:
        owner.log.info(events.PLAN_APPLIED, budget=1)
        controller.rank = 3
        owner.log.warning(events.PLAN_ROLLED_BACK, reason="validation")
    assert [str(r.msg) for r in records] == [
        f"plan.applied budget=1 rank=0 controller={controller.id}",
        f"plan.rolled_back reason=validation rank=3 controller={controller.id}"]
    assert [(e["rank"], e["controller"]) for e in seen] == [(0, controller.id), (3, controller.id)]
    assert (owner.id, owner.rank, owner.phase) == (controller.id, 3, Phase.UNINITIALIZED)


async def test_plain_formatter_renders_one_line_per_event() -> None:
    """What ``logging.basicConfig(level=DEBUG)`` prints: one line per event, the event name
    followed by its keys."""
    with _listening() as records:
        await _cycle()
    lines = [logging.Formatter("%(levelname)s:%(name)s:%(message)s").format(r) for r in records]
    assert all("\n" not in line for line in lines)
    summary = next(line for line in lines if "transition.committed" in line)
    assert summary.startswith("INFO:lifecycle:transition.committed trigger=attach source=")
    assert " transition=attach" in summary and " transition_id=" in summary
    assert "level=" not in summary
    assert any(line.startswith("DEBUG:lifecycle:move.prepared component=") for line in lines)


async def test_rolled_back_transition_is_one_warning_with_its_cause() -> None:
    """A failed transition yields one transition.rolled_back warning with trigger,
    transition and error."""
    layer = faulty_device()
    ctl = LifecycleController(device_layer=layer)
    await ctl.attach(small_pipeline())
    layer.arm(copy_at=2)
    with _listening() as records, pytest.raises(TransitionFailed):
        await ctl.sleep()
    (event,) = _events_of(records, events.TRANSITION_ROLLED_BACK)
    assert event.levelno == logging.WARNING
    assert isinstance(event.msg, dict)
    assert (event.msg["trigger"], event.msg["transition"]) == ("sleep", "sleep")
    assert event.msg["error"].startswith("InjectedFault: injected copy failure")


def test_structlog_configuration_does_not_affect_the_library() -> None:
    """An application configuring structlog (here: dropping everything) or capturing with
    structlog.testing does not change what the library's logger sends to logging."""
    def drop(*_: object) -> Any:
        raise structlog.DropEvent

    structlog.configure(processors=[drop])
    with _listening() as records, structlog.testing.capture_logs() as captured:
        events.get_logger("lifecycle").info(events.TRANSITION_COMMITTED, trigger="x")
    assert captured == []
    assert [(r.msg["event"], r.msg["trigger"]) for r in records] == [  # type: ignore[index]
        ("transition.committed", "x")]


def test_disabled_levels_are_dropped_before_rendering() -> None:
    """Below the stdlib level nothing reaches logging, and the level check comes first (after
    the event sinks, which see every event whatever the level)."""
    assert events._PROCESSORS[:2] == [events._to_sinks, structlog.stdlib.filter_by_level]
    with _listening(level=logging.INFO) as records:
        events.get_logger("lifecycle").debug(events.MOVE_PREPARED, component="vae")
        events.get_logger("lifecycle.updates").debug(events.UPDATE_CAST, tensors=1)
    assert records == []


async def test_configure_logging_json_once_per_event_even_when_called_twice(
        capsys: pytest.CaptureFixture[str]) -> None:
    """configure_logging(json=True) prints each event as one JSON object with "event" and
    its keys, and a second call does not duplicate the lines."""
    configure_logging(json=True, level="info")
    configure_logging(json=True, level="info")
    await _cycle(rank=1)
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
    committed = [e for e in lines if e["event"] == "transition.committed"]
    assert [e["trigger"] for e in committed] == ["attach", "sleep", "wake", "detach"]
    assert all(e["level"] == "info" and "timestamp" in e and e["rank"] == 1 and e["bytes"] >= 0
               for e in committed)
    assert all("transition_id" in e for e in committed[:3])
    assert not [e for e in lines if e["event"] == "move.prepared"]  # debug, filtered out
    assert sum(isinstance(h, events._StderrHandler) for h in logging.getLogger().handlers) == 1


def test_configure_logging_console_replaces_json(capsys: pytest.CaptureFixture[str]) -> None:
    """Switching from JSON to the console renderer leaves one handler printing readable
    lines to stderr, not stdout."""
    configure_logging(json=True, level="debug")
    configure_logging(json=False, level="debug")
    events.get_logger("lifecycle").debug(events.MOVE_PREPARED, component="vae", bytes=12)
    out, err = capsys.readouterr()
    assert out == ""
    (line,) = err.splitlines()
    assert "move.prepared" in line and "component" in line and "vae" in line
    assert not line.startswith("{")


def test_configured_exceptions_render_without_locals(capsys: pytest.CaptureFixture[str]) -> None:
    """Through configure_logging, an exception logged by the library's logger shows its
    frames but not its locals."""
    configure_logging(json=True, level="info")
    secret = "local-value-that-must-not-appear"  # noqa: F841
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        events.get_logger("lifecycle").exception(events.PREFETCH_FAILED, component="vae")
    (line,) = capsys.readouterr().err.splitlines()
    event = json.loads(line)
    assert event["event"] == "prefetch.failed" and event["component"] == "vae"
    assert "boom" in line and "local-value-that-must-not-appear" not in line


def test_importing_the_library_does_not_configure_logging() -> None:
    """A fresh interpreter importing lifecycle keeps the root logger's handlers and level
    and adds no handler or level to ``lifecycle``."""
    code = ("import logging; root = logging.getLogger(); before = (root.handlers[:], root.level);"
            "import lifecycle, strategies;"
            "assert (root.handlers, root.level) == before, (root.handlers, root.level);"
            "lc = logging.getLogger('lifecycle');"
            "assert (lc.handlers, lc.level, lc.propagate) == ([], logging.NOTSET, True);"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


def test_every_event_name_is_a_constant() -> None:
    """Each event constant is exported and listed in EVENTS."""
    names = {getattr(events, n) for n in events.__all__ if n.isupper() and n != "EVENTS"}
    assert names == events.EVENTS
    assert all(isinstance(n, str) and "." in n for n in names)


def test_event_sinks_see_every_event_whatever_the_level_and_can_be_removed() -> None:
    """A sink gets the event dict (name, fields, bound context) even when logging drops it;
    a failing sink breaks nothing; after removal it gets nothing. (The sink mechanism itself,
    under lifecycle.testing.capture_events and the metrics: hence the private add_event_sink.)"""
    seen: list[dict[str, object]] = []

    def broken(event: object) -> None:
        raise RuntimeError("a sink that fails")

    remove = events.add_event_sink(lambda e: seen.append(dict(e)))
    remove_broken = events.add_event_sink(broken)
    try:
        with _listening(level=logging.WARNING) as records:
            events.get_logger("lifecycle").debug(events.MOVE_PREPARED, component="vae")
        assert records == []
        assert seen == [{"event": events.MOVE_PREPARED, "component": "vae"}]
    finally:
        remove()
        remove_broken()
    events.get_logger("lifecycle").debug(events.MOVE_PREPARED, component="dit")
    assert len(seen) == 1


async def test_capture_events_collects_every_event_of_the_block_and_stops_after_it() -> None:
    """lifecycle.testing.capture_events yields the list of the event dicts emitted while the
    block runs (debug ones too, with the bound context), and stops collecting when the block
    ends, also when it ends with an error."""
    async with LifecycleController("cpu") as ctl:
        await ctl.attach(small_pipeline())
        with capture_events() as seen:
            await ctl.sleep()
        names = [e["event"] for e in seen]
        assert names.count(events.TRANSITION_COMMITTED) == 1 and events.MOVE_PREPARED in names
        assert all(e["transition"] == "sleep" and "transition_id" in e for e in seen)
        await ctl.wake()
        assert len(seen) == len(names)  # nothing after the block
        with pytest.raises(RuntimeError, match="inside"), capture_events() as failed:
            events.get_logger("lifecycle").debug(events.MOVE_PREPARED, component="vae")
            raise RuntimeError("inside")
        await ctl.aclose()
        assert failed == [{"event": events.MOVE_PREPARED, "component": "vae"}]


def test_importing_the_library_keeps_structlogs_defaults() -> None:
    """A fresh interpreter importing lifecycle keeps structlog's defaults."""
    code = ("import structlog; before = structlog.get_config()['processors'];"
            "import lifecycle, strategies;"
            "assert structlog.get_config()['processors'] == before; print('ok')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "ok", done.stderr


async def test_json_logging_emits_one_object_per_event(capsys: pytest.CaptureFixture[str]) -> None:
    """With json=True each event is one JSON line with level, timestamp and fields."""
    configure_logging(json=True, level="info")
    ctl = LifecycleController("cpu", rank=1)
    await ctl.attach(small_pipeline())
    await ctl.sleep()
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line]
    summaries = [e for e in lines if e["event"] == "transition.committed"]
    assert [e["trigger"] for e in summaries] == ["attach", "sleep"]
    assert all(e["level"] == "info" and "timestamp" in e and e["rank"] == 1 for e in summaries)
    assert not [e for e in lines if e["event"] == "move.prepared"]  # debug, filtered out


def test_exception_logs_never_render_local_variables(capsys: pytest.CaptureFixture[str]) -> None:
    """A logged exception shows frames but not locals (a local may hold a freed tensor)."""
    configure_logging(json=True, level="info")
    secret = "local-value-that-must-not-appear"  # noqa: F841
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        structlog.get_logger("t").exception("failed")
    out = capsys.readouterr().err
    assert "boom" in out and "local-value-that-must-not-appear" not in out


async def test_failed_transition_logs_a_rolled_back_event(caplog: pytest.LogCaptureFixture) -> None:
    """A rollback is visible as one structured event with the cause."""
    layer = faulty_device()
    ctl = LifecycleController(device_layer=layer)
    await ctl.attach(small_pipeline())
    layer.arm(copy_at=2)
    caplog.clear()  # only what the sleep logs
    with caplog.at_level(logging.DEBUG, logger="lifecycle"), pytest.raises(TransitionFailed):
        await ctl.sleep()
    logs = [r.msg for r in caplog.records if isinstance(r.msg, dict)]
    events = [e for e in logs if e["event"] == "transition.rolled_back"]
    assert len(events) == 1
    assert events[0]["trigger"] == "sleep"
    assert events[0]["transition"] == "sleep"
    assert events[0]["error"].startswith("InjectedFault: injected copy failure")


async def test_committed_transition_logs_one_summary_event(caplog: pytest.LogCaptureFixture) -> None:
    """Each committed transition emits one summary with trigger, phases, bytes, seconds, rank."""
    ctl = LifecycleController("cpu", rank=3)
    await ctl.attach(small_pipeline())
    caplog.clear()  # only what the sleep logs
    with caplog.at_level(logging.DEBUG, logger="lifecycle"):
        await ctl.sleep()
    logs = [r.msg for r in caplog.records if isinstance(r.msg, dict)]
    summaries = [e for e in logs if e["event"] == "transition.committed"]
    assert len(summaries) == 1
    s = summaries[0]
    assert (s["trigger"], s["source"], s["dest"], s["outcome"], s["rank"]) == (
        "sleep", "awake", "sleeping", "committed", 3)
    assert s["bytes"] > 0 and s["released"] > 0 and s["seconds"] >= 0 and "gbps" in s
    moves = [e for e in logs if e["event"] == "move.prepared"]
    assert {e["component"] for e in moves} == {"text_encoder", "transformer", "vae"}
    assert all(e["transition_id"] == s["transition_id"] for e in moves)
