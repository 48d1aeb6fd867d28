"""Faults against a real run (`rlbus up`, real processes, a real server): bad and
impossible events into every topic the roles read, a squatted id, a role reaching for
another's work with its own credentials (refused by the server), a user algorithm that
fails on some groups, SIGSTOPped roles, and kill -9 of every role type and the server.
The run must reach max_steps, dead-letter every injected event, keep its summary and
its log's invariants untouched by them, release the groups that cannot finish with a
reason, say what it waits for, and recover from each kill. `just bench-faults` runs the
same scenarios and writes their table (benchmarks/results/faults.md)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bus.runtime import Bus
from bus.sandbox import unavailable_reason
from bus.server import EmbeddedServer
from schemas import (
    AlgorithmDetached,
    BatchAssembled,
    DeadLettered,
    EvalCompleted,
    MetricsReported,
    RunStopped,
    SamplesScored,
    TraceCompleted,
    WeightsPublished,
)
from tests.e2e.faults import (
    FORGED,
    assert_log_intact,
    attach_ghost,
    inject,
    overreach,
    pause,
    read_seq_events,
    sigkill,
    time_to_next_step,
)
from tests.e2e.helpers import (
    all_events,
    reached_version,
    rlbus,
    rlbus_up,
    running_role,
    summary,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Killed in this order (role, a part of its instance name).
KILLED = [
    ("env", ""),
    ("inference", ""),
    ("algorithm", "grpo"),
    ("orchestrator", ""),
    ("trainer", ""),
]


async def test_bad_events_failing_groups_and_stopped_roles(tmp_path: Path) -> None:
    run, steps, squat_step = "faults1", 24, 12
    flaky = 'orchestrator.algorithms=[{id="grpo",name="tests.e2e.flaky_algorithm:FailsEveryThird"}]'
    proc = rlbus_up(
        tmp_path, run, f"max_steps={steps}", flaky, "bus.heartbeat_interval_s=1",
        "orchestrator.stall_min_s=3", "orchestrator.stall_factor=2",
        "orchestrator.group_timeout_s=4", "orchestrator.stall_stop_s=90",
        "orchestrator.attach_timeout_s=3",
    )  # fmt: skip
    url = await reached_version(proc, tmp_path, run, 2, timeout_s=400)
    assert url is not None, "the run never reached version 2"
    injected = await inject(url, run, squat_step, tmp_path)
    ghost = await attach_ghost(url, tmp_path, run)
    refused = await overreach(url, tmp_path, run)
    # Stopped until the orchestrator reports the stall naming it (the threshold follows the
    # run's own step times, so a fixed pause may end before it), at most 60 s.
    trainer = (await running_role(url, run, "trainer")).pid
    if unavailable_reason() is None:  # roles run sandboxed (bus.sandbox; tests/integration)
        status = await asyncio.to_thread(Path(f"/proc/{trainer}/status").read_text)
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        # no-new-privileges; none of DAC_READ_SEARCH, SYS_PTRACE, SYS_ADMIN, MKNOD
        reach = (1 << 2) | (1 << 19) | (1 << 21) | (1 << 27)
        assert fields["NoNewPrivs"] == "1" and not int(fields["CapEff"], 16) & reach, status
    log = tmp_path / run / "logs" / "orchestrator.log"
    await pause(trainer, 60, until=log, says=('"run.stalled"', "trainer", "no heartbeat"))
    await pause((await running_role(url, run, "algorithm", "grpo")).pid, 8)  # > group_timeout_s
    out, _ = await asyncio.to_thread(proc.communicate, timeout=600)
    assert proc.returncode == 0, out[-4000:]

    with EmbeddedServer(tmp_path / run / "nats") as server:
        events = await all_events(server.url, run)
    # every injected event dead-lettered, by sequence, counted from the log
    dead = {e.stream_seq for e in events if isinstance(e, DeadLettered)}
    assert set(injected) <= dead, f"not dead-lettered: {sorted(set(injected) - dead)}"
    # the tasks the orchestrator never dispatched (a group of 32, an eval at v1e6), though
    # published with its identity, were refused by the env server and never run
    refused_by = {(e.role, e.causation_id) for e in events if isinstance(e, DeadLettered)}
    assert {("env", FORGED + "group32"), ("env", FORGED + "eval-1e6")} <= refused_by
    answers = [e for e in events if isinstance(e, TraceCompleted | EvalCompleted)]
    assert not [e for e in answers if e.request_id.startswith(FORGED)]
    # a second version 1 with other bytes, from the trainer's identity: refused by the fold,
    # and the lake's weights table holds each version once, the trainer's
    assert ("orchestrator", FORGED + "weights-v1") in refused_by
    sql = rlbus(tmp_path, "sql", "--run", run, "-f", "json",
                "SELECT version, count(*) AS n, min(event_id) AS id FROM weights GROUP BY version")  # fmt: skip
    table = {r["version"]: (r["n"], r["id"]) for r in json.loads(sql.stdout)}
    assert sorted(table) == list(range(1, steps + 1)), sql.stdout + sql.stderr
    assert all(n == 1 and not i.startswith(FORGED) for n, i in table.values()), table
    # what a role tried against another's work was refused by the server, every attempt
    # (dead letters in the env server's name, the trainer's weights and durable)
    assert len(refused) == 7, refused
    assert not [e for e in events if isinstance(e, DeadLettered) and e.event_id.startswith(FORGED)]
    (stop,) = [e for e in events if isinstance(e, RunStopped)]
    assert stop.reason == "max_steps"
    real = [e for e in events if not e.event_id.startswith(FORGED)]
    assert [e.version for e in real if isinstance(e, WeightsPublished)] == list(range(1, steps + 1))
    batches = [e.step for e in real if isinstance(e, BatchAssembled)]
    assert batches == list(range(1, steps + 1)), "the squatted batch went missing or doubled"
    s = summary(tmp_path, run)
    assert s["steps"] == steps

    # groups that could not finish were released, with their reason
    failed = [e.failed for e in real if isinstance(e, SamplesScored) and e.failed]
    assert any(f.startswith("ValueError: cannot score task") for f in failed), failed[:5]
    assert any(f.startswith("deadline") for f in failed), "the stopped worker's groups waited"
    released = [e.values["groups_released_total"] for e in real
                if isinstance(e, MetricsReported) and e.role == "orchestrator"]  # fmt: skip
    # (a released group's late answers count once: only groups still in flight are released)
    assert 0 < released[-1] <= len(failed)

    # the attached algorithm whose worker never came was detached, with the reason
    (gone,) = [e for e in events if isinstance(e, AlgorithmDetached) and e.algorithm == "ghost"]
    assert gone.causation_id == ghost.event_id and gone.producer.startswith("orchestrator")
    assert gone.reason.startswith("no worker: no heartbeat from algorithm-ghost within 3 s")

    # the stopped trainer was reported, by name, with what the run waited for
    assert any(isinstance(e, MetricsReported) and e.role == "stall" for e in real)
    log = (tmp_path / run / "logs" / "orchestrator.log").read_text()
    stalls = [line for line in log.splitlines() if '"run.stalled"' in line]
    assert any("trainer" in line and "no heartbeat" in line for line in stalls), stalls[:3]
    # the env identity's squat of the batch's event id and its salts touched nothing: the
    # orchestrator's header ids are keyed by its own identity
    assert '"publish.squatted"' not in log

    # a replay of the orchestrator makes the same decisions and refuses the same events
    r = rlbus(tmp_path, "replay", run, "orchestrator")
    assert r.returncode == 0 and "MATCH orchestrator" in r.stdout, r.stdout + r.stderr


async def test_every_role_type_and_the_server_killed_in_turn(tmp_path: Path) -> None:
    """kill -9 of the env server, inference, the algorithm worker, the orchestrator, the
    trainer and the nats-server, one after another, after bad events were injected (so
    restarted roles meet them): each time the run trains its next step, and the log holds
    every step's batch and weights once, no trace lost or twice, no sample trained twice,
    and final weights equal to a fresh replay of the recorded batches."""
    run, steps = "kills1", 40
    proc = rlbus_up(tmp_path, run, f"max_steps={steps}", "trainer.checkpoint_interval=4")
    url = await reached_version(proc, tmp_path, run, 2, timeout_s=400)
    assert url is not None, "the run never reached version 2"
    await inject(url, run, steps - 5, tmp_path)
    store = tmp_path / run / "nats"
    bus = await Bus.connect(url, run=run, producer="e2e")
    try:
        for role, instance in KILLED:
            pid = (await running_role(url, run, role, instance)).pid
            await time_to_next_step(bus, sigkill(pid))
        server = json.loads((store / "server.json").read_text())["pid"]
        await time_to_next_step(bus, sigkill(server))
    finally:
        await bus.close()
    out, _ = await asyncio.to_thread(proc.communicate, timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert f"[rlbus] nats-server is back on {url}" in out
    s = summary(tmp_path, run)
    assert s["steps"] == steps
    # each killed role restarted once; the server's death restarted none (they reconnect)
    assert sorted(s["restarts"].values()) == [1] * len(KILLED), s["restarts"]
    assert all(any(p.startswith(r) for p in s["restarts"]) for r, _ in KILLED), s["restarts"]

    with EmbeddedServer(store) as server_:
        seq_events = await read_seq_events(server_.url, run)
    assert_log_intact(seq_events, steps, tmp_path / run)
    # the restarted orchestrator re-made its decisions: a replay makes them once more
    r = rlbus(tmp_path, "replay", run, "orchestrator")
    assert r.returncode == 0 and "MATCH orchestrator" in r.stdout, r.stdout + r.stderr
