"""Progress of a long command: a bar on a terminal, a plain line every few seconds otherwise.

    with progress("lake sync", total=n_events, unit="events") as update:
        for i, event in enumerate(events, 1):
            ...
            update(i)                 # done so far (a new total may come with it)

Library code (``replay``, ``roles.up``) never imports this: it takes an ``on_progress``
callback ``(done, total)`` and the command passes ``update``. On a terminal the bar is
rich's (on stderr, so piped stdout stays clean); otherwise (a log file, CI) one line
``label: done/total unit (pct%)`` at most every ``every_s`` seconds, and a last one at
the end, so a long command is never silent. Nothing is drawn until the first update: a
command with nothing to do (``rlbus sql`` on an up-to-date lake) stays quiet.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

Update = Callable[..., None]  # update(done, total=None)


@contextmanager
def progress(
    label: str, total: int | None = None, unit: str = "", every_s: float = 5.0,
    terminal: bool | None = None,
) -> Iterator[Update]:  # fmt: skip
    """Yield ``update(done, total=None)``; draw it as a bar (terminal) or periodic lines."""
    err = sys.stderr
    if terminal if terminal is not None else err.isatty():
        with _bar(label, total, unit) as update:
            yield update
    else:
        with _lines(label, total, unit, every_s, err.write) as update:
            yield update


@contextmanager
def _bar(label: str, total: int | None, unit: str) -> Iterator[Update]:
    columns = [
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
        TextColumn(unit), TimeElapsedColumn(), TimeRemainingColumn(),
    ]  # fmt: skip
    bar = Progress(*columns, console=Console(stderr=True), transient=False)
    task = bar.add_task(label, total=total)

    def update(done: int, total: int | None = None) -> None:
        if not bar.live.is_started:
            bar.start()
        bar.update(task, completed=done, total=total)  # total None: unchanged

    try:
        yield update
    finally:
        if bar.live.is_started:
            bar.stop()  # leaves the last state of the bar on the terminal


@contextmanager
def _lines(
    label: str, total: int | None, unit: str, every_s: float, write: Callable[[str], object]
) -> Iterator[Update]:
    done_now, total_now, said = 0, total, time.monotonic()
    shown: int | None = None  # the done of the last line; None: never updated

    def line() -> str:
        text = f"{label}: {done_now}" + (f"/{total_now}" if total_now else "")
        text += f" {unit}" if unit else ""
        return text + (f" ({100 * done_now / total_now:.0f}%)" if total_now else "") + "\n"

    def update(done: int, total: int | None = None) -> None:
        nonlocal done_now, total_now, said, shown
        done_now = done
        total_now = total if total is not None else total_now
        if shown is None:
            shown = -1  # updated at least once: the end gets a line
        if time.monotonic() - said >= every_s:
            said, shown = time.monotonic(), done
            write(line())

    yield update
    if shown is not None and shown != done_now:
        write(line())
