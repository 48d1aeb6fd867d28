"""A role process killed before acking: its restarted instance gets the message, the effect happens once."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys

import pytest

from bus.reader import read_log
from bus.runtime import Bus
from bus.server import EmbeddedServer
from bus.subjects import Topic
from schemas import MetricsReported, TaskRef, TaskRequested

pytestmark = pytest.mark.nats


def start_worker(server: EmbeddedServer, run: str, *extra: str) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "tests.integration.worker_proc",
        "--url",
        server.url,
        "--run",
        run,
        *extra,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def count_metrics(bus: Bus) -> dict[str, int]:
    """How many MetricsReported events the stream holds per causing request."""
    counts: dict[str, int] = {}
    async for event in read_log(bus, [(Topic.METRICS_REPORTED, None)], (MetricsReported,)):
        counts[event.causation_id] = counts.get(event.causation_id, 0) + 1
        # A role process's heap after setup is out of the collector's reach (freeze_heap).
        assert event.values["frozen"] > 1000, event.values
    return counts


async def test_crash_before_ack_redelivers_to_restarted_instance_once(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """The crashed message is redelivered after restart; dedup keeps exactly one effect per request."""
    requests = [
        TaskRequested(
            run=bus.run,
            env="e",
            task=TaskRef(index=i),
            group_id=f"g{i}",
            group_size=1,
            event_id=f"req{i}",
        )
        for i in range(5)
    ]
    await bus.publish_many(requests)
    first = start_worker(nats_server, bus.run, "--crash-on", "3")
    assert (
        await asyncio.to_thread(first.wait, 30) == 17
    )  # died on its 3rd message, after publishing
    second = start_worker(nats_server, bus.run)
    try:
        async with asyncio.timeout(30):
            while True:
                info = await bus.js.consumer_info(bus.stream, "worker")
                if info.num_pending == 0 and info.num_ack_pending == 0:
                    break
                await asyncio.sleep(0.2)
    finally:
        second.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(second.wait, 30) == 0  # graceful drain exits cleanly
    counts = await count_metrics(bus)
    assert counts == {f"req{i}": 1 for i in range(5)}
    assert info.delivered.stream_seq >= 5
