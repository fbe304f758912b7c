"""Helpers for testing code that uses this library: the fault-injecting device layers of
:mod:`strategies.testing` and the ordering layer that makes the CUDA path's ordering
mistakes visible on CPU, re-exported (see there)."""

from strategies.testing import (
    POISON,
    FaultInjection,
    FaultyDevice,
    InjectedFault,
    OrderingDevice,
    OrderingFaultyDevice,
    OrderingViolation,
    check_ordering,
    faulty_device_layer,
)

__all__ = ["POISON", "FaultInjection", "FaultyDevice", "InjectedFault", "OrderingDevice",
           "OrderingFaultyDevice", "OrderingViolation", "check_ordering", "faulty_device_layer"]
