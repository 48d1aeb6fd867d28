"""Fault injection against a live run, shared by the fault suite (tests/e2e/test_faults.py)
and its benchmark (benchmarks/fault_bench.py): what is injected, how a role is paused
or killed, and the log's invariants afterwards."""

from __future__ import annotations

import asyncio
import base64
import os
import signal
import time
from pathlib import Path
from typing import Any

import msgspec
import nats

from bus import codec
from bus.auth import CREDS_ENV, RunAuth, connect_options
from bus.runtime import Bus
from bus.subjects import Topic, objects_bucket, subject
from roles.lib.envs.registry import env_key
from schemas import (
    AlgorithmAttached,
    BatchAssembled,
    DeadLettered,
    EvalCompleted,
    MetricsReported,
    RunStarted,
    SamplesScored,
    TaskRef,
    TaskRequested,
    WeightsPublished,
    batch_id,
    derive_id,
)
from schemas.arrays import pack_f32
from schemas.run import ObjectRef
from tests.samples import sample

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
    absurd = SamplesScored(
        run=run, event_id=FORGED + "absurd", algorithm="grpo", env=ENV, group_id="g-absurd",
        request_id="r", task_index=0, step=0, rewards=[0.5], samples=[msgspec.structs.replace(
            sample("absurd"), advantages=pack_f32([1e38] * 17), group_id="g-absurd")],
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
        (s(Topic.SAMPLES_SCORED, "grpo"), codec.encode(absurd)),  # finite, beyond bounds
        (s(Topic.WEIGHTS_PUBLISHED), codec.encode(weights)),
        (s(Topic.BATCH_ASSEMBLED), codec.encode(batch)),
        (s(Topic.METRICS_REPORTED, "eval"), codec.encode(report)),
        (s(Topic.RUN_STARTED), codec.encode(started)),
        (s(Topic.ALGORITHM_ATTACHED, "x"), codec.encode(attached)),
    ]


def as_producers(run: str) -> list[tuple[str, str, bytes]]:
    """(kind, subject, payload) of schema-valid events that the kind publishing them may
    publish, but that its role never made, as a buggy instance of it would: a task group
    of 32 and an eval "at v1e6" on the env server's own subject (the orchestrator's
    identity), and a second announcement of version 1 with other bytes (the trainer's)."""
    group = TaskRequested(
        run=run, event_id=FORGED + "group32", env=ENV, task=TaskRef(index=0), group_id="forged-32",
        group_size=32, phase="rl", number=0,
    )  # fmt: skip
    evaluation = TaskRequested(
        run=run, event_id=FORGED + "eval-1e6", env=ENV, task=TaskRef(index=0, split="eval"),
        group_id="forged-e", group_size=1, phase="eval", policy_version=10**6,
    )  # fmt: skip
    weights = WeightsPublished(
        run=run, event_id=FORGED + "weights-v1", version=1, step=1, batch_id=batch_id(run, 1),
        weights=ObjectRef(kind="object", location="weights.v1", digest="0" * 64,
                          bucket=objects_bucket(run, "trainer")),
    )  # fmt: skip
    tasks = subject(run, Topic.TASK_REQUESTED, env_key(ENV))
    return [
        ("orchestrator", tasks, codec.encode(group)),
        ("orchestrator", tasks, codec.encode(evaluation)),
        ("trainer", subject(run, Topic.WEIGHTS_PUBLISHED), codec.encode(weights)),
    ]


async def inject(url: str, run: str, squat_step: int, data_dir: Path) -> list[int]:
    """Publish every injection raw (nats-py, as any client with the run's credentials
    could); their sequences.

    Also squats the id of a batch not assembled yet, as a buggy env server would: four
    harmless metrics events, published with the env identity's own credentials, under
    the batch's event id and the three salted ids a squatted publish falls back to. The
    orchestrator's header ids are keyed by its identity, so none of them collides."""
    nc = await nats.connect(url, **connect_options())  # the run's identity (helpers.as_launcher)
    try:
        js = nc.jetstream()
        seqs = []
        for i, (subj, payload) in enumerate(injections(run)):
            ack = await js.publish(subj, payload, headers={"Nats-Msg-Id": f"{FORGED}{i}"})
            seqs.append(ack.seq)
    finally:
        await nc.close()
    auth = RunAuth.ensure(data_dir / run / "auth", run)
    for kind, subj, payload in as_producers(run):
        c = auth.creds(kind)
        nc = await nats.connect(url, user=c.user, password=c.password, inbox_prefix=c.inbox_prefix)
        try:
            seqs.append((await nc.jetstream().publish(subj, payload)).seq)
        finally:
            await nc.close()
    env = auth.creds("env")
    nc = await nats.connect(
        url, user=env.user, password=env.password, inbox_prefix=env.inbox_prefix
    )
    try:
        js = nc.jetstream()
        plain = derive_id(run, "batch", squat_step)
        for k, msg_id in enumerate([plain] + [derive_id(plain, "squatted", k) for k in (1, 2, 3)]):
            squatter = MetricsReported(
                run=run, event_id=f"{FORGED}squat{k}", role="env", step=0, values={}
            )
            await js.publish(
                subject(run, Topic.METRICS_REPORTED, "env"), codec.encode(squatter),
                headers={"Nats-Msg-Id": msg_id},
            )  # fmt: skip
        return seqs
    finally:
        await nc.close()


