"""The algorithm worker against a real nats-server: one event per group, late attach, restart."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

import msgspec
import nats.errors
import nats.js.errors
import numpy as np
import pytest

from bus.reader import read_log
from bus.runtime import Bus, BusSettings
from bus.server import EmbeddedServer
from bus.subjects import Topic, durable_name
from roles.algorithm import create
from roles.algorithm.core import ScoringCore
from roles.algorithm.role import AlgorithmWorker
from roles.runtime.role import serve_role
from schemas import (
    Branch,
    Message,
    MetricsReported,
    SamplesScored,
    TaskRef,
    Trace,
    TraceCompleted,
    TraceError,
    derive_id,
)
from schemas.arrays import f32, pack_f32, pack_i32, pack_mask

pytestmark = pytest.mark.nats

SETTINGS = BusSettings(ack_wait_s=2.0, nak_delay_s=0.1, max_deliver=3)


def completed(run: str, group: str, index: int, reward: float, errored: bool = False,
              group_size: int = 4) -> TraceCompleted:  # fmt: skip
    prompt = Message(
        id=0,
        role="user",
        content="q",
        token_ids=pack_i32([1, 2]),
        sampled=pack_mask([0, 0]),
        logprobs=pack_f32([0, 0]),
    )
    answer = Message(
        id=1,
        role="assistant",
        content="a",
        parent=0,
        token_ids=pack_i32([3, 4, 5]),
        sampled=pack_mask([1, 1, 1]),
        logprobs=pack_f32([-0.1, -0.2, -0.3]),
    )
    trace = Trace(
        rollout_id=f"{group}-r{index}",
        env="e",
        task=TaskRef(index=int(group[-1])),
        group_id=group,
        sample_index=index,
        messages=[prompt, answer],
        branches=[Branch(messages=[0, 1])],
        reward=reward,
        errors=[TraceError(kind="env_exception", message="boom")] if errored else [],
    )
    return TraceCompleted(run=run, env="e", request_id=f"req-{group}", group_size=group_size, step=1,
                          trace=trace, event_id=derive_id("trace", group, index), causation_id=f"req-{group}")  # fmt: skip


async def start_worker(
    server: EmbeddedServer, run: str, name: str, instance: str
) -> tuple[AlgorithmWorker, asyncio.Task[None]]:
    bus = await Bus.connect(server.url, run=run, producer=instance, settings=SETTINGS)
    role = AlgorithmWorker(bus, instance, ScoringCore(name, create(name)))
    return role, asyncio.create_task(serve_role(role, install_signals=False))


async def stop_worker(role: AlgorithmWorker, task: asyncio.Task[None]) -> None:
    role.request_stop()
    await asyncio.wait_for(task, 30)


async def read_all(bus: Bus, topic: Topic, key: str, cls: type) -> list:
    """Every event stored on one subject, read with an ordered consumer."""
    return [e async for e in read_log(bus, [(topic, key)], (cls,))]


async def wait_until(
    check: Callable[[], Awaitable[bool]], task: asyncio.Task[None], timeout: float = 30.0
) -> None:
    """Poll ``check`` until it holds, failing early if the worker task died."""
    async with asyncio.timeout(timeout):
        while not await check():
            if task.done():
                task.result()  # surface the worker's crash
                raise AssertionError("worker stopped")
            await asyncio.sleep(0.1)


async def idle(bus: Bus, name: str, delivered: int) -> bool:
    """The worker's durable consumer has acked everything up to ``delivered`` traces."""
    try:
        info = await bus.js.consumer_info(bus.stream, durable_name("algorithm", name))
    except nats.js.errors.NotFoundError:
        return False
    return (
        info.num_pending == 0
        and info.num_ack_pending == 0
        and info.delivered.consumer_seq >= delivered
    )


def by_group(events: Sequence[SamplesScored]) -> dict[str, SamplesScored]:
    assert len({e.group_id for e in events}) == len(events), "a group was scored twice"
    return {e.group_id: e for e in events}


