"""structlog set-up: one event per line, JSON when not a TTY, ``run`` and ``role`` bound.

Call ``configure()`` once per process (the CLI does); get loggers with ``get_logger``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_configured = False


def configure(*, json: bool | None = None, level: str = "INFO", **bind: Any) -> None:
    """Configure structlog for this process and bind context (e.g. run=, role=)."""
    global _configured
    if json is None:
        json = not sys.stderr.isatty()
    renderer: Any = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if bind:
        structlog.contextvars.bind_contextvars(**bind)
    _configured = True


def get_logger(**bind: Any) -> Any:
    return structlog.get_logger().bind(**bind)
