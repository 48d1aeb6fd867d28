"""The finished smoke run that several e2e modules read (one run for all: analytics, metric
sinks, replay and the end-to-end checks of ``test_up``), so each pays no run of its own."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import replay
from bus.server import EmbeddedServer
from tests.e2e.helpers import all_events, rlbus_up

ANALYTICS_RUN = "ana1"
CONSOLE = "up.out"  # under the fixture's data directory
# a config shadow next to grpo: the comparison query (15) has rows to return
ANALYTICS_OVERRIDES = (
    "max_steps=4",
    'orchestrator.algorithms=[{id="grpo"},{id="max_rl",shadow=true}]',
    'monitor.sinks=["tensorboard","wandb"]',
)


@pytest.fixture(autouse=True)
def _forget_identity() -> Iterator[None]:
    """A test that connected as a run's identity (``helpers.as_launcher``) leaves none
    behind for the next test's runs."""
    from bus.auth import CREDS_ENV

    yield
    os.environ.pop(CREDS_ENV, None)


@pytest.fixture(scope="session")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[Any]]]:
    """One finished smoke run (4 steps, a shadow max_rl beside grpo, the TensorBoard and
    offline W&B sinks on), its lake synced, and its log read back."""
    data = tmp_path_factory.mktemp("analytics")
    proc = rlbus_up(data, ANALYTICS_RUN, *ANALYTICS_OVERRIDES)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    (data / CONSOLE).write_text(out)  # what the launcher printed, for test_up_numbers
    result = replay.sync_lake(ANALYTICS_RUN, data, force=True)
    assert result is not None and not result.skipped
    with EmbeddedServer(data / ANALYTICS_RUN / "nats") as server:
        events = asyncio.run(all_events(server.url, ANALYTICS_RUN))
    yield data, events
