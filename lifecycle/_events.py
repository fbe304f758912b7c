"""Structured events: their names, the library's logger, and ``configure_logging``.

Events are dotted names with keyword fields, emitted through the standard :mod:`logging`
logger ``lifecycle`` (and its children, e.g. ``lifecycle.updates``), so the *host
application's* logging configuration decides what is shown and where:

* ``transition.committed`` (info): one summary per committed attach, sleep, wake, detach
  or weight update, with trigger, source, dest, bytes, released, seconds, gbps, rank;
* ``transition.rejected`` (info): a transition refused before anything moved (reason);
* ``transition.rolled_back`` (warning): a transition that failed and was undone (error);
* ``move.prepared`` (debug): one per component moved by a transition (bytes, units, to);
* ``store.rescan`` (warning): a component whose tensors were replaced behind our back;
* ``use.release_failed`` / ``prefetch.failed`` (warning): a lease or prefetch that failed;
* ``update.cast`` / ``update.skipped_components`` (info), ``update.mirror_stale``
  (warning): weight-update details;
* ``weight_sync.joined`` / ``weight_sync.destroyed`` (info), ``weight_sync.broken``
  (warning), ``weight_sync.drained`` (info: a refused update's broadcast received and
  dropped): weight update groups (``group``, ``rank``).

Events inside a transition also carry ``transition`` and ``transition_id`` (structlog
context variables bound by the controller). Tensors are never logged, only their shape,
dtype, device and bytes.

The library never configures logging on import and does not depend on structlog's global
configuration: with no logging configured, info and debug events go nowhere and warnings
reach stderr through :data:`logging.lastResort`, as for any library. A plain stdlib
handler sees one record per event whose message reads ``event key=value ...`` and whose
``record.msg`` is the event dict. :func:`configure_logging` is for applications (the
commands): it installs one console or JSON-lines handler on the root logger.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Mapping, MutableMapping
from types import FrameType
from typing import Any

import structlog
from structlog.stdlib import ProcessorFormatter

from ._units import gbps

TRANSITION_COMMITTED = "transition.committed"
TRANSITION_REJECTED = "transition.rejected"
TRANSITION_ROLLED_BACK = "transition.rolled_back"
MOVE_PREPARED = "move.prepared"
STORE_RESCAN = "store.rescan"
USE_RELEASE_FAILED = "use.release_failed"
PREFETCH_FAILED = "prefetch.failed"
UPDATE_CAST = "update.cast"
UPDATE_SKIPPED_COMPONENTS = "update.skipped_components"
UPDATE_MIRROR_STALE = "update.mirror_stale"
PLAN_APPLIED = "plan.applied"
PLAN_ROLLED_BACK = "plan.rolled_back"
DETACH_STALE = "detach.stale"  # detached with discarded tensors not updated: undefined values
WEIGHT_SYNC_JOINED = "weight_sync.joined"
WEIGHT_SYNC_DESTROYED = "weight_sync.destroyed"
WEIGHT_SYNC_BROKEN = "weight_sync.broken"
WEIGHT_SYNC_DRAINED = "weight_sync.drained"

#: Every event name the library emits.
EVENTS = frozenset({
    TRANSITION_COMMITTED, TRANSITION_REJECTED, TRANSITION_ROLLED_BACK, MOVE_PREPARED,
    STORE_RESCAN, USE_RELEASE_FAILED, PREFETCH_FAILED, UPDATE_CAST,
    UPDATE_SKIPPED_COMPONENTS, UPDATE_MIRROR_STALE, PLAN_APPLIED, PLAN_ROLLED_BACK,
    WEIGHT_SYNC_JOINED, WEIGHT_SYNC_DESTROYED, WEIGHT_SYNC_BROKEN, WEIGHT_SYNC_DRAINED,
    DETACH_STALE,
})

__all__ = [
    "DETACH_STALE",
    "EVENTS",
    "MOVE_PREPARED",
    "PLAN_APPLIED",
    "PLAN_ROLLED_BACK",
    "PREFETCH_FAILED",
    "STORE_RESCAN",
    "TRANSITION_COMMITTED",
    "TRANSITION_REJECTED",
    "TRANSITION_ROLLED_BACK",
    "UPDATE_CAST",
    "UPDATE_MIRROR_STALE",
    "UPDATE_SKIPPED_COMPONENTS",
    "USE_RELEASE_FAILED",
    "WEIGHT_SYNC_BROKEN",
    "WEIGHT_SYNC_DESTROYED",
    "WEIGHT_SYNC_DRAINED",
    "WEIGHT_SYNC_JOINED",
    "EventSink",
    "add_event_sink",
    "committed",
    "configure_logging",
    "get_logger",
    "rolled_back",
    "wanted",
]

_HIDDEN = frozenset({"event", "level", "exc_info", "stack_info"})


def _value(v: object) -> str:
    s = v if isinstance(v, str) else repr(v)
    return s if s and not any(c.isspace() or c in "\"'=" for c in s) else repr(s)


class _Event(dict[str, Any]):
    """The event dict carried on ``record.msg``: a ``ProcessorFormatter`` renders it as a
    dict, a plain formatter gets ``str()``: ``event key=value ...``."""

    def __str__(self) -> str:
        head = str(self.get("event"))
        rest = " ".join(f"{k}={_value(v)}" for k, v in self.items() if k not in _HIDDEN)
        return f"{head} {rest}" if rest else head


def _to_stdlib(logger: Any, method_name: str,
               event_dict: MutableMapping[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Final processor: like ``ProcessorFormatter.wrap_for_formatter``, with a readable
    ``str()`` and the exception handed to stdlib for plain handlers."""
    args, extra = ProcessorFormatter.wrap_for_formatter(logger, method_name, dict(event_dict))
    kwargs: dict[str, Any] = dict(extra)
    exc_info = event_dict.get("exc_info")
    if exc_info:
        kwargs["exc_info"] = exc_info
    kwargs["stacklevel"] = _stacklevel(sys._getframe(1))
    return (_Event(args[0]),), kwargs


