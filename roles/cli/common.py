"""Shared CLI plumbing: finding (or starting) the run's NATS server, running coroutines."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import typer

DATA_DIR = os.environ.get("RLBUS_DATA_DIR", "runs")


def nats_dir(run: str, data_dir: str | Path = DATA_DIR) -> Path:
    """Where a run's embedded nats-server keeps its JetStream store."""
    return Path(data_dir) / run / "nats"


@contextlib.contextmanager
def server_for(
    run: str | None, nats_url: str | None, data_dir: str | Path = DATA_DIR
) -> Iterator[str]:
    """The URL to use: --nats-url, $RLBUS_NATS_URL, the run's running embedded server, or
    a temporary embedded server started on the run's data (stopped afterwards)."""
    from bus.server import EmbeddedServer, running_server_url

    url = nats_url or os.environ.get("RLBUS_NATS_URL")
    if url:
        yield url
        return
    if run is None:
        raise typer.BadParameter("give --run or --nats-url")
    store = nats_dir(run, data_dir)
    if running := running_server_url(store):
        yield running
        return
    if not (store / "jetstream").exists():
        raise typer.BadParameter(f"no NATS URL given and no run data at {store}")
    with EmbeddedServer(store) as server:
        yield server.url


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    try:
        return asyncio.run(coro)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
