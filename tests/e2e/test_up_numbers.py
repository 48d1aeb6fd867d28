"""`rlbus up` tells the truth: its counts match the log, a dying role's error reaches the
console, and a closed terminal (SIGHUP) drains the roles like Ctrl-C.

The first test reads the session's smoke run (``tests/e2e/conftest.py``); the others drive the supervisor's parts
(``RunFollower``, ``supervise``) against the session's real nats-server, with tiny Python
processes as roles.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bus.runtime import Bus
from bus.server import EmbeddedServer
from bus.subjects import Topic, filter_subject, subject
from configs import RunConfig, load_config
from configs.paths import RunPaths
from roles.up.monitor import RunMonitor
from roles.up.processes import RoleProcess
from roles.up.supervisor import MAX_RESTARTS, RunFollower, stop_in_order, supervise
from schemas import MetricsReported
from tests.e2e.conftest import ANALYTICS_RUN, CONSOLE
from tests.e2e.helpers import summary


async def stored_count(bus: Bus, topic: Topic) -> int:
    """Messages on ``topic`` as the stream counts them (no consumer involved)."""
    pattern = filter_subject(bus.run, topic)
    info = await bus.js.stream_info(bus.stream, subjects_filter=pattern)
    return sum((info.state.subjects or {}).values())


@pytest.mark.e2e
@pytest.mark.slow
async def test_summary_counts_the_runs_train_and_eval_rollouts(
    smoke: tuple[Path, list[Any]],
) -> None:
    """summary.json's rollouts are the log's trace.completed messages (not every message),
    its eval rollouts k per eval.completed; the console tells phases, the drain, and ends
    with a readable report, not a dict."""
    data, run = smoke[0], ANALYTICS_RUN
    out = (data / CONSOLE).read_text()
    s = summary(data, run)
    with EmbeddedServer(data / run / "nats") as server:
        bus = await Bus.connect(server.url, run=run, producer="e2e")
        try:
            traces = await stored_count(bus, Topic.TRACE_COMPLETED)
            evals = await stored_count(bus, Topic.EVAL_COMPLETED)
            info = await bus.js.stream_info(bus.stream)
        finally:
            await bus.close()
    k = load_config("smoke").orchestrator.eval.k
    assert traces > 0 and info.state.messages > traces + evals
    assert s["rollouts"] == traces and s["eval_rollouts"] == evals * k
    lines = [line for line in out.splitlines() if not line.startswith("{")]  # no JSON logs
    phases = [line.removeprefix("[rlbus] phase: ") for line in lines if "] phase: " in line]
    # In this order; a phase shorter than a refresh (0.5 s, the warm start or RL here) may
    # not show, but nothing shows before "starting" or after the stop.
    order = ["starting", "warm start (sft)", "rl", "stopped (max_steps)"]
    assert phases[0] == "starting" and phases[-1] == "stopped (max_steps)", phases
    assert [order.index(p) for p in phases] == sorted({order.index(p) for p in phases}), phases
    assert "[rlbus]   env-reverse-text: draining" in lines
    report = lines[lines.index(f"rlbus run {run}") :]
    assert "stopped: max_steps" in report[1] and "{" not in "".join(report)
    assert any(f"{traces} train" in line for line in report)


@pytest.mark.nats
@pytest.mark.slow  # ~20 s: nats-py resets after two missed 5 s heartbeats
async def test_the_trace_count_survives_an_ordered_consumer_reset(bus: Bus) -> None:
    """nats-py recreates an ordered consumer that stops sending heartbeats (here: deleted
    on the server) from the next sequence on, with the same config: the recreated one
    still sees only trace.completed and eval.completed, so nothing else is counted."""
    monitor = RunMonitor(run=bus.run, max_steps=1, eval_k=2)
    follower = RunFollower(bus, monitor)
    follower.start()
    try:
        await publish_mix(bus, 1)
        await wait_for(lambda: (monitor.rollouts, monitor.eval_tasks) == (3, 1), "round 1")
        (first,) = await consumers_on(bus, Topic.TRACE_COMPLETED)
        await bus.js.delete_consumer(bus.stream, first)
        await publish_mix(bus, 2)  # stored while the counter has no consumer
        await wait_for(lambda: (monitor.rollouts, monitor.eval_tasks) == (6, 2), "the reset")
        await publish_mix(bus, 3)
        await wait_for(lambda: (monitor.rollouts, monitor.eval_tasks) == (9, 3), "round 3")
        (second,) = await consumers_on(bus, Topic.TRACE_COMPLETED)
    finally:
        await follower.finish()
    assert second != first
    assert monitor.rollouts == await stored_count(bus, Topic.TRACE_COMPLETED)
    assert monitor.eval_rollouts == 2 * await stored_count(bus, Topic.EVAL_COMPLETED)
    assert sorted(monitor.trainer) == [1, 2, 3]  # the events reader read on as well


async def consumers_on(bus: Bus, topic: Topic) -> list[str]:
    """Names of the consumers whose filter includes ``topic``."""
    pattern = filter_subject(bus.run, topic)
    infos = await bus.js.consumers_info(bus.stream)
    return [i.name for i in infos if pattern in (i.config.filter_subjects or [])]


async def publish_mix(bus: Bus, round_: int) -> None:
    """Three traces, one eval, a task and a metric: the counter must count 3 and 1."""
    for i in range(3):
        await bus.js.publish(
            subject(bus.run, Topic.TRACE_COMPLETED, "env"), f"{round_}.{i}".encode()
        )
    await bus.js.publish(subject(bus.run, Topic.EVAL_COMPLETED, "env"), b"eval")
    await bus.js.publish(subject(bus.run, Topic.TASK_REQUESTED, "env"), b"task")
    await bus.publish(MetricsReported(run=bus.run, role="trainer", step=round_, values={}))


async def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 40.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


def python_role(name: str, paths: RunPaths, code: str) -> RoleProcess:
    return RoleProcess(name, [sys.executable, "-c", code], paths.log(name))


def run_paths(tmp_path: Path, run_id: str) -> tuple[RunConfig, RunPaths]:
    cfg = load_config("smoke")
    cfg.run, cfg.bus.data_dir = run_id, str(tmp_path)
    return cfg, RunPaths.of(cfg)


@pytest.mark.nats
async def test_a_role_that_keeps_dying_fails_the_run_with_its_last_error(
    nats_server: EmbeddedServer, run_id: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each restart and the final failure name the error in the role's log, not just
    "see the log"."""
    cfg, paths = run_paths(tmp_path, run_id)
    crash = (
        "class ModelNotFound(Exception): ...\n"
        'print(\'{"event": "role.starting", "level": "info"}\')\n'
        "raise ModelNotFound('model path does not exist: x')\n"
    )
    roles = [python_role("trainer", paths, crash)]
    try:
        code = await asyncio.wait_for(supervise(cfg, paths, nats_server.url, roles, False), 60)
    finally:
        await delete_stream(nats_server.url, run_id)
    assert code == 1 and roles[0].restarts == MAX_RESTARTS
    error = "ModelNotFound: model path does not exist: x (exit 1)"
    out = capsys.readouterr().out
    assert f"[rlbus] trainer died: {error}; restarted (#1)" in out
    failed = summary(tmp_path, run_id)["failed"]
    assert failed.startswith(f"trainer died {MAX_RESTARTS + 1} times; last: {error}")
    assert f"FAILED: {failed}" in out


