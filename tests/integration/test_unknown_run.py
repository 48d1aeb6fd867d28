"""Read commands on a run, as a user types them, against a real nats-server.

A run id that is not there (a typo) fails in one line, naming where it looked and which
runs are there, instead of an empty result, a usage box or a traceback. And ``rlbus sql``
re-syncs a finished run's lake when the log has moved past it (a shadow algorithm
attached after the run stopped appends to the log).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bus.runtime import Bus
from bus.server import EmbeddedServer
from replay.lake import lake_dir, parts
from schemas import Event, TraceCompleted
from tests.samples import a_run_log, every_event, trace

pytestmark = pytest.mark.nats

RLBUS = [sys.executable, "-m", "roles.cli"]
TYPO = "no-such-run"


def rlbus(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``rlbus`` with ``data`` as its data directory and no NATS URL from the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBUS_")}
    env["RLBUS_DATA_DIR"] = str(data)
    return subprocess.run([*RLBUS, *args], capture_output=True, text=True, timeout=120, env=env)


def one_line(out: subprocess.CompletedProcess[str]) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert len(lines) == 1, out.stderr
    assert out.stdout == ""
    return lines[0]


READS = [
    ["sql", "--run", TYPO, "select count(*) from rollouts"],
    ["events", TYPO],
    ["status", "--run", TYPO],
    ["trace", TYPO, "r0"],
    ["export", TYPO, "run.tar"],
]


@pytest.mark.parametrize("command", READS, ids=[c[0] for c in READS])
async def test_an_unknown_run_on_a_server_fails_in_one_line(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path, command: list[str]
) -> None:
    """The server is asked for the run's stream; its runs are listed (this test's among them)."""
    out = await asyncio.to_thread(rlbus, tmp_path, *command, "--nats-url", nats_server.url)
    line = one_line(out)
    assert line.startswith(
        f"no run '{TYPO}' (no stream RL_{TYPO} on {nats_server.url}; runs here: "
    )
    assert bus.run in line
    assert not (tmp_path / TYPO).exists()  # a failed read leaves nothing behind


@pytest.mark.parametrize("command", READS[:3], ids=[c[0] for c in READS[:3]])
def test_an_unknown_run_without_a_server_fails_in_one_line(
    tmp_path: Path, command: list[str]
) -> None:
    """No URL and no run data here: the data directory's runs are listed."""
    (tmp_path / "known" / "lake").mkdir(parents=True)
    line = one_line(rlbus(tmp_path, *command))
    assert line.startswith(
        f"no run '{TYPO}' (no NATS URL given and no run data at {tmp_path / TYPO}"
    )
    assert line.endswith("; runs here: known)")


def after_stop(run: str, n: int) -> list[Event]:
    """Traces stored after the run stopped (what a late shadow attach's log looks like)."""
    return [
        TraceCompleted(run=run, event_id=f"late-{i}", env="reverse-text", request_id="e-task",
                       group_size=8, step=5, trace=trace(run, rollout=f"r-late-{i}"))
        for i in range(n)
    ]  # fmt: skip


def publish_on_store(data: Path, run: str, events: list[Event]) -> None:
    """Append ``events`` to ``run``'s log through its own embedded server, then stop it,
    as ``rlbus up`` and a later ``rlbus algorithm attach`` leave a finished run."""

    async def main(url: str) -> None:
        bus = await Bus.connect(url, run=run, producer="test")
        try:
            await bus.ensure_stream()
            await bus.publish_many(events)
        finally:
            await bus.close()

    with EmbeddedServer(data / run / "nats") as server:
        asyncio.run(main(server.url))


def count(data: Path, run: str, table: str) -> int:
    out = rlbus(data, "sql", "--run", run, "-f", "csv", f"select count(*) as n from {table}")
    assert out.returncode == 0, out.stderr
    return int(out.stdout.splitlines()[1])


def test_sql_resyncs_a_finished_runs_lake_when_the_log_moved_on(
    run_id: str, tmp_path: Path
) -> None:
    """Run stopped and lake synced; events appended after the stop must show up in `rlbus sql`,
    and a query with nothing new adds no part."""
    publish_on_store(tmp_path, run_id, a_run_log(run_id))  # ends with run.stopped
    assert count(tmp_path, run_id, "rollouts") == 2
    publish_on_store(tmp_path, run_id, after_stop(run_id, 3))  # the log goes on after the stop
    assert count(tmp_path, run_id, "rollouts") == 5
    lake = lake_dir(tmp_path, run_id)
    before = sorted(p for t in ("events", "rollouts") for _, _, p in parts(lake, t))
    assert count(tmp_path, run_id, "events") == len(every_event()) + 3
    assert sorted(p for t in ("events", "rollouts") for _, _, p in parts(lake, t)) == before
