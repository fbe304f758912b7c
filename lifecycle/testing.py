"""Helpers for testing code that uses this library (and this library's own tests): the one
public testing entry.

* Fault injection: :class:`FaultInjection` makes a device layer fail the k-th copy or
  allocation, or slow every copy down, so that rollback and cancellation paths run for real;
  :class:`FaultyDevice` is the layer for a CPU device with it, :func:`faulty_device_layer`
  the right one for any device, :class:`FaultyCudaDevice` the CUDA layer with it. It counts
  every copy and allocation so a test can enumerate every failure point::

      probe = FaultyDevice()
      ... run the operation once with probe, note probe.copies ...
      for k in range(1, probe.copies + 1):
          layer = FaultyDevice(fail_copy_at=k)
          ...

* The checking layers: :class:`OrderingDevice` (and :class:`OrderingFaultyDevice`) runs the
  CUDA path's ordering on CPU: copies land late and only when waited for, :data:`POISON`
  (NaN) until then, and every ordering mistake is reported (:class:`OrderingViolation`,
  :func:`check_ordering`); :class:`SimCuda` is a simulated GPU for the CUDA layer's own code
  (:func:`sim_cuda_layer`, :class:`CudaSimViolation`, :func:`check_cuda_sim`).
  :data:`DEVICE_LAYER_ENV` (``RESIDENCY_DEVICE_LAYER``: one of :data:`LAYER_KINDS`) puts a
  whole program's CPU layers on one of them, :func:`seed_layers` seeds their delays
  (:func:`layer_seed`: the next seed).

  :class:`FaultyDevice` is always the CPU layer with fault injection; the fault-injecting
  layer that variable selects is made by :func:`faulty_device_layer` (``"cpu"``: the CPU
  layer, the ordering one or the CUDA one over a simulated GPU, made with the same
  arguments), and :func:`faulty_cpu_layer_class` returns its class (for a test's own layer
  derived from it). Both read the variable when called.

* Events: :func:`capture_events` collects the library's events while a block runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from strategies.checking import (
    DEVICE_LAYER_ENV,
    LAYER_KINDS,
    POISON,
    CudaSimViolation,
    FaultInjection,
    FaultyCudaDevice,
    FaultyDevice,
    InjectedFault,
    OrderingDevice,
    OrderingFaultyDevice,
    OrderingViolation,
    SimCuda,
    check_cuda_sim,
    check_ordering,
    faulty_cpu_layer_class,
    faulty_device_layer,
    layer_seed,
    seed_layers,
    sim_cuda_layer,
)

from ._events import add_event_sink

__all__ = ["DEVICE_LAYER_ENV", "LAYER_KINDS", "POISON", "CudaSimViolation", "FaultInjection",
           "FaultyCudaDevice", "FaultyDevice", "InjectedFault", "OrderingDevice",
           "OrderingFaultyDevice", "OrderingViolation", "SimCuda", "capture_events",
           "check_cuda_sim", "check_ordering", "faulty_cpu_layer_class", "faulty_device_layer",
           "layer_seed", "seed_layers", "sim_cuda_layer"]


@contextmanager
def capture_events() -> Iterator[list[dict[str, Any]]]:
    """Collect every event the library emits while the block runs, whatever the logging
    configuration (as structlog's ``capture_logs``)::

        with capture_events() as events:
            await ctl.sleep()
        assert [e["event"] for e in events if e["event"] == "transition.committed"] == [...]

    Each event is a dict: ``event`` (its name), its fields and the bound context (such as
    ``transition`` and ``transition_id``). The collection stops when the block ends, however
    it ends."""
    events: list[dict[str, Any]] = []
    remove = add_event_sink(lambda event: events.append(dict(event)))
    try:
        yield events
    finally:
        remove()
