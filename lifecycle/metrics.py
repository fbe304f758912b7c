"""Prometheus metrics for one :class:`~lifecycle.LifecycleController`.

Exports :class:`ControllerMetrics` (needs ``prometheus-client``, the ``serve`` extra). It
counts transitions from the library's events (:func:`lifecycle._events.add_event_sink`), not
by wrapping the controller, and reads the controller's state at scrape time through a
collector, so gauges are always current. Everything lives in its own
:class:`~prometheus_client.CollectorRegistry` (a fresh one unless one is passed; never the
global default registry unless passed explicitly).

Metrics (``residency_`` prefix):

* ``residency_phase{phase}``: 1 for the current phase, 0 for the three others;
* ``residency_transitions_total{trigger,outcome}``: outcome ``committed``, ``noop``,
  ``refused``, ``rolled_back`` or ``cancelled``, by the call's trigger (``update_from_disk``...);
* ``residency_transition_seconds{trigger}``: histogram of committed transitions' durations;
* ``residency_bytes_moved_total{direction}``: ``to_host`` / ``to_device`` (each component
  moved by a sleep or wake, counted when its copy is prepared, so a copy later rolled back
  still counts: it crossed the bus; attach and detach emit no per-component move events
  and are not counted here) and ``written`` (committed weight updates);
* ``residency_device_bytes{component}``, ``residency_host_bytes{component}``: from
  :meth:`~lifecycle.LifecycleController.report` at scrape time (components appear and
  disappear with attach and detach);
* ``residency_host_memory_bytes{kind}``: every host byte the device layer holds, by kind
  (``pinned``, ``pageable``) and the bytes kept only in checkpoint files (``file_backed``);
  ``residency_host_budget_bytes{budget}`` and ``residency_host_left_bytes{budget}``
  (``host``, ``pin``): the budgets and what is left under them (absent without a budget);
* ``residency_stale_tensors{component}``: tensors a discarding sleep dropped that no update has
  written since (the component serves nothing while it is above 0), at scrape time;
* ``residency_in_flight``, ``residency_weights_version``: read at scrape time;
* ``residency_weight_version_info{version}``: 1, labelled with the ``weight_version`` the
  trainer gave the weights served (:attr:`~lifecycle.LifecycleController.
  weight_version_label`); absent until an update gives one;
* ``residency_requests_total{path,status}``: counted by the HTTP layer through
  :meth:`ControllerMetrics.count_request`.

Events are global to the process and name the emitting controller (``controller``, its
``id``, and ``rank``): a ``ControllerMetrics`` counts only its own controller's events.

Embedding without HTTP::

    metrics = ControllerMetrics(ctl)
    prometheus_client.start_http_server(9000, registry=metrics.registry)
    # or serve the text yourself:
    body, content_type = metrics.render(), metrics.content_type
    ...
    metrics.close()  # stop counting (also: ``with ControllerMetrics(ctl) as metrics:``)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Self

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from . import _events as events
from ._blocking import SyncLifecycleController
from ._controller import LifecycleController
from ._phase import Phase

__all__ = ["ControllerMetrics"]

#: Histogram buckets of ``residency_transition_seconds``: 1 ms to 60 s.
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

_TRIGGERS = ("attach", "detach", "sleep", "wake", "update_from_disk", "update_from_tensors",
             "update_from_distributed")
_UPDATES = frozenset({"update_from_disk", "update_from_tensors", "update_from_distributed"})
# Series created at zero, so that rates work from the first scrape: the outcomes each
# trigger can have.
_KNOWN_OUTCOMES: dict[str, tuple[str, ...]] = {
    "attach": ("committed", "refused", "rolled_back", "cancelled"),
    "detach": ("committed", "noop", "rolled_back", "cancelled"),
    "sleep": ("committed", "noop", "refused", "rolled_back", "cancelled"),
    "wake": ("committed", "noop", "refused", "rolled_back", "cancelled"),
    "update_from_disk": ("committed", "refused", "rolled_back", "cancelled"),
    "update_from_tensors": ("committed", "refused", "rolled_back", "cancelled"),
    "update_from_distributed": ("committed", "refused", "rolled_back", "cancelled"),
}
_DIRECTIONS = ("to_host", "to_device", "written")
_COUNTED = frozenset({events.TRANSITION_COMMITTED, events.TRANSITION_REJECTED,
                      events.TRANSITION_ROLLED_BACK, events.MOVE_PREPARED})
_DEFAULT_OUTCOME = {events.TRANSITION_REJECTED: "refused",
                    events.TRANSITION_ROLLED_BACK: "rolled_back"}


class _StateCollector(Collector):
    """The controller's state, read at every scrape."""

    def __init__(self, ctl: LifecycleController) -> None:
        self._ctl = ctl

    def describe(self) -> Iterable[Metric]:
        # Names only, so that the registry refuses duplicates at registration.
        return self._families()

    def collect(self) -> Iterable[Metric]:
        ctl = self._ctl
        families = self._families()
        phase_gauge, device, host, stale, in_flight, version, label, kinds, budgets, left = \
            families
        current = ctl.phase
        for phase in Phase:
            phase_gauge.add_metric([phase.value], 1.0 if phase is current else 0.0)
        for name, placement in self._components().items():
            device.add_metric([name], float(placement[0]))
            host.add_metric([name], float(placement[1]))
            stale.add_metric([name], float(placement[2]))
        in_flight.add_metric([], float(ctl.in_flight))
        version.add_metric([], float(ctl.weights_version))
        if ctl.weight_version_label is not None:
            label.add_metric([ctl.weight_version_label], 1.0)
        report = ctl.report()
        for kind, n in (("pinned", report.host_held_pinned),
                        ("pageable", report.host_held_pageable),
                        ("file_backed", report.file_backed_bytes)):
            kinds.add_metric([kind], float(n))
        for which, budget, rest in (("host", report.host_budget, report.host_left),
                                    ("pin", report.pin_budget, report.pin_left)):
            if budget is not None and rest is not None:
                budgets.add_metric([which], float(budget))
                left.add_metric([which], float(rest))
        return families

    def _components(self) -> dict[str, tuple[int, int, int]]:
        # A scrape may run in another thread (start_http_server) while a transition moves
        # units: a report that raced a change is taken again.
        for _ in range(2):
            with contextlib.suppress(RuntimeError):
                return self._report()
        return self._report()

    def _report(self) -> dict[str, tuple[int, int, int]]:
        return {name: (c.device_bytes, c.host_bytes, c.stale_tensors)
                for name, c in self._ctl.report().components.items()}

    @staticmethod
    def _families() -> list[GaugeMetricFamily]:
        return [
            GaugeMetricFamily("residency_phase", "1 for the controller's current phase, 0 for the others.",
                              labels=["phase"]),
            GaugeMetricFamily("residency_device_bytes", "Bytes of the component on the device tier.",
                              labels=["component"]),
            GaugeMetricFamily("residency_host_bytes", "Bytes of the component held on the host.",
                              labels=["component"]),
            GaugeMetricFamily("residency_stale_tensors", "Tensors of the component discarded by "
                              "a sleep and not updated since (it serves nothing above 0).",
                              labels=["component"]),
            GaugeMetricFamily("residency_in_flight", "Live leases: uses in progress and prefetches."),
            GaugeMetricFamily("residency_weights_version", "Successful weight updates so far."),
            GaugeMetricFamily("residency_weight_version_info",
                              "1, labelled with the trainer's weight_version of the weights "
                              "served.", labels=["version"]),
            GaugeMetricFamily("residency_host_memory_bytes", "Host bytes held by kind "
                              "(pinned, pageable) and kept only in checkpoint files "
                              "(file_backed).", labels=["kind"]),
            GaugeMetricFamily("residency_host_budget_bytes", "The host and pin budgets.",
                              labels=["budget"]),
            GaugeMetricFamily("residency_host_left_bytes", "Bytes left under the host and pin "
                              "budgets.", labels=["budget"]),
        ]


