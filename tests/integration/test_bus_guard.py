"""The bus's guards against others' mistakes, against a real nats-server: an event id
squatted by another message, and work held by a consumer that died."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
import pytest
from structlog.testing import capture_logs

from bus import codec
from bus.consumer import Consumer, Delivery, Subscription
from bus.runtime import Bus, BusSettings
from bus.server import EmbeddedServer
from bus.subjects import Topic, subject
from schemas import BatchAssembled, MetricsReported, RunStopped, derive_id

pytestmark = pytest.mark.nats

FAST = BusSettings(ack_wait_s=1.0, nak_delay_s=0.1, max_deliver=5)


def batch(run: str, step: int, **kw: Any) -> BatchAssembled:
    """The trainer's input: its id is predictable from the run and the step."""
    return BatchAssembled(
        run=run, event_id=derive_id(run, "batch", step), step=step, samples=[],
        policy_version=0, **kw,
    )  # fmt: skip


async def stored_on(bus: Bus, subj: str) -> int:
    info = await bus.js.stream_info(bus.stream, subjects_filter=subj)
    return int((info.state.subjects or {}).get(subj, 0))


async def squat(bus: Bus, event_id: str, how: str) -> None:
    """Store a message under header id ``event_id`` before the real event is published."""
    if how == "other_type":  # a harmless event of another type, subject and schema
        await bus.publish(
            MetricsReported(run=bus.run, role="x", step=0, values={}, event_id=event_id)
        )
    else:  # the real event's subject and schema, another payload event id
        fake = batch(bus.run, 99)
        subj, payload, headers = await bus.prepare(fake)
        await bus.js.publish(
            subject(bus.run, Topic.BATCH_ASSEMBLED),
            payload,
            headers={**headers, codec.H_MSG_ID: event_id},
        )


@pytest.mark.parametrize("how", ["other_type", "same_subject"])
@pytest.mark.parametrize("offloaded", [False, True], ids=["inline", "offloaded"])
async def test_a_squatted_event_id_is_stepped_around(bus: Bus, how: str, offloaded: bool) -> None:
    """A message already holding an event's (predictable) id does not make the event
    vanish: it is stored once under a salted header id, a republish stores nothing new,
    and an ordinary duplicate of it stays a plain duplicate."""
    if offloaded:  # the stream holds a BodyRef: the identity check reads the ref
        bus = Bus(bus.nc, bus.run, "test", BusSettings(offload_threshold_bytes=16))
    real = batch(bus.run, 1, producer="test")
    subj = subject(bus.run, Topic.BATCH_ASSEMBLED)
    await squat(bus, real.event_id, how)
    before = await stored_on(bus, subj)

    with capture_logs() as logs:
        ack = await bus.publish(real)
    assert not ack.duplicate
    squatted = [e for e in logs if e["event"] == "publish.squatted"]
    assert len(squatted) == 1 and squatted[0]["log_level"] == "error"
    assert squatted[0]["id"] == real.event_id and squatted[0]["subject"] == subj

    assert await stored_on(bus, subj) == before + 1
    msg = await bus.js.get_msg(bus.stream, ack.seq)
    assert await bus.decode_msg(msg, [BatchAssembled]) == real  # the payload's id unchanged
    assert (msg.headers or {})[codec.H_MSG_ID] == derive_id(real.event_id, "squatted", 1)

    # A restarted publisher (or a replay) lands on the same salted copy.
    again = await bus.publish(real)
    assert again.seq == ack.seq
    # A rerun under the same id with other content is an ordinary duplicate: first copy wins.
    rerun = await bus.publish(msgspec.structs.replace(real, num_tokens=7))
    assert rerun.seq == ack.seq
    assert await stored_on(bus, subj) == before + 1
    # ...and its body too: the stored copy still reads back as the first one
    msg = await bus.js.get_msg(bus.stream, ack.seq)
    assert await bus.decode_msg(msg, [BatchAssembled]) == real