def advantages(scored: SamplesScored) -> dict[str, float]:
    """Advantage per rollout (on its first trained token)."""
    return {s.rollout_id: float(f32(s.advantages)[-1]) for s in scored.samples}


async def test_scores_each_group_once_and_late_worker_catches_up(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """One SamplesScored per group with errored traces excluded; a later rloo worker scores the same groups."""
    run = bus.run
    a = [completed(run, "g1", i, r) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])]
    b = [completed(run, "g2", i, r, errored=(i == 3)) for i, r in enumerate([1.0, 0.0, 0.5, 0.0])]
    arrival = [a[0], b[2], a[3], b[0], a[1], b[3], b[1], a[2]]  # interleaved; g1 completes last
    await bus.publish_many(arrival[:4])  # half before the worker starts, half while it runs
    role, task = await start_worker(nats_server, run, "grpo", "grpo-0")
    await bus.publish_many(arrival[4:])

    async def both_scored() -> bool:
        return len(
            await read_all(bus, Topic.SAMPLES_SCORED, "grpo", SamplesScored)
        ) >= 2 and await idle(bus, "grpo", 8)

    await wait_until(both_scored, task)
    await stop_worker(role, task)

    grpo = by_group(await read_all(bus, Topic.SAMPLES_SCORED, "grpo", SamplesScored))
    assert set(grpo) == {"g1", "g2"}
    g1, g2 = grpo["g1"], grpo["g2"]
    assert advantages(g1) == {"g1-r0": 0.5, "g1-r1": -0.5, "g1-r2": -0.5, "g1-r3": 0.5}
    assert (g1.excluded, g1.rewards, g1.zero_advantage) == (0, [1.0, 0.0, 0.0, 1.0], False)
    assert advantages(g2) == {"g2-r0": 0.5, "g2-r1": -0.5, "g2-r2": 0.0}  # mean of 1, 0, 0.5
    assert (g2.excluded, g2.rewards) == (1, [1.0, 0.0, 0.5])
    assert (g2.algorithm, g2.request_id, g2.causation_id, g2.task_index, g2.step) == (
        "grpo",
        "req-g2",
        "req-g2",
        2,
        1,
    )
    assert g2.event_id == derive_id("scored", "grpo", "g2")
    metrics = await read_all(bus, Topic.METRICS_REPORTED, "algorithm-grpo", MetricsReported)
    assert metrics and metrics[-1].values["groups_scored"] == 2.0

    late, late_task = await start_worker(nats_server, run, "rloo", "rloo-0")
    try:
        await wait_until(lambda: idle(bus, "rloo", 8), late_task)
    finally:
        await stop_worker(late, late_task)
    rloo = by_group(await read_all(bus, Topic.SAMPLES_SCORED, "rloo", SamplesScored))
    assert set(rloo) == {"g1", "g2"}
    third = float(np.float32(2 / 3))  # advantages travel as float32
    assert advantages(rloo["g1"]) == {
        "g1-r0": third,
        "g1-r1": -third,
        "g1-r2": -third,
        "g1-r3": third,
    }
    assert advantages(rloo["g2"]) == {"g2-r0": 0.75, "g2-r1": -0.75, "g2-r2": 0.0}
    assert len(await read_all(bus, Topic.SAMPLES_SCORED, "grpo", SamplesScored)) == 2  # untouched


