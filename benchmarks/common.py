"""Shared benchmark plumbing: results go to ``benchmarks/results/<name>.json`` and stdout;
a stopped run's events are read back from its own log (``run_events``)."""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def save(name: str, results: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {
        "benchmark": name,
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()},
        **results,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def run_events(run_dir: Path, wanted: dict[str, tuple[Any, type]]) -> dict[str, list[Any]]:
    """Events of a stopped run, read from its own log (its embedded server reopened on
    ``run_dir/nats``): for each name of ``wanted``, every event of that (topic, type),
    in log order.

        run_events(root / run, {"batches": (Topic.BATCH_ASSEMBLED, BatchAssembled)})
    """
    import asyncio

    from bus.reader import read_log
    from bus.runtime import Bus
    from bus.server import EmbeddedServer

    async def read() -> dict[str, list[Any]]:
        with EmbeddedServer(run_dir / "nats") as server:
            bus = await Bus.connect(server.url, run=run_dir.name, producer="bench")
            try:
                return {
                    name: [e async for e in read_log(bus, [(topic, None)], (kind,))]
                    for name, (topic, kind) in wanted.items()
                }
            finally:
                await bus.close()

    return asyncio.run(read())


async def close_all(events: Any, bus: Any, roles: list[Any]) -> None:
    """A benchmark's teardown: its event iterator, its bus connection, then its role
    processes (terminated, then waited for, at most 30 s each)."""
    import asyncio

    await events.aclose()
    await bus.close()
    for r in roles:
        r.terminate()
    for r in roles:
        await asyncio.to_thread(r.wait, 30)