async def test_an_ordinary_duplicate_costs_no_republish(bus: Bus) -> None:
    """Publishing the same event twice: one stored copy, the duplicate ack points at it."""
    real = batch(bus.run, 2)
    first = await bus.publish(real)
    with capture_logs() as logs:
        second = await bus.publish(real)
    assert second.duplicate is True and second.seq == first.seq
    assert not [e for e in logs if e["event"] == "publish.squatted"]
    assert await stored_on(bus, subject(bus.run, Topic.BATCH_ASSEMBLED)) == 1


async def test_an_id_squatted_at_every_salt_fails_loudly(bus: Bus) -> None:
    """Bounded: when the id and every salted id hold other messages, PublishError."""
    from bus.errors import PublishError

    real = batch(bus.run, 3)
    ids = [real.event_id] + [derive_id(real.event_id, "squatted", k) for k in (1, 2, 3)]
    for i in ids:
        await squat(bus, i, "other_type")
    with pytest.raises(PublishError, match="salted"):
        await bus.publish(real)


# -- recovery: work held by a dead consumer, and a slow live one ---------------------------


async def test_work_held_by_a_killed_consumer_comes_back_within_ack_wait(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """A consumer that dies holding a message (its connection closed, no ack) does not
    hold it for long: another consumer of the durable gets it within ack_wait + 1 s."""
    await bus.publish(RunStopped(run=bus.run, reason="user"))
    topics = [(Topic.RUN_STOPPED, None)]
    taken = asyncio.Event()

    async def hold_forever(event: Any, d: Delivery) -> None:
        taken.set()
        await asyncio.Event().wait()

    doomed = await Bus.connect(nats_server.url, run=bus.run, producer="doomed", settings=FAST)
    first = asyncio.create_task(
        Consumer(doomed, Subscription("guard", topics, hold_forever), role="test").run(
            asyncio.Event()
        )
    )
    await asyncio.wait_for(taken.wait(), 10)

    got: list[tuple[float, Delivery]] = []

    async def take(event: Any, d: Delivery) -> None:
        got.append((time.monotonic(), d))

    stop = asyncio.Event()
    live = Bus(bus.nc, bus.run, "live", FAST)
    second = asyncio.create_task(
        Consumer(live, Subscription("guard", topics, take), role="test").run(stop)
    )
    await asyncio.sleep(1.5 * FAST.ack_wait_s)  # the holder is alive: nothing comes back
    assert got == []

    await doomed.nc.close()  # killed: no ack, no nak, no keep-alive any more
    killed_at = time.monotonic()
    first.cancel()
    with contextlib.suppress(BaseException):
        await first
    try:
        async with asyncio.timeout(FAST.ack_wait_s + 5):
            while not got:
                await asyncio.sleep(0.02)
    finally:
        stop.set()
        await second
    (at, delivery), *_ = got
    assert delivery.deliveries == 2
    assert at - killed_at < FAST.ack_wait_s + 1.0


async def test_a_slow_handler_and_the_batch_behind_it_are_not_redelivered(bus: Bus) -> None:
    """A sequential consumer working longer than 2 x ack_wait on one message keeps it and
    every message fetched behind it: each is handled once, on its first delivery."""
    fast = Bus(bus.nc, bus.run, "test", FAST)
    events = [RunStopped(run=bus.run, reason="user", step=i) for i in range(3)]
    await fast.publish_many(events)
    got: list[tuple[int, int]] = []

    async def slow_first(event: RunStopped, d: Delivery) -> None:
        if event.step == 0:
            await asyncio.sleep(2.5 * FAST.ack_wait_s)
        got.append((event.step, d.deliveries))

    stop = asyncio.Event()
    sub = Subscription("slow", [(Topic.RUN_STOPPED, None)], slow_first, batch=64)
    task = asyncio.create_task(Consumer(fast, sub, role="test").run(stop))
    try:
        async with asyncio.timeout(20):
            while len(got) < 3:
                await asyncio.sleep(0.05)
        await asyncio.sleep(FAST.ack_wait_s)  # a redelivery would show up by now
    finally:
        stop.set()
        await task
    assert got == [(0, 1), (1, 1), (2, 1)]
    info = await bus.js.consumer_info(bus.stream, "slow")
    assert not info.num_redelivered and not info.num_ack_pending