async def pause(
    pid: int, seconds: float, until: Path | None = None, says: tuple[str, ...] = ()
) -> float:
    """SIGSTOP ``pid`` for ``seconds``, or, with ``until``, until a line of that log holds
    every one of ``says`` (at most ``seconds``): how long it stood still."""
    os.kill(pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        while (held := time.monotonic() - start) < seconds:
            if until is not None and await asyncio.to_thread(_logged, until, says):
                return held
            await asyncio.sleep(0.2)
        return held
    finally:
        os.kill(pid, signal.SIGCONT)


def _logged(log: Path, says: tuple[str, ...]) -> bool:
    text = log.read_text() if log.exists() else ""
    return any(all(s in line for s in says) for line in text.splitlines())


async def newest_version(bus: Any) -> int:
    """The newest weights version on the log (0 before the first; -1 while unreadable:
    the server is away, or the newest message there is an injected one). Asked with a
    short timeout: a probe the killed server took is asked again, not waited on for
    nats-py's 5 s (which the recovery times would count)."""
    try:
        msg = await asyncio.wait_for(
            bus.js.get_last_msg(bus.stream, subject(bus.run, Topic.WEIGHTS_PUBLISHED)), 0.5
        )
        event = codec.decode(msg.data, [WeightsPublished])
        return -1 if event.event_id.startswith(FORGED) else int(event.version)
    except Exception:  # noqa: BLE001 - a probe: unreadable now, asked again
        return -1


async def time_to_next_step(bus: Any, kill: Any, steps: int = 1, timeout_s: float = 120.0) -> float:
    """Run ``kill()`` and time until the run has published ``steps`` weights versions
    past the newest before it (1: the next step after the fault; a step whose batch was
    nearly ready may come at once, so 3 shows the recovery too); raises if they do not
    come in time."""
    before = await newest_version(bus)
    while before < 0:
        await asyncio.sleep(0.1)
        before = await newest_version(bus)
    await kill()
    start = asyncio.get_running_loop().time()
    while (elapsed := asyncio.get_running_loop().time() - start) < timeout_s:
        if await newest_version(bus) >= before + steps:
            return elapsed
        await asyncio.sleep(0.1)
    raise TimeoutError(f"no v{before + steps} after v{before} within {timeout_s:g} s")


def sigkill(pid: int) -> Any:
    async def kill() -> None:
        os.kill(pid, signal.SIGKILL)

    return kill


def invariants(seq_events: list[tuple[int, Any]], steps: int) -> dict[str, int]:
    """What a run's log must show after faults: every step's batch and weights once (the
    orchestrator's and the trainer's; injected ones apart), every train request of the
    run's first steps with all its traces, no trace twice, no sample in two batches."""
    real = [(q, e) for q, e in seq_events if not e.event_id.startswith(FORGED)]
    batches = [e for _, e in real if isinstance(e, BatchAssembled)]
    weights = [e.version for _, e in real if isinstance(e, WeightsPublished)]
    traces: dict[str, set[int]] = {}
    trace_ids = []
    for _, e in real:
        if type(e).__name__ == "TraceCompleted":
            traces.setdefault(e.request_id, set()).add(e.trace.sample_index)
            trace_ids.append(e.event_id)
    # Requests dispatched before the last few batches had time to finish before the stop.
    cutoff = next((q for q, e in real if isinstance(e, BatchAssembled) and e.step == steps - 3), 0)
    requests = [
        e for q, e in real
        if isinstance(e, TaskRequested) and e.phase in ("rl", "sft") and q < cutoff
    ]  # fmt: skip
    used = [(s.rollout_id, s.branch) for b in batches for s in b.samples]
    return {
        "steps": max(weights, default=0),
        "batches_missing_or_twice": int(
            sorted(b.step for b in batches) != list(range(1, steps + 1))
        ),
        "weights_missing_or_twice": int(sorted(weights) != list(range(1, steps + 1))),
        "requests_checked": len(requests),
        "traces_lost": sum(e.group_size - len(traces.get(e.event_id, ())) for e in requests),
        "traces_twice": len(trace_ids) - len(set(trace_ids)),
        "samples_trained_twice": len(used) - len(set(used)),
    }


async def read_seq_events(url: str, run: str) -> list[tuple[int, Any]]:
    """Every event of the run's log with its stream sequence."""
    from bus.reader import read_log
    from bus.runtime import Bus
    from schemas import EVENT_TYPES

    bus = await Bus.connect(url, run=run, producer="e2e")
    try:
        return [
            x async for x in read_log(bus, [(t, None) for t in Topic], EVENT_TYPES, with_seq=True)
        ]
    finally:
        await bus.close()


def assert_log_intact(seq_events: list[tuple[int, Any]], steps: int, run_dir: Any) -> None:
    """The log after faults: ``invariants`` all zero, and the final weights equal to a
    fresh, uninterrupted trainer replay of the recorded batches."""
    from configs import load_config
    from roles.trainer.core import TrainerCore

    found = invariants(seq_events, steps)
    assert found["requests_checked"] > 0
    assert {k: v for k, v in found.items() if k not in ("steps", "requests_checked")} == {
        "batches_missing_or_twice": 0, "weights_missing_or_twice": 0, "traces_lost": 0,
        "traces_twice": 0, "samples_trained_twice": 0,
    }  # fmt: skip
    events = [e for _, e in seq_events if not e.event_id.startswith(FORGED)]
    cfg = load_config(str(run_dir / "config.toml"))
    started = next(e for e in events if isinstance(e, RunStarted))
    core = TrainerCore(cfg, started.model_path)  # the same fold, uninterrupted
    for b in sorted((e for e in events if isinstance(e, BatchAssembled)), key=lambda b: b.step):
        core.train_step(b)
    final = [e for e in events if isinstance(e, WeightsPublished)][-1]
    assert core.weights_digest() == final.weights.digest


async def attach_ghost(url: str, data_dir: Path, run: str) -> AlgorithmAttached:
    """Attach a training algorithm whose worker never starts (a typo in a launch script
    does it), published with the attach identity's own credentials, as
    ``rlbus algorithm attach`` publishes it."""
    event = AlgorithmAttached(run=run, event_id=FORGED + "ghost", algorithm="ghost", name="grpo")
    saved = os.environ.get(CREDS_ENV)
    os.environ[CREDS_ENV] = str(data_dir / run / "auth" / "attach.creds")
    try:
        bus = await Bus.connect(url, run=run, producer="e2e-attach")
        try:
            await bus.publish(event)
        finally:
            await bus.close()
    finally:
        if saved is None:
            os.environ.pop(CREDS_ENV, None)
        else:
            os.environ[CREDS_ENV] = saved
    return event


async def overreach(url: str, data_dir: Path, run: str) -> list[str]:
    """What a buggy role could do to another's work, each with its own identity's
    credentials: the algorithm worker dead-letters three tasks in the env server's name
    (once enough to stop a run "because of the env server"); the env server overwrites
    the trainer's initial weights object and purges the trainer's object store, and pulls
    from and deletes the trainer's durable consumer. The server's answer to each: the
    permission violations it reported (one per attempt expected)."""
    auth = RunAuth.ensure(data_dir / run / "auth", run)
    said: list[str] = []

    async def on_error(e: Exception) -> None:
        said.append(str(e).lower())

    async def connect(kind: str) -> Any:
        c = auth.creds(kind)
        return await nats.connect(url, user=c.user, password=c.password,
                                  inbox_prefix=c.inbox_prefix, error_cb=on_error)  # fmt: skip

    algorithm, env = await connect("algorithm"), await connect("env")
    try:
        for k in range(3):
            dead = DeadLettered(
                run=run, event_id=f"{FORGED}dead{k}", role="env", consumer="env-reverse-text",
                subject=subject(run, Topic.TASK_REQUESTED, ENV), stream_seq=1, deliveries=1,
                error_type="ZeroDivisionError", error="forged", payload=b"",
            )  # fmt: skip
            await algorithm.publish(subject(run, Topic.DEAD_LETTERED, "env"), codec.encode(dead),
                                    headers={"Nats-Msg-Id": dead.event_id})  # fmt: skip
        trainer_objects = objects_bucket(run, "trainer")
        weights_meta = base64.urlsafe_b64encode(b"weights.v0").decode().rstrip("=")
        stream = f"RL_{run}"
        for subj in (f"$O.{trainer_objects}.M.{weights_meta}",
                     f"$JS.API.STREAM.PURGE.OBJ_{trainer_objects}",
                     f"$JS.API.CONSUMER.MSG.NEXT.{stream}.trainer",
                     f"$JS.API.CONSUMER.DELETE.{stream}.trainer"):  # fmt: skip
            await env.publish(subj, b"{}")
        await algorithm.flush()
        await env.flush()
        await asyncio.sleep(0.3)  # the server's -ERRs arrive after the flush's PONG
    finally:
        await algorithm.close()
        await env.close()
    return [s for s in said if "permissions violation" in s]
