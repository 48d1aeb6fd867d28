"""structlog set-up: one event per line, ``run`` and ``role`` bound; JSON for machines,
a plain line for a person.

Call ``configure()`` once per process (the CLI does); get loggers with ``get_logger``.

JSON lines are for what reads them back: a role's log file (``rlbus up`` sends each
role's stderr there, and reads its last error back: ``roles.up.role_errors``), ``--json``,
a pipe that asked for machine lines (``rlbus up --no-view | ...``). A terminal gets one
plain line per event (``HH:MM:SS [level] event key=value ...``). ``json_file`` keeps the
JSON lines of a process that talks to a person too (the launcher's ``logs/launcher.log``),
every event from INFO on, whatever ``level`` lets through to the terminal.
"""

from __future__ import annotations

import json as jsonlib
import logging
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, TextIO

import structlog

_configured = False
_json_file: JsonFile | None = None  # the open json_file of the current configuration
LEVELS = logging.getLevelNamesMapping()


def configure(
    *, json: bool | None = None, level: str = "INFO", json_file: Path | None = None, **bind: Any
) -> None:
    """Configure structlog for this process and bind context (e.g. run=, role=).

    ``json``: JSON lines on stderr (True), plain lines (False), or JSON unless stderr is a
    terminal (None). ``level``: the least level shown on stderr. ``json_file``: every
    event from INFO on, also appended there as a JSON line."""
    global _configured, _json_file
    if _json_file is not None:  # a re-configuration: the file it names (or none) from now on
        _json_file.file.close()
        _json_file = None
    if json is None:
        json = not sys.stderr.isatty()
    shown = LEVELS[level.upper()]
    processors: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
    ]
    least = shown
    if json_file is not None:
        _json_file = JsonFile(json_file)
        processors.append(_json_file)
        least = min(shown, logging.INFO)
    processors.append(AtLeast(shown))
    if json:
        processors.append(structlog.processors.JSONRenderer())
    else:
        processors += [short_time, structlog.dev.ConsoleRenderer(colors=False)]
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(least),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    if bind:
        structlog.contextvars.bind_contextvars(**bind)
    _configured = True


class _Stderr:
    """``sys.stderr`` as it is at each write, not at configuration: whatever swaps it (a
    test's capture, click's CliRunner) may close its own stream after."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


class JsonFile:
    """A processor that appends each event to a file as a JSON line and passes it on."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file: TextIO = path.open("a", buffering=1)  # line-buffered: a crash loses no line

    def __call__(self, logger: Any, name: str, event: MutableMapping[str, Any]) -> Any:
        self.file.write(jsonlib.dumps(dict(event), default=repr) + "\n")
        return event


class AtLeast:
    """A processor that drops an event below ``level`` (the file above takes it first)."""

    def __init__(self, level: int) -> None:
        self.level = level

    def __call__(self, logger: Any, name: str, event: MutableMapping[str, Any]) -> Any:
        if LEVELS.get(str(event.get("level", "")).upper(), logging.CRITICAL) < self.level:
            raise structlog.DropEvent
        return event


def short_time(logger: Any, name: str, event: MutableMapping[str, Any]) -> Any:
    """A person reads the local time of day, not a UTC ISO stamp."""
    if "timestamp" in event:
        event["timestamp"] = time.strftime("%H:%M:%S")
    return event


def get_logger(**bind: Any) -> Any:
    return structlog.get_logger().bind(**bind)
