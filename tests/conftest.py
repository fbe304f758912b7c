"""Every async test runs on asyncio (debug mode: flags torch work blocking the loop) and trio.

``--device-layer=ordering`` runs the tests on the ordering layer (``strategies.testing.
OrderingDevice``): every controller and store that makes its own CPU layer gets one, and
``FaultyDevice`` (with the test layers derived from it) becomes ``OrderingFaultyDevice``.
Copies then land late, only when waited for, poison (NaN) until then, and any ordering
mistake of the CUDA path is reported. Whatever the option, a test fails at teardown if an
ordering layer recorded a violation during it (even one the code under test swallowed) or
holds a copy nobody waited for.
"""

from __future__ import annotations

import itertools
import os
import zlib
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
import torch

import lifecycle._controller
import lifecycle.testing
import strategies._factory
import strategies.testing
from strategies import DeviceLayer, resolve_device
from strategies._device import DEVICE_LAYER_ENV
from strategies.testing import OrderingDevice, OrderingFaultyDevice, check_ordering

ORDERING_MAX_DELAY = 0.002  # seconds: each copy lands up to this late (keeps the pass fast)
_seeds = itertools.count()
_seed_base = 0


def _next_seed() -> int:
    return _seed_base + next(_seeds)


class _OrderingCpuDevice(OrderingDevice):
    """The ordering layer where a test lets the library make its own CPU layer."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__(device, seed=_next_seed(), max_delay=ORDERING_MAX_DELAY)


class _OrderingFaultyDevice(OrderingFaultyDevice):
    """``FaultyDevice`` under ``--device-layer=ordering``: delays seeded per test."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("ordering_seed", _next_seed())
        kwargs.setdefault("max_delay", ORDERING_MAX_DELAY)
        super().__init__(*args, **kwargs)


def _ordering_device_layer(device: str | torch.device | None) -> DeviceLayer:
    dev = resolve_device(device)
    if dev.type == "cpu":
        return _OrderingCpuDevice(dev)
    return _original["lifecycle._controller.make_device_layer"](dev)  # type: ignore[no-any-return]


_original: dict[str, Any] = {}
_env_before = os.environ.get(DEVICE_LAYER_ENV)  # restored at the end of the session
# (module, attribute, replacement): where the layers the tests do not inject are looked up.
_PATCHES = [
    (lifecycle._controller, "make_device_layer", _ordering_device_layer),
    (strategies._factory, "CpuDevice", _OrderingCpuDevice),
    (strategies.testing, "FaultyDevice", _OrderingFaultyDevice),
    (lifecycle.testing, "FaultyDevice", _OrderingFaultyDevice),
]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--device-layer", choices=("cpu", "ordering"), default="cpu",
                     help="the CPU device layer tests run on: 'ordering' lands copies late "
                          "and reports ordering mistakes of the CUDA path (see tests/conftest.py)")
    parser.addoption("--ordering-seed", type=int, default=0,
                     help="seed of the ordering layer's copy delays (mixed with each test's id)")


def pytest_configure(config: pytest.Config) -> None:
    # Before collection: test modules import FaultyDevice by name.
    if config.getoption("--device-layer") == "ordering":
        for module, name, replacement in _PATCHES:
            _original.setdefault(f"{module.__name__}.{name}", getattr(module, name))
            setattr(module, name, replacement)
        # Programs the tests start (`residency serve`, drills, rank workers) inherit it.
        os.environ[DEVICE_LAYER_ENV] = "ordering"


def pytest_unconfigure(config: pytest.Config) -> None:
    for module, name, _ in _PATCHES:
        key = f"{module.__name__}.{name}"
        if key in _original:
            setattr(module, name, _original.pop(key))
    if _env_before is None:
        os.environ.pop(DEVICE_LAYER_ENV, None)
    else:
        os.environ[DEVICE_LAYER_ENV] = _env_before


def pytest_report_header(config: pytest.Config) -> str | None:
    if config.getoption("--device-layer") == "ordering":
        return (f"device layer: ordering (seed {config.getoption('--ordering-seed')}, "
                f"copies land up to {ORDERING_MAX_DELAY * 1e3:g} ms late, when waited for)")
    return None


@pytest.fixture(autouse=True)
def _ordering_checks(request: pytest.FixtureRequest) -> Iterator[None]:
    """Seeds the ordering layers made in this test; at teardown, fails the test for every
    ordering violation they recorded (raised and swallowed, or only recorded by a finalizer)
    and every copy still in flight that nobody waited for."""
    global _seed_base, _seeds
    _seed_base = zlib.crc32(request.node.nodeid.encode()) ^ request.config.getoption(
        "--ordering-seed")
    _seeds = itertools.count()
    yield
    problems = check_ordering()
    if problems:
        pytest.fail("ordering violations:\n- " + "\n- ".join(problems), pytrace=False)


@pytest.fixture(params=[pytest.param(("asyncio", {"debug": True}), id="asyncio"),
                        pytest.param(("trio", {}), id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()
