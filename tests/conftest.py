"""Shared fixtures: one real nats-server per test session, a fresh run (stream) per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest

from bus.log import configure
from bus.runtime import Bus, BusSettings
from bus.server import EmbeddedServer

configure(json=True, level="WARNING")


@pytest.fixture(scope="session", autouse=True)
def _model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tiny models built by this session's tests and the roles they start are cached
    for the session (``roles.lib.model.model_cache_dir``), not in the user's home."""
    if "RLBUS_CACHE_DIR" in os.environ:
        yield
        return
    os.environ["RLBUS_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    yield
    os.environ.pop("RLBUS_CACHE_DIR", None)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedServer]:
    server = EmbeddedServer(tmp_path_factory.mktemp("nats")).start()
    yield server
    server.stop()


@pytest.fixture
def run_id() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
async def bus(nats_server: EmbeddedServer, run_id: str) -> AsyncIterator[Bus]:
    b = await Bus.connect(nats_server.url, run=run_id, producer="test",
                          settings=BusSettings(ack_wait_s=2.0, nak_delay_s=0.1, max_deliver=3))  # fmt: skip
    await b.ensure_stream()
    yield b
    await b.js.delete_stream(b.stream)
    await b.close()