async def test_restart_rebuilds_pending_group_from_the_log(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """Two traces acked by a stopped worker still count: the new instance rebuilds the buffer from the log."""
    run = bus.run
    traces = [completed(run, "g3", i, r) for i, r in enumerate([1.0, 0.0, 0.0, 0.0])]
    await bus.publish_many(traces[:2])
    first, first_task = await start_worker(nats_server, run, "grpo", "grpo-a")
    await wait_until(lambda: idle(bus, "grpo", 2), first_task)
    await stop_worker(first, first_task)  # both traces acked; nothing scored yet
    assert await read_all(bus, Topic.SAMPLES_SCORED, "grpo", SamplesScored) == []

    second, second_task = await start_worker(nats_server, run, "grpo", "grpo-b")
    try:
        # A redelivered copy of trace 1 (new event id, same rollout) must not complete the group.
        duplicate = msgspec.structs.replace(traces[1], event_id=derive_id("dup", 1))
        await bus.publish_many([duplicate, traces[2]])
        await wait_until(lambda: idle(bus, "grpo", 4), second_task)
        assert await read_all(bus, Topic.SAMPLES_SCORED, "grpo", SamplesScored) == []
        await bus.publish(traces[3])

        async def scored() -> bool:
            return bool(await read_all(bus, Topic.SAMPLES_SCORED, "grpo", SamplesScored))

        await wait_until(scored, second_task)
    finally:
        await stop_worker(second, second_task)
    (event,) = await read_all(bus, Topic.SAMPLES_SCORED, "grpo", SamplesScored)
    assert advantages(event) == {"g3-r0": 0.75, "g3-r1": -0.25, "g3-r2": -0.25, "g3-r3": -0.25}


class SlowReference:
    """A reference model's scorer (``RefScorer``'s one call) that answers after a pause
    and counts how many groups wait on it at once."""

    def __init__(self, pause_s: float) -> None:
        self.pause_s, self.waiting, self.most = pause_s, 0, 0

    async def refs(self, algorithm: object, name: str, traces: list[Trace]) -> dict:
        self.waiting += 1
        self.most = max(self.most, self.waiting)
        try:
            await asyncio.sleep(self.pause_s)
        finally:
            self.waiting -= 1
        # One logprob per branch token, from the rollout's index alone.
        return {
            (t.rollout_id, 0): np.full(5, -0.1 * (1 + t.sample_index), np.float32) for t in traces
        }


@pytest.mark.parametrize("configured", [1, 3])
async def test_opd_scores_up_to_max_concurrent_groups_at_once(
    nats_server: EmbeddedServer, configured: int
) -> None:
    """``orchestrator.algorithms[].max_concurrent``: an opd worker waits on the reference
    for that many groups at once (1: one at a time), and every group's samples carry the
    reference's logprobs whatever the order they finished in."""
    from configs import load_config
    from roles.algorithm.role import max_concurrent

    cfg = load_config(
        "smoke", [f'orchestrator.algorithms=[{{id="opd", max_concurrent={configured}}}]']
    )
    run = f"opd-concurrent-{configured}"
    bus = await Bus.connect(nats_server.url, run=run, producer="t", settings=SETTINGS)
    reference = SlowReference(pause_s=0.4)
    worker = AlgorithmWorker(
        bus, "w", ScoringCore("opd", create("opd")), scorer=reference,  # type: ignore[arg-type]
        max_concurrent=max_concurrent(cfg, "opd"),
    )  # fmt: skip
    task = asyncio.create_task(serve_role(worker, install_signals=False))
    try:
        groups = [f"g{i}" for i in range(6)]
        await bus.publish_many(
            [completed(run, g, i, 1.0, group_size=2) for g in groups for i in range(2)]
        )

        async def all_scored() -> bool:
            return len(await read_all(bus, Topic.SAMPLES_SCORED, "opd", SamplesScored)) == len(
                groups
            )

        await wait_until(all_scored, task)
        scored = by_group(await read_all(bus, Topic.SAMPLES_SCORED, "opd", SamplesScored))
        assert reference.most == configured
        for g in groups:
            refs = {s.rollout_id: f32(s.ref_logprobs)[-1] for s in scored[g].samples}
            assert refs == pytest.approx({f"{g}-r0": -0.1, f"{g}-r1": -0.2})
    finally:
        await stop_worker(worker, task)
        await bus.close()
