"""Helpers for e2e tests: run `rlbus up` as a process and read the run's log back."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bus.reader import read_log
from bus.runtime import Bus
from bus.subjects import Topic
from schemas import EVENT_TYPES


def rlbus_up(
    data_dir: Path, run: str, *overrides: str, config: str = "smoke"
) -> subprocess.Popen[str]:
    cmd = [
        sys.executable,
        "-m",
        "roles.cli",
        "up",
        "-c",
        config,
        "--no-view",
        "--run",
        run,
        f"bus.data_dir={data_dir}",
        *overrides,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


async def all_events(url: str, run: str) -> list[Any]:
    bus = await Bus.connect(url, run=run, producer="e2e")
    try:
        return [e async for e in read_log(bus, [(t, None) for t in Topic], EVENT_TYPES)]
    finally:
        await bus.close()


def summary(data_dir: Path, run: str) -> dict[str, Any]:
    return json.loads((data_dir / run / "summary.json").read_text())
