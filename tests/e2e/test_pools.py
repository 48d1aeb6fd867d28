"""An elastic env pool in a real run: it grows under a backlog, drains a replica back out
when idle, and no request is lost or answered twice on the way.

The smoke run with one env whose pool is 1..2 replicas of one group at a time, so four
groups in flight make a backlog. Once the pool has grown, the trainer is paused: the
orchestrator stops dispatching (``max_async_level``), the pool runs out of work and
retires its second replica (SIGTERM, drain, exit 0); then the trainer goes on and the
run finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from bus.server import EmbeddedServer
from schemas import EvalCompleted, TaskRequested, TraceCompleted
from tests.e2e.helpers import all_events, as_launcher, rlbus_up, summary

RUN = "pools1"
POOL = (
    'orchestrator.train.env=[{id="reverse-text",group_size=4,max_concurrent=1,'
    "min_replicas=1,max_replicas=2}]"
)
FAST = [
    "env_server.scale_up_backlog=1", "env_server.scale_up_after_s=0.5",
    "env_server.scale_down_idle_s=1", "env_server.scale_check_s=0.25",
]  # fmt: skip


class Lines:
    """The launcher's output, read as it comes (plain mode: one ``[rlbus]`` line a note)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        assert proc.stdout is not None
        out = proc.stdout
        self.reader = threading.Thread(target=lambda: self.lines.extend(out), daemon=True)
        self.reader.start()

    async def wait_for(self, text: str, proc: subprocess.Popen[str], timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if found := next((line for line in self.lines if text in line), None):
                return found
            await asyncio.sleep(0.1)
        raise AssertionError(f"no {text!r} in {timeout_s:g}s:\n" + "".join(self.lines[-40:]))


def pid_of(lines: list[str], role: str) -> int:
    """The pid the launcher logged for ``role`` (its ``role.started`` JSON line)."""
    started = [json.loads(x) for x in lines if '"role.started"' in x and f'"{role}"' in x]
    return int(started[-1]["pid"])


@pytest.mark.e2e
@pytest.mark.slow  # 40-65 s here: the run, and a second env server's start
async def test_an_elastic_env_pool_grows_under_backlog_and_drains_back_when_idle(
    tmp_path: Path,
) -> None:
    # max_steps leaves room: the pool grows at step 2-5 here, and the trainer must still
    # have steps to go when it is paused (a run already over cannot drain a replica idle)
    proc = rlbus_up(tmp_path, RUN, "max_steps=20", POOL, *FAST)
    out = Lines(proc)
    trainer: int | None = None
    try:
        await out.wait_for("env-reverse-text: 1 -> 2 replicas (backlog", proc, 150)
        trainer = pid_of(out.lines, "trainer")
        os.kill(trainer, signal.SIGSTOP)  # no new weights: no new groups
        await out.wait_for("env-reverse-text: 2 -> 1 replicas (idle", proc, 120)
        retired = await out.wait_for("env-reverse-text-1 retired", proc, 60)
        os.kill(trainer, signal.SIGCONT)
        trainer = None
        await asyncio.to_thread(proc.wait, 240)
    finally:
        if trainer is not None:
            with contextlib.suppress(ProcessLookupError):  # it may have exited meanwhile
                os.kill(trainer, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        out.reader.join(5)
        proc.stdout.close()  # type: ignore[union-attr]
    assert proc.returncode == 0, "".join(out.lines[-60:])
    assert "(exit 0, drained in" in retired, retired  # drained and exited on its own
    pools = summary(tmp_path, RUN)["pools"]["env-reverse-text"]
    assert (pools["min"], pools["max"], pools["peak"]) == (1, 2, 2)
    assert [(e["from"], e["to"]) for e in pools["scaled"]][:2] == [(1, 2), (2, 1)]
    assert pools["serving"][0]["replica"] == "env-reverse-text-1"  # it served before it retired
    log = (tmp_path / RUN / "logs" / "env-reverse-text-1.log").read_text()
    assert '"role.stopped"' in log  # drained through the runtime, not killed

    as_launcher(tmp_path, RUN)
    with EmbeddedServer(tmp_path / RUN / "nats") as server:
        events = await all_events(server.url, RUN)
    requests = [e for e in events if isinstance(e, TaskRequested)]
    traces = Counter(e.request_id for e in events if isinstance(e, TraceCompleted))
    evals = Counter(e.request_id for e in events if isinstance(e, EvalCompleted))
    trace_ids = [e.event_id for e in events if isinstance(e, TraceCompleted)]
    assert requests and len(trace_ids) == len(set(trace_ids))
    for r in requests:  # every request answered, exactly once: a group's traces or one eval
        answer = (traces[r.event_id], evals[r.event_id])
        assert answer == ((0, 1) if r.task.split == "eval" else (r.group_size, 0)), r
    assert set(traces) | set(evals) == {r.event_id for r in requests}
