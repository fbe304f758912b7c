"""Every async test runs on asyncio (debug mode: flags torch work blocking the loop) and trio."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import structlog


@pytest.fixture(params=[pytest.param(("asyncio", {"debug": True}), id="asyncio"),
                        pytest.param(("trio", {}), id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    structlog.reset_defaults()
    yield
    structlog.reset_defaults()
