"""Shared benchmark plumbing: results go to ``benchmarks/results/<name>.json`` and stdout."""

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
