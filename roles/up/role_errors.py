"""Why a role process died, in one line: the last error of its log, and its exit.

The launcher (``roles/up/supervisor.py``) shows this when it restarts a role and when a
role died too often, so the cause (``ModelNotFound: ...``) reaches the console instead of
staying in ``runs/<run>/logs/<role>.log``.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

# A traceback's header, within an exception group's "  | " margin (``prefix``).
TRACEBACK = re.compile(
    r"^(?P<prefix>[ |+]*?)(?:Exception Group )?Traceback \(most recent call last\):$"
)
# The module path of an exception's name ("roles.lib.model.loading." of ModelNotFound).
QUALIFIED = re.compile(r"^(?:[A-Za-z_]\w*\.)+(?=[A-Za-z_]\w*(?::|$))")
ERROR_LEVELS = ("error", "critical", "exception")
TAIL_BYTES = 256 * 1024


def last_error(log: Path, offset: int = 0, width: int = 200) -> str | None:
    """The last error in a role's log from byte ``offset`` on, as one line: the exception
    line of the last traceback (``ModelNotFound: model path does not exist: x``), plain or
    in a structlog JSON line, or the last JSON line logged at error level; else the last
    unindented plain line. None when the log holds none of these."""
    try:
        with log.open("rb") as f:
            size = f.seek(0, 2)
            f.seek(max(offset, size - TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    lines = text.splitlines()
    found = _last_error_in(lines) or _last_plain_line(lines)
    return None if found is None else _one_line(found, width)


def exit_text(code: int | None) -> str:
    """A process's return code in words: ``exit 1``, ``killed by SIGKILL``."""
    if code is None:
        return "still running"
    if code >= 0:
        return f"exit {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def _last_error_in(lines: list[str]) -> str | None:
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        found = _json_error(line) if line.startswith("{") else _traceback_error(lines, i)
        if found:
            return found
    return None


def _traceback_error(lines: list[str], i: int) -> str | None:
    """The exception line of the traceback whose header is ``lines[i]``: the first line
    after it that is not indented (within an exception group's ``|`` margin)."""
    head = TRACEBACK.match(lines[i])
    if head is None:
        return None
    margin = len(head["prefix"])
    for line in lines[i + 1 :]:
        body = line[margin:]
        if body and not body[0].isspace():
            return QUALIFIED.sub("", body)
    return None


def _json_error(line: str) -> str | None:
    """An error-level structlog line: its exception's last line, or ``event: error``."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict) or record.get("level") not in ERROR_LEVELS:
        return None
    exception = record.get("exception")
    if isinstance(exception, str) and exception.strip():
        return _last_error_in(exception.splitlines()) or exception.strip().splitlines()[-1]
    detail = next((record[k] for k in ("error", "reason", "detail") if record.get(k)), None)
    event = str(record.get("event", "error"))
    return f"{event}: {detail}" if detail else event


def _last_plain_line(lines: list[str]) -> str | None:
    plain = (x for x in reversed(lines) if x.strip() and not x[0].isspace() and x[0] != "{")
    return next(plain, None)


def _one_line(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"
