"""Helpers for e2e tests: run `rlbus up` as a process and read the run's log back."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import nats.js.errors

from bus.auth import CREDS_ENV, creds_path
from bus.reader import read_log
from bus.registry import RoleHeartbeat, list_roles
from bus.runtime import Bus
from bus.server import EmbeddedServer, running_server_url
from bus.subjects import Topic
from schemas import EVENT_TYPES, WeightsPublished


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


def stop_if_running(proc: subprocess.Popen[str]) -> None:
    """After a failed wait: kill the launcher if it still runs and close its pipe, so that
    neither outlives the test (a later test would fail on the ResourceWarning)."""
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def rlbus(data_dir: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """One ``rlbus`` command over the runs under ``data_dir`` (its embedded servers)."""
    env = {**os.environ, "RLBUS_DATA_DIR": str(data_dir)}
    env.pop("RLBUS_NATS_URL", None)
    return subprocess.run(
        [sys.executable, "-m", "roles.cli", *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip


async def all_events(url: str, run: str) -> list[Any]:
    bus = await Bus.connect(url, run=run, producer="e2e")
    try:
        return [e async for e in read_log(bus, [(t, None) for t in Topic], EVENT_TYPES)]
    finally:
        await bus.close()


async def finished_run(data_dir: Path, run: str, *overrides: str, steps: int) -> list[Any]:
    """``rlbus up`` a smoke run of ``steps`` steps to its end (exit 0, every step trained),
    then every event of its log."""
    proc = rlbus_up(data_dir, run, f"max_steps={steps}", *overrides)
    out, _ = await asyncio.to_thread(proc.communicate, timeout=400)
    assert proc.returncode == 0, out[-4000:]
    assert summary(data_dir, run)["steps"] == steps
    with EmbeddedServer(data_dir / run / "nats") as server:
        return await all_events(server.url, run)


async def reached_version(
    proc: subprocess.Popen[str],
    data_dir: Path,
    run: str,
    version: int,
    timeout_s: float,
    url: str | None = None,
) -> str | None:
    """Poll a running ``rlbus up`` until its run has announced weights ``version``: the
    url of the run's server then (``url``: a server the run was given, else its own);
    None if the run ended or time ran out first."""
    store = data_dir / run / "nats"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        await asyncio.sleep(0.5)
        found = url or running_server_url(store)
        if found is None:
            continue
        as_launcher(data_dir, run)
        try:
            events = await all_events(found, run)
        except nats.js.errors.NotFoundError:
            continue  # the run's stream does not exist yet
        if any(isinstance(e, WeightsPublished) and e.version >= version for e in events):
            return found
    return None


def as_launcher(data_dir: Path, run: str) -> None:
    """This test process connects as the run's ``launcher`` identity from now on (the
    servers ``rlbus up`` starts take no anonymous client); the e2e conftest forgets it
    after each test."""
    creds = creds_path(data_dir / run / "auth", "launcher")
    if creds.exists():
        os.environ[CREDS_ENV] = str(creds)


async def running_role(url: str, run: str, role: str, instance: str = "") -> RoleHeartbeat:
    """The one running process of ``role`` (whose instance name contains ``instance``)."""
    bus = await Bus.connect(url, run=run, producer="e2e")
    try:
        (found,) = [
            r for r in await list_roles(bus.js, run)
            if r.role == role and r.status == "running" and instance in r.instance
        ]  # fmt: skip
    finally:
        await bus.close()
    return found


def summary(data_dir: Path, run: str) -> dict[str, Any]:
    return json.loads((data_dir / run / "summary.json").read_text())