def _stacklevel(processing: FrameType | None) -> int:
    """The ``stacklevel`` that makes the record's file and line the caller's, not
    structlog's nor this module's (:func:`committed`): *processing* runs the processors, its
    caller calls the stdlib logger."""
    f, level = processing.f_back if processing else None, 1
    while f is not None and (f.f_globals.get("__name__", "").startswith("structlog")
                             or f.f_globals.get("__name__") == __name__):
        f, level = f.f_back, level + 1
    return level if f is not None else 1


EventSink = Callable[[Mapping[str, Any]], None]
_SINKS: list[EventSink] = []


def add_event_sink(sink: EventSink) -> Callable[[], None]:
    """Call ``sink(event)`` for every event of the library, whatever the logging level (the
    event dict: ``event`` (its name), its fields and the bound context such as
    ``transition_id``). Metrics are built on this (:mod:`lifecycle.metrics`). A sink must be
    quick and must not raise (an error in it is swallowed: a transition never fails for a
    sink). Returns a function that removes the sink."""
    _SINKS.append(sink)

    def remove() -> None:
        with contextlib.suppress(ValueError):
            _SINKS.remove(sink)

    return remove


def _to_sinks(logger: Any, method_name: str,
              event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    if _SINKS:
        event = {**structlog.contextvars.get_contextvars(), **event_dict}
        for sink in list(_SINKS):
            with contextlib.suppress(Exception):
                sink(event)
    return event_dict


# Sinks see every event; then filter_by_level: a disabled level costs one comparison,
# nothing is merged or rendered.
_PROCESSORS: list[structlog.typing.Processor] = [
    _to_sinks,
    structlog.stdlib.filter_by_level,
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    _to_stdlib,
]


def wanted(logger: structlog.stdlib.BoundLogger, level: int) -> bool:
    """Whether an event at ``level`` (``logging.DEBUG``, ...) from ``logger`` reaches anyone:
    a sink, or the stdlib logger at that level. Hot paths (a clean sleep) skip building the
    event's fields when it does not: a disabled event then costs one level comparison."""
    return bool(_SINKS) or bool(logger._logger.isEnabledFor(level))


def committed(logger: structlog.stdlib.BoundLogger, trigger: str, source: str, dest: str,
              copied: int, seconds: float, released: int = 0, **fields: Any) -> None:
    """The one ``transition.committed`` summary of a transition (its fields are not even
    built when nobody wants it); ``fields``: more of its fields."""
    if not wanted(logger, logging.INFO):
        return
    logger.info(TRANSITION_COMMITTED, trigger=trigger, source=source, dest=dest,
                outcome="committed", seconds=round(seconds, 6), bytes=copied, released=released,
                gbps=round(gbps(copied, seconds), 3), **fields)


def rolled_back(logger: structlog.stdlib.BoundLogger, trigger: str, phase: str,
                error: BaseException, failed_ranks: Mapping[int, str], **fields: Any) -> None:
    """The ``transition.rolled_back`` warning of a transition undone for ``error`` (a
    cancellation reads ``cancelled``); ``fields``: more of its fields."""
    logger.warning(TRANSITION_ROLLED_BACK, trigger=trigger, phase=phase,
                   outcome="rolled_back" if isinstance(error, Exception) else "cancelled",
                   error=f"{type(error).__name__}: {error}", failed_ranks=failed_ranks,
                   **fields)


class bound:
    """Bind context variables for the events inside a ``with`` block; their earlier values
    (or none) come back afterwards, as with :func:`structlog.contextvars.bound_contextvars`.

    That one reads the whole context first (a copy of every context variable, to save the
    keys it rebinds); this one resets the tokens its binding returned, which puts back the
    same values without looking at any other variable: every transition enters one."""

    __slots__ = ("_fields", "_tokens")

    def __init__(self, **fields: Any) -> None:
        self._fields = fields
        self._tokens: Mapping[str, Any] = {}

    def __enter__(self) -> None:
        self._tokens = structlog.contextvars.bind_contextvars(**self._fields)

    def __exit__(self, *exc_info: object) -> None:
        structlog.contextvars.reset_contextvars(**self._tokens)


Naming = Callable[[], Mapping[str, Any]]


def _appending(naming: Naming) -> structlog.typing.Processor:
    """First processor of a named logger: the fields ``naming()`` gives now, after the
    call's own keys and before ``event`` (which structlog adds last), as if the call had
    passed them itself (a bound context would put them first)."""

    def append(logger: Any, method_name: str,
               event_dict: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        event = event_dict.pop("event", None)
        event_dict.update(naming())
        if event is not None:
            event_dict["event"] = event
        return event_dict

    return append


def get_logger(name: str = "lifecycle", *, naming: Naming | None = None
               ) -> structlog.stdlib.BoundLogger:
    """A structlog logger writing to the stdlib logger *name*, independent of structlog's
    global configuration (which belongs to the application). ``naming``: who emits its
    events (e.g. ``{"rank": 0, "controller": 1}``, read at each event), appended to every
    event after the call's own keys."""
    processors = _PROCESSORS if naming is None else [_appending(naming), *_PROCESSORS]
    return structlog.stdlib.BoundLogger(logging.getLogger(name), processors, {})


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """The handler ``configure_logging`` installs: writes to the *current* ``sys.stderr``."""

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # StreamHandler.__init__ would pin a stream

    @property
    def stream(self) -> Any:
        return sys.stderr


def configure_logging(json: bool | None = None, level: str = "info") -> None:
    """Configure logging for an application or script (the commands call it once).

    Installs one handler on the root logger that renders every record (the library's
    events, the application's structlog loggers, other libraries' stdlib records) as JSON
    lines or with a console renderer to stderr, and sets the root level to *level*. It
    also points structlog's global configuration at stdlib, so ``structlog.get_logger()``
    in the application goes the same way. Calling it again replaces the handler.

    ``json=None`` picks JSON lines when stderr is not a terminal, a console renderer
    otherwise. Tracebacks are rendered without local variables: a local holding a freed
    tensor can crash the interpreter when repr'd.
    """
    if json is None:
        json = not sys.stderr.isatty()
    lvl = logging.getLevelNamesMapping()[level.upper()]
    logging.getLogger("transitions").setLevel(logging.WARNING)
    renderer: list[structlog.typing.Processor]
    if json:
        renderer = [
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)),
            structlog.processors.JSONRenderer(),
        ]
    else:
        renderer = [structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)]
    handler = _StderrHandler()
    handler.setFormatter(ProcessorFormatter(
        foreign_pre_chain=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.stdlib.add_logger_name,
        ],
        processors=[
            ProcessorFormatter.remove_processors_meta,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *renderer,
        ],
    ))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _StderrHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(lvl)
    structlog.configure(
        processors=_PROCESSORS,
        wrapper_class=structlog.stdlib.BoundLogger,
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=False,
    )
