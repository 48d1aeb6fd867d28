"""Faults against a real run (`rlbus up`, real processes, a real server): bad and
impossible events into every topic the roles read, a squatted id, a user algorithm that
fails on some groups, a SIGSTOPped trainer and algorithm worker. The run must reach
max_steps, dead-letter every injected event, keep its summary untouched by them,
release the groups that cannot finish with a reason, and say what it waits for."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest

from bus import codec
from bus.server import EmbeddedServer
from bus.subjects import Topic, subject
from schemas import (
    AlgorithmAttached,
    BatchAssembled,
    DeadLettered,
    EvalCompleted,
    MetricsReported,
    RunStarted,
    RunStopped,
    SamplesScored,
    TaskRef,
    TaskRequested,
    WeightsPublished,
    derive_id,
)
from schemas.arrays import pack_f32
from tests.e2e.helpers import all_events, reached_version, rlbus_up, running_role, summary
from tests.samples import sample

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENV = "reverse-text"
FORGED = "forged-"  # every injected event's id starts with it


def _with(event: Any, **changes: Any) -> bytes:
    """``event`` encoded with raw field values no schema allows."""
    return codec.encode_any({**msgspec.msgpack.decode(codec.encode(event)), **changes})


def injections(run: str) -> list[tuple[str, bytes]]:
    """(subject, payload) of every bad event: garbage on each topic a role reads, and a
    schema-valid but impossible event of each class in the fault list."""

    def s(topic: Topic, key: str | None = None) -> str:
        return subject(run, topic, key)

    task = TaskRequested(
        run=run, event_id=FORGED + "task", env=ENV, task=TaskRef(index=0), group_id="forged-g",
        group_size=4, phase="rl",
    )  # fmt: skip
    nan = msgspec.structs.replace(
        sample("nan"), advantages=pack_f32([float("nan")] * 17), group_id="g-nan"
    )
    scores = SamplesScored(
        run=run, event_id=FORGED + "nan", algorithm="grpo", env=ENV, group_id="g-nan",
        request_id="r", task_index=0, step=0, samples=[nan], rewards=[0.5],
    )  # fmt: skip
    weights = WeightsPublished(
        run=run, event_id=FORGED + "weights", version=10**9, step=10**9,
        weights={"kind": "object", "location": "weights.v1000000000"},  # type: ignore[arg-type]
    )  # fmt: skip
    batch = BatchAssembled(
        run=run, event_id=FORGED + "batch", step=10**6, samples=[], policy_version=0
    )
    report = MetricsReported(
        run=run, event_id=FORGED + "eval", role="eval", step=10**6, values={"x/avg@1": 1.0}
    )
    evaluated = EvalCompleted(
        run=run, event_id=FORGED + "eval-nan", request_id="r", env=ENV, step=0, task_index=0,
        rewards=[1.0],
    )  # fmt: skip
    started = RunStarted(
        run=run, event_id=FORGED + "started", config={}, seed=1, model_path="/nowhere"
    )
    attached = AlgorithmAttached(run=run, event_id=FORGED + "attach", algorithm="x", name="")
    garbage = os.urandom(64)
    return [
        # undecodable, on every topic a role reads
        *(
            (s(t, k), garbage)
            for t, k in [
                (Topic.RUN_STARTED, None),
                (Topic.TASK_REQUESTED, ENV),
                (Topic.TRACE_COMPLETED, ENV),
                (Topic.EVAL_COMPLETED, ENV),
                (Topic.SAMPLES_SCORED, "grpo"),
                (Topic.BATCH_ASSEMBLED, None),
                (Topic.WEIGHTS_PUBLISHED, None),
                (Topic.ALGORITHM_ATTACHED, "x"),
                (Topic.METRICS_REPORTED, "eval"),
            ]
        ),  # fmt: skip
        # values outside the schemas' bounds
        (s(Topic.TASK_REQUESTED, "nope"), _with(task, group_size=-3)),
        (s(Topic.TASK_REQUESTED, "nope"), _with(task, group_size=0)),
        (s(Topic.TASK_REQUESTED, "nope"), _with(task, phase="bogus")),
        (s(Topic.EVAL_COMPLETED, ENV), _with(evaluated, rewards=[float("nan")])),
        # schema-valid, impossible for the fold that reads them
        (s(Topic.TASK_REQUESTED, "nope"), codec.encode(task)),
        (s(Topic.SAMPLES_SCORED, "grpo"), codec.encode(scores)),
        (s(Topic.WEIGHTS_PUBLISHED), codec.encode(weights)),
        (s(Topic.BATCH_ASSEMBLED), codec.encode(batch)),
        (s(Topic.METRICS_REPORTED, "eval"), codec.encode(report)),
        (s(Topic.RUN_STARTED), codec.encode(started)),
        (s(Topic.ALGORITHM_ATTACHED, "x"), codec.encode(attached)),
    ]


async def inject(url: str, run: str, squat_step: int) -> list[int]:
    """Publish every injection raw (nats-py, as any local client could); their sequences.
    Also squats the id of a batch not assembled yet with a harmless metrics event."""
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        seqs = []
        for i, (subj, payload) in enumerate(injections(run)):
            ack = await js.publish(subj, payload, headers={"Nats-Msg-Id": f"{FORGED}{i}"})
            seqs.append(ack.seq)
        squatter = MetricsReported(
            run=run, event_id=FORGED + "squat", role="probe", step=0, values={}
        )
        await js.publish(
            subject(run, Topic.METRICS_REPORTED, "probe"), codec.encode(squatter),
            headers={"Nats-Msg-Id": derive_id(run, "batch", squat_step)},
        )  # fmt: skip
        return seqs
    finally:
        await nc.close()


async def pause(pid: int, seconds: float) -> None:
    os.kill(pid, signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


async def test_bad_events_failing_groups_and_stopped_roles(tmp_path: Path) -> None:
    run, steps, squat_step = "faults1", 24, 12
    flaky = 'orchestrator.algorithms=[{id="grpo",name="tests.e2e.flaky_algorithm:FailsEveryThird"}]'
    proc = rlbus_up(
        tmp_path, run, f"max_steps={steps}", flaky, "bus.heartbeat_interval_s=1",
        "orchestrator.stall_min_s=3", "orchestrator.stall_factor=2",
        "orchestrator.group_timeout_s=4", "orchestrator.stall_stop_s=90",
    )  # fmt: skip
    url = await reached_version(proc, tmp_path, run, 2, timeout_s=400)
    assert url is not None, "the run never reached version 2"
    injected = await inject(url, run, squat_step)
    await pause((await running_role(url, run, "trainer")).pid, 8)  # > stall_min_s + 3 beats
    await pause((await running_role(url, run, "algorithm", "grpo")).pid, 8)  # > group_timeout_s
    out, _ = await asyncio.to_thread(proc.communicate, timeout=600)
    assert proc.returncode == 0, out[-4000:]

    with EmbeddedServer(tmp_path / run / "nats") as server:
        events = await all_events(server.url, run)
    # every injected event dead-lettered, by sequence, counted from the log
    dead = {e.stream_seq for e in events if isinstance(e, DeadLettered)}
    assert set(injected) <= dead, f"not dead-lettered: {sorted(set(injected) - dead)}"
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

    # the stopped trainer was reported, by name, with what the run waited for
    assert any(isinstance(e, MetricsReported) and e.role == "stall" for e in real)
    log = (tmp_path / run / "logs" / "orchestrator.log").read_text()
    stalls = [line for line in log.splitlines() if '"run.stalled"' in line]
    assert any("trainer" in line and "no heartbeat" in line for line in stalls), stalls[:3]
