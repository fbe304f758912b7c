"""Structured events: names, the logger, and ``configure_logging`` for applications.

The library never configures logging on import. Events are dotted names:
``transition.committed``, ``transition.rejected``, ``transition.failed`` (rolled back),
``move.done`` (per component), ``update.cast`` and so on. Tensors are never logged, only
their shape, dtype, device and bytes.
"""

from __future__ import annotations

import logging
import sys

import structlog

__all__ = ["configure_logging", "get_logger"]


def get_logger(name: str = "lifecycle") -> structlog.stdlib.BoundLogger:
    return structlog.get_logger(name)  # type: ignore[no-any-return]


def configure_logging(json: bool | None = None, level: str = "info") -> None:
    """Configure structlog for an application or script.

    ``json=None`` picks JSON lines when stderr is not a terminal, a console renderer
    otherwise. Tracebacks are rendered without local variables: a local holding a freed
    tensor can crash the interpreter when repr'd.
    """
    if json is None:
        json = not sys.stderr.isatty()
    lvl = logging.getLevelNamesMapping()[level.upper()]
    logging.getLogger("transitions").setLevel(logging.WARNING)
    processors: list[structlog.typing.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if json:
        processors += [
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)),
            structlog.processors.JSONRenderer(),
        ]
    else:
        processors.append(structlog.dev.ConsoleRenderer(
            exception_formatter=structlog.dev.plain_traceback))
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
