"""Shared CLI plumbing: finding (or starting) the run's NATS server, running coroutines."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:
    from configs.paths import RunPaths


def run_paths(run: str, data_dir: str | Path | None = None) -> RunPaths:
    """``run``'s paths under ``data_dir`` (a ``--data-dir`` flag; resolved by
    ``configs.paths.resolve_data_dir``: the flag, else $RLBUS_DATA_DIR, else ``runs``)."""
    from configs.paths import RunPaths, resolve_data_dir

    return RunPaths(resolve_data_dir(data_dir), run)


@contextlib.contextmanager
def server_for(
    run: str | None, nats_url: str | None, data_dir: str | Path | None = None
) -> Iterator[str]:
    """The URL to use: --nats-url, $RLBUS_NATS_URL, the run's running embedded server, or
    a temporary embedded server started on the run's data (stopped afterwards)."""
    from bus.server import reachable_server

    store = None if run is None else run_paths(run, data_dir).nats
    with reachable_server(store, nats_url) as url:
        if url is None:
            if run is None:
                raise typer.BadParameter("give --run or --nats-url")
            raise typer.BadParameter(f"no NATS URL given and no run data at {store}")
        yield url


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        return asyncio.run(coro)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
