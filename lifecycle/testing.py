"""Helpers for testing code that uses this library: the fault-injecting device layers of
:mod:`strategies.testing`, re-exported (see there)."""

from strategies.testing import FaultInjection, FaultyDevice, InjectedFault, faulty_device_layer

__all__ = ["FaultInjection", "FaultyDevice", "InjectedFault", "faulty_device_layer"]