def _sink(ref: weakref.ref[ControllerMetrics]) -> events.EventSink:
    """A sink that holds its ``ControllerMetrics`` weakly: the process-wide sink list never
    keeps it (nor its controller) alive."""

    def sink(event: Mapping[str, Any]) -> None:
        metrics = ref()
        if metrics is not None:
            metrics._on_event(event)

    return sink


class ControllerMetrics:
    """Prometheus metrics of one controller (see the module docstring for the metrics).

    ``ctl``: a :class:`~lifecycle.LifecycleController` (or a
    :class:`~lifecycle.SyncLifecycleController`: its controller is watched). ``registry``:
    where the metrics are registered; a fresh :class:`~prometheus_client.CollectorRegistry`
    when ``None``. Registering twice in one registry raises ``ValueError`` (duplicate
    names) and leaves that registry as it was.

    Counting starts at construction and stops at :meth:`close` (or at the end of a
    ``with`` block, or when this object is garbage-collected); the metrics stay registered,
    so a scrape after ``close()`` still answers, with frozen counters.
    """

    #: The ``Content-Type`` of :meth:`render`'s output.
    content_type: str = CONTENT_TYPE_LATEST

    def __init__(self, ctl: LifecycleController | SyncLifecycleController,
                 registry: CollectorRegistry | None = None) -> None:
        self._ctl = ctl.controller if isinstance(ctl, SyncLifecycleController) else ctl
        self.registry = CollectorRegistry() if registry is None else registry
        self._transitions = Counter(
            "residency_transitions", "Transitions by trigger and outcome "
            "(committed, noop, refused, rolled_back, cancelled).",
            ["trigger", "outcome"], registry=None)
        self._seconds = Histogram(
            "residency_transition_seconds", "Duration of committed transitions.",
            ["trigger"], buckets=SECONDS_BUCKETS, registry=None)
        self._bytes = Counter(
            "residency_bytes_moved", "Bytes copied: to_host and to_device by sleep and wake, "
            "written by weight updates.", ["direction"], registry=None)
        self._requests = Counter(
            "residency_requests", "HTTP requests by route and status code.",
            ["path", "status"], registry=None)
        for trigger, outcomes in _KNOWN_OUTCOMES.items():
            for outcome in outcomes:
                self._transitions.labels(trigger, outcome)
        for trigger in _TRIGGERS:
            self._seconds.labels(trigger)
        for direction in _DIRECTIONS:
            self._bytes.labels(direction)
        collectors: list[Collector] = [self._transitions, self._seconds, self._bytes,
                                       self._requests, _StateCollector(self._ctl)]
        registered: list[Collector] = []
        try:
            for collector in collectors:
                self.registry.register(collector)
                registered.append(collector)
        except BaseException:
            for collector in registered:
                self.registry.unregister(collector)
            raise
        self._remove: Callable[[], None] | None = events.add_event_sink(_sink(weakref.ref(self)))
        # Without close(), the sink is removed when this object is collected.
        self._finalizer = weakref.finalize(self, self._remove)

    # -- counting ----------------------------------------------------------------------
    def _on_event(self, event: Mapping[str, Any]) -> None:
        name = event.get("event")
        if name not in _COUNTED or event.get("controller") != self._ctl.id:
            return
        if name == events.MOVE_PREPARED:
            self._count_bytes(f"to_{event.get('to')}", event.get("bytes"))
            return
        trigger = str(event.get("trigger", "unknown"))
        if name == events.TRANSITION_COMMITTED:
            self._transitions.labels(trigger, "committed").inc()
            seconds = event.get("seconds")
            if isinstance(seconds, int | float) and seconds >= 0:
                self._seconds.labels(trigger).observe(seconds)
            if trigger in _UPDATES:
                self._count_bytes("written", event.get("bytes"))
        else:
            outcome = str(event.get("outcome", _DEFAULT_OUTCOME[str(name)]))
            self._transitions.labels(trigger, outcome).inc()

    def _count_bytes(self, direction: str, nbytes: object) -> None:
        if isinstance(nbytes, int) and nbytes > 0:
            self._bytes.labels(direction).inc(nbytes)

    def count_request(self, path: str, status: int) -> None:
        """Count one HTTP request: ``path`` should be the route (not the raw URL, whose
        query strings and ids would make a series per request), ``status`` its status
        code."""
        self._requests.labels(path, str(status)).inc()

    # -- exposition --------------------------------------------------------------------
    def render(self) -> bytes:
        """Every metric of :attr:`registry` in the Prometheus text format."""
        return generate_latest(self.registry)

    # -- lifetime ----------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (events are no longer counted)."""
        return self._remove is None

    def close(self) -> None:
        """Stop counting events (removes the event sink). Idempotent."""
        remove, self._remove = self._remove, None
        if remove is not None:
            self._finalizer.detach()
            remove()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "counting"
        return f"<ControllerMetrics rank={self._ctl.rank} {state}>"