@pytest.mark.nats
async def test_sighup_drains_and_stops_the_roles(
    nats_server: EmbeddedServer, run_id: str, tmp_path: Path
) -> None:
    """The terminal closing (SIGHUP to the launcher) stops the roles with SIGTERM, in order,
    like Ctrl-C: each drains, the summary is written, the exit code is 130's."""
    cfg, paths = run_paths(tmp_path, run_id)
    drain = (
        "import pathlib, signal, sys, time\n"
        "out = pathlib.Path(sys.argv[1])\n"
        "signal.signal(signal.SIGTERM, lambda *_: (out.write_text('drained'), sys.exit(0)))\n"
        "out.write_text('ready')\n"
        "time.sleep(60)\n"
    )
    roles = [python_role(n, paths, drain) for n in ("orchestrator", "inference-policy-0")]
    for r in roles:
        r.argv.append(str(tmp_path / f"{r.name}.state"))
    states = [tmp_path / f"{r.name}.state" for r in roles]

    async def hang_up_once_ready() -> None:
        while not all(p.exists() for p in states):
            await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGHUP)

    hangup = asyncio.create_task(hang_up_once_ready())
    try:
        code = await asyncio.wait_for(supervise(cfg, paths, nats_server.url, roles, False), 60)
    finally:
        hangup.cancel()
        await delete_stream(nats_server.url, run_id)
    assert code == 130
    assert [p.read_text() for p in states] == ["drained", "drained"]
    assert summary(tmp_path, run_id)["interrupted"] == "SIGHUP"


async def delete_stream(url: str, run: str) -> None:
    bus = await Bus.connect(url, run=run, producer="e2e")
    try:
        await bus.js.delete_stream(bus.stream)
    finally:
        await bus.close()


class Recorder:
    """A stop watcher that keeps what it was told."""

    def __init__(self) -> None:
        self.told: list[tuple[str, str]] = []

    def role_state(self, name: str, state: str) -> None:
        self.told.append((name, state.split(" (")[0]))

    def refresh(self) -> None:
        pass


@pytest.mark.e2e
async def test_roles_stop_in_order_and_one_that_does_not_drain_is_killed(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path, "stop1")
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    roles = [
        python_role("inference-policy-0", paths, stubborn),
        python_role("orchestrator", paths, "import time; time.sleep(60)"),
    ]
    for r in roles:
        r.start()
    await asyncio.sleep(0.5)  # the stubborn one has set its handler
    watcher = Recorder()
    await stop_in_order(roles, timeout_s=1.0, watcher=watcher)
    assert watcher.told == [
        ("orchestrator", "draining"),
        ("orchestrator", "stopped"),
        ("inference-policy-0", "draining"),
        ("inference-policy-0", "killed"),
    ]
    assert not any(r.alive for r in roles)
