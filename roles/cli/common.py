"""Shared CLI plumbing: finding (or starting) the run's NATS server, running coroutines,
and failing in one line (``fail``; an unknown run: ``no_run``, ``require_run``)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer

if TYPE_CHECKING:
    from configs.paths import RunPaths


def run_paths(run: str, data_dir: str | Path | None = None) -> RunPaths:
    """``run``'s paths under ``data_dir`` (a ``--data-dir`` flag; resolved by
    ``configs.paths.resolve_data_dir``: the flag, else $RLBUS_DATA_DIR, else ``runs``)."""
    from configs.paths import RunPaths, resolve_data_dir

    return RunPaths(resolve_data_dir(data_dir), run)


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr and a non-zero exit: the cause, without a usage box or traceback."""
    typer.echo(message, err=True)
    raise typer.Exit(code)


def no_run(run: str, why: str, runs: list[str]) -> NoReturn:
    """Exit saying ``run`` does not exist, why we think so, and which runs do."""
    fail(f"no run {run!r} ({why}; runs here: {', '.join(runs) or 'none'})")


def local_runs(data_dir: str | Path | None = None) -> list[str]:
    """Runs with data under the data directory: a JetStream store or a lake."""
    from configs.paths import RunPaths, resolve_data_dir

    root = resolve_data_dir(data_dir)
    if not root.is_dir():
        return []
    found = [RunPaths(root, p.name) for p in root.iterdir() if p.is_dir()]
    return sorted(r.run for r in found if r.nats.is_dir() or r.lake.is_dir())


async def _stream_check(url: str, run: str) -> list[str] | None:
    """None if the server at ``url`` has ``run``'s stream, else the runs it has."""
    from bus.runtime import Bus

    bus = await Bus.connect(url, run=run, producer="cli")
    try:
        return None if await bus.has_stream() else await bus.runs()
    finally:
        await bus.close()


def require_run(url: str, run: str) -> None:
    """Exit in one line unless the server at ``url`` holds ``run``'s stream (``RL_<run>``):
    a read command on a typo must say so, not print an empty table or a traceback."""
    from bus.subjects import stream_name

    try:
        stream = stream_name(run)
    except ValueError as e:  # not a valid run id: it can have no stream
        fail(str(e))
    others = run_async(_stream_check(url, run))
    if others is not None:
        no_run(run, f"no stream {stream} on {url}", others)


@contextlib.contextmanager
def server_for(
    run: str | None,
    nats_url: str | None,
    data_dir: str | Path | None = None,
    *,
    existing: bool = False,
    identity: str = "reader",
) -> Iterator[str]:
    """The URL to use: --nats-url, $RLBUS_NATS_URL, the run's running embedded server, or
    a temporary embedded server started on the run's data (stopped afterwards).

    ``existing``: the command reads ``run``, so the run's stream must be on that server
    (``require_run``); a role attaching to a run that has not started yet passes False.
    ``identity``: the run's role kind the command connects as (``bus.auth``) when the
    run has credentials; the read commands are ``reader``."""
    from bus.server import reachable_server

    store = None if run is None else run_paths(run, data_dir).nats
    with reachable_server(store, nats_url, identity=identity) as url:
        if url is None:
            if run is None:
                raise typer.BadParameter("give --run or --nats-url")
            no_run(run, f"no NATS URL given and no run data at {store}", local_runs(data_dir))
        if existing and run is not None:
            require_run(url, run)
        yield url


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    from bus.errors import ServerUnreachable

    try:
        return asyncio.run(coro)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except ServerUnreachable as e:  # a wrong --nats-url: one line, not a traceback
        fail(str(e), code=1)
