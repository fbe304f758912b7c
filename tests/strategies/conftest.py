"""Device layers for the tests that drive a store without a controller, closed after each
test (their copy and refresh threads stop). Both follow ``--device-layer``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from lifecycle.testing import FaultInjection, faulty_device_layer
from strategies import DeviceLayer, make_device_layer


@pytest.fixture
def layer() -> Iterator[DeviceLayer]:
    """The layer the library makes for a CPU device (the checking passes' own)."""
    made = make_device_layer("cpu")
    yield made
    made.close()


@pytest.fixture
def faulty() -> Iterator[Callable[..., FaultInjection]]:
    """Makes fault-injecting layers: ``faulty(fail_copy_at=k)``, ``faulty(copy_delay=s)``."""
    made: list[FaultInjection] = []

    def make(**faults: Any) -> FaultInjection:
        made.append(faulty_device_layer("cpu", **faults))  # the checking passes' own
        return made[-1]

    yield make
    for each in made:
        each.close()
