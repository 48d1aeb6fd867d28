"""The bus runtime against a real nats-server: round trips, dedup, dead letters, offload."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
import pytest

from bus import codec
from bus.consumer import Consumer, Delivery, Subscription
from bus.errors import BodyError, HandlerBroken
from bus.follower import Follow, Follower
from bus.runtime import Bus, BusSettings
from bus.subjects import Topic, subject
from schemas import (
    EVENT_TYPES,
    DeadLettered,
    Event,
    RunStarted,
    RunStopped,
    TraceCompleted,
    derive_id,
)
from tests.samples import every_event

pytestmark = pytest.mark.nats


async def consume_until(
    bus: Bus,
    sub: Subscription,
    done: Callable[[], bool],
    timeout: float = 20.0,
) -> Consumer:
    """Run a consumer until ``done()`` holds, then stop it gracefully."""
    stop = asyncio.Event()
    consumer = Consumer(bus, sub, role="test")
    task = asyncio.create_task(consumer.run(stop))
    try:
        async with asyncio.timeout(timeout):
            while not done():
                if task.done():
                    task.result()
                await asyncio.sleep(0.02)
    finally:
        stop.set()
        await task
    return consumer


def collector(
    into: list[Any], outputs: Callable[[Any], Sequence[Event]] | None = None
) -> Callable[[Any, Delivery], Awaitable[Sequence[Event]]]:
    async def handle(event: Any, delivery: Delivery) -> Sequence[Event]:
        into.append(event)
        return outputs(event) if outputs else []

    return handle


async def test_every_schema_round_trips_through_the_stream(bus: Bus) -> None:
    """Each event type published on its subject comes back equal through a durable consumer."""
    events = every_event(bus.run)
    await bus.publish_many(events)
    got: list[Any] = []
    topics = [(t, None) for t in Topic]
    await consume_until(
        bus, Subscription("all", topics, collector(got)), lambda: len(got) == len(events)
    )
    assert got == events
    assert {type(e) for e in got} == set(EVENT_TYPES)


async def test_duplicate_publish_is_stored_once(bus: Bus) -> None:
    """Publishing the same event id twice stores it once (server-side dedup)."""
    ev = RunStopped(run=bus.run, reason="user", event_id="same-id")
    first = await bus.publish(ev)
    second = await bus.publish(ev)
    assert second.duplicate is True and second.seq == first.seq
    info = await bus.js.stream_info(bus.stream)
    assert info.state.messages == 1


async def test_handler_outputs_are_published_before_the_ack(bus: Bus) -> None:
    """A handler's returned events land on the stream, with ids derived from the input."""
    await bus.publish(RunStarted(run=bus.run, config={}, seed=0, model_path="m", event_id="start"))
    got: list[Any] = []

    def stop_for(ev: RunStarted) -> list[Event]:
        return [
            RunStopped(
                run=bus.run,
                reason="echo",
                event_id=derive_id(ev.event_id, "stop"),
                causation_id=ev.event_id,
            )
        ]

    await consume_until(
        bus,
        Subscription("echo", [(Topic.RUN_STARTED, None)], collector(got, stop_for)),
        lambda: len(got) == 1,
    )
    msg = await bus.js.get_last_msg(bus.stream, subject(bus.run, Topic.RUN_STOPPED))
    assert codec.decode(msg.data, [RunStopped]).causation_id == "start"
    assert msg.headers[codec.H_MSG_ID] == derive_id("start", "stop")


async def dead_letters(bus: Bus, n: int) -> list[DeadLettered]:
    got: list[DeadLettered] = []
    await consume_until(
        bus,
        Subscription("dlq-reader", [(Topic.DEAD_LETTERED, None)], collector(got)),
        lambda: len(got) >= n,
    )
    return got


async def test_garbage_bytes_are_dead_lettered_and_consumption_goes_on(bus: Bus) -> None:
    """Undecodable bytes go to the dead-letter topic at once; later messages are still handled."""
    await bus.nc.publish(
        subject(bus.run, Topic.RUN_STOPPED), b"\xc1 not msgpack", headers={"Nats-Msg-Id": "junk"}
    )
    await bus.js.publish(
        subject(bus.run, Topic.RUN_STOPPED), b"\x00", headers={"Nats-Msg-Id": "junk2"}
    )
    await bus.publish(RunStopped(run=bus.run, reason="fine"))
    got: list[Any] = []
    consumer = await consume_until(
        bus, Subscription("w", [(Topic.RUN_STOPPED, None)], collector(got)), lambda: len(got) == 1
    )
    assert got[0].reason == "fine"
    assert consumer.dead_lettered >= 1
    dead = await dead_letters(bus, consumer.dead_lettered)
    assert all(d.error_type == "DecodeError" and d.deliveries == 1 for d in dead)
    assert b"\x00" in {d.payload for d in dead}


async def test_a_follower_dead_letters_garbage_once_and_folds_on(bus: Bus) -> None:
    """A fold (a Follow) steps over an undecodable message and records it; a second pass
    over the same log (a restart, a replay) steps over the same message and adds no
    second record."""
    await bus.publish(RunStopped(run=bus.run, reason="before"))
    await bus.js.publish(
        subject(bus.run, Topic.RUN_STOPPED), b"\xc1 garbage", headers={"Nats-Msg-Id": "junk3"}
    )
    await bus.publish(RunStopped(run=bus.run, reason="after"))
    for _ in range(2):
        got: list[Any] = []
        stop = asyncio.Event()
        follower = Follower(bus, Follow("fold", [(Topic.RUN_STOPPED, None)], collector(got)), "t")
        task = asyncio.create_task(follower.run(stop))
        async with asyncio.timeout(20):
            while len(got) < 2:
                await asyncio.sleep(0.02)
        stop.set()
        await task
        assert [e.reason for e in got] == ["before", "after"] and follower.skipped == 1
    (dead,) = await dead_letters(bus, 1)
    assert dead.consumer == "fold" and dead.role == "t" and dead.error_type == "DecodeError"
    assert dead.payload == b"\xc1 garbage" and dead.stream_seq == 2
    info = await bus.js.stream_info(bus.stream)
    assert info.state.messages == 4  # the three published and one record, not two


async def test_a_handler_that_always_raises_is_dead_lettered_after_max_deliver(bus: Bus) -> None:
    """Retried up to max_deliver with a nak delay, then dead-lettered with the error; others still flow."""
    await bus.publish(RunStopped(run=bus.run, reason="poison", event_id="poison"))
    await bus.publish(RunStopped(run=bus.run, reason="fine", event_id="fine"))
    attempts: list[str] = []
    ok: list[str] = []

    async def handle(ev: RunStopped, d: Delivery) -> list[Event]:
        attempts.append(ev.reason)
        if ev.reason == "poison":
            raise RuntimeError("always fails")
        ok.append(ev.reason)
        return []

    consumer = await consume_until(
        bus, Subscription("w", [(Topic.RUN_STOPPED, None)], handle), lambda: len(attempts) >= 4
    )
    assert ok == ["fine"]
    assert attempts.count("poison") == bus.settings.max_deliver
    assert consumer.dead_lettered == 1
    (dead,) = await dead_letters(bus, 1)
    assert dead.error_type == "RuntimeError" and "always fails" in dead.error
    assert dead.deliveries == bus.settings.max_deliver and dead.causation_id == "poison"
    assert codec.decode(dead.payload, [RunStopped]).reason == "poison"


@pytest.mark.parametrize("concurrency", [1, 3])
async def test_a_broken_handler_stops_its_consumer_and_hands_the_message_back(
    bus: Bus, concurrency: int
) -> None:
    """HandlerBroken (the handler's machinery, not the message, e.g. a dead trainer rank):
    the consumer stops with it, nothing is dead-lettered, and the next process gets the
    message again."""
    await bus.publish(RunStopped(run=bus.run, reason="fine", event_id="fine"))
    seen: list[int] = []

    async def broken(ev: RunStopped, d: Delivery) -> list[Event]:
        seen.append(d.deliveries)
        raise HandlerBroken("rank 1 exited with code -9")

    sub = Subscription("b", [(Topic.RUN_STOPPED, None)], broken, concurrency=concurrency)
    consumer = Consumer(bus, sub, role="test")
    with pytest.raises(HandlerBroken, match="rank 1"):
        await asyncio.wait_for(consumer.run(asyncio.Event()), timeout=20)
    assert seen == [1] and consumer.dead_lettered == 0
    got: list[RunStopped] = []
    await consume_until(
        bus, Subscription("b", [(Topic.RUN_STOPPED, None)], collector(got)), lambda: bool(got)
    )
    assert [e.event_id for e in got] == ["fine"]


async def test_twenty_megabyte_body_round_trips_through_offload(bus: Bus) -> None:
    """A body over the threshold goes to the object store; the stream carries a small ref."""
    big = RunStarted(
        run=bus.run, config={"blob": "x" * 20_000_000}, seed=0, model_path="m", event_id="big"
    )
    await bus.publish(big)
    raw = await bus.js.get_last_msg(bus.stream, subject(bus.run, Topic.RUN_STARTED))
    assert raw.headers[codec.H_BODY] == "ref" and len(raw.data) < 1000
    got: list[Any] = []
    await consume_until(
        bus,
        Subscription("r", [(Topic.RUN_STARTED, None)], collector(got)),
        lambda: len(got) == 1,
        timeout=60,
    )
    assert got[0] == msgspec.structs.replace(big, producer="test")


async def test_a_tampered_or_missing_body_is_detected(bus: Bus) -> None:
    """Replacing or deleting an offloaded object is a clear error and the message is dead-lettered."""
    small = BusSettings(offload_threshold_bytes=1000, ack_wait_s=2, max_deliver=3)
    b = Bus(bus.nc, bus.run, "test", small)
    await b.publish(
        RunStarted(run=bus.run, config={"blob": "y" * 5000}, seed=0, model_path="m", event_id="b1")
    )
    raw = await bus.js.get_last_msg(bus.stream, subject(bus.run, Topic.RUN_STARTED))
    ref = codec.decode_ref(raw.data)
    # Replace the object's bytes (same name, different content): our digest no longer matches.
    await b.objects.put(ref.name, b"tampered" * 100)
    with pytest.raises(BodyError, match="does not match its reference"):
        await b.objects.get(ref.name, ref.digest)
    await b.objects.delete(ref.name)
    with pytest.raises(BodyError, match="missing"):
        await b.objects.get(ref.name, ref.digest)
    got: list[Any] = []
    stop = asyncio.Event()
    consumer = Consumer(
        b, Subscription("r", [(Topic.RUN_STARTED, None)], collector(got)), role="test"
    )
    task = asyncio.create_task(consumer.run(stop))
    async with asyncio.timeout(10):
        while consumer.dead_lettered == 0:
            await asyncio.sleep(0.02)
    stop.set()
    await task
    assert got == []
    (dead,) = await dead_letters(bus, 1)
    assert dead.error_type == "BodyError"


async def test_concurrent_consumer_handles_in_parallel_and_acks_each(bus: Bus) -> None:
    """With concurrency > 1, slow handlers overlap and every message is acked once."""
    await bus.publish_many([RunStopped(run=bus.run, reason=str(i)) for i in range(20)])
    active = 0
    peak = 0
    seen: list[str] = []

    async def slow(ev: RunStopped, d: Delivery) -> list[Event]:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await asyncio.sleep(0.1)
        active -= 1
        seen.append(ev.reason)
        return []

    sub = Subscription("par", [(Topic.RUN_STOPPED, None)], slow, concurrency=8)
    consumer = await consume_until(bus, sub, lambda: len(seen) == 20)
    assert sorted(seen, key=int) == [str(i) for i in range(20)]
    assert peak > 1
    assert await settled_pending(consumer) == 0


async def settled_pending(consumer: Consumer, within_s: float = 5.0) -> int:
    """The consumer's pending count once it reaches 0, or after ``within_s``: the server
    applies acks apart from the request that reads the count (a loaded machine lags)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while (n := await consumer.pending()) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    return n


async def test_trace_sized_events_pipeline(bus: Bus) -> None:
    """publish_many keeps order and returns one ack per event."""
    (trace,) = [e for e in every_event(bus.run) if isinstance(e, TraceCompleted)]
    evs = [msgspec.structs.replace(trace, event_id=f"t{i}") for i in range(300)]
    acks = await bus.publish_many(evs)
    assert [a.seq for a in acks] == sorted(a.seq for a in acks)
    assert len({a.seq for a in acks}) == 300


async def test_an_event_of_another_type_on_a_subject_is_refused_by_every_reader(
    bus: Bus,
) -> None:
    """A schema-valid event of another type than its subject declares (a MetricsReported
    on weights.published, as a buggy trainer might publish) reaches no handler: a durable
    that also consumes metrics, a follower and a log fold each step over it, and the
    durable and the follower dead-letter it as WrongSchema."""
    from bus.reader import LogReader
    from schemas import MetricsReported, WeightsPublished

    sample = {type(e): e for e in every_event(bus.run)}
    metrics, weights = sample[MetricsReported], sample[WeightsPublished]
    await bus.js.publish(
        subject(bus.run, Topic.WEIGHTS_PUBLISHED), codec.encode(metrics),
        headers=codec.headers_for(metrics),
    )  # fmt: skip
    await bus.publish(weights)
    both = [(Topic.WEIGHTS_PUBLISHED, None), (Topic.METRICS_REPORTED, None)]
    got: list[Any] = []
    consumer = await consume_until(
        bus, Subscription("typed", both, collector(got)), lambda: len(got) == 1
    )
    followed: list[Any] = []
    stop = asyncio.Event()
    follower = Follower(bus, Follow("typed-fold", both, collector(followed)), "t")
    task = asyncio.create_task(follower.run(stop))
    async with asyncio.timeout(20):
        while len(followed) < 1 or follower.skipped < 1:
            await asyncio.sleep(0.02)
    stop.set()
    await task
    reader = LogReader(bus, topics=both)
    folded = [e async for e in reader.events()]
    assert got == followed == folded == [weights]
    assert consumer.dead_lettered == 1 and follower.skipped == 1 and len(reader.skipped) == 1
    dead = await dead_letters(bus, 2)
    assert {d.consumer for d in dead} == {"typed", "typed-fold"}
    assert all(d.error_type == "WrongSchema" and d.stream_seq == 1 for d in dead)
    assert "a MetricsReported on weights.published" in dead[0].error


async def test_a_consumer_waits_out_jetstream_unavailable_instead_of_dying(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """JetStream answering 503 to a fetch (a cluster electing the stream's leader) is
    waited out: the consumer fetches again and handles what comes (it used to raise,
    and the role died, restarted into the same election, and died again)."""
    import nats.js.errors

    bind = bus.js.pull_subscribe_bind

    async def flaky_bind(*args: Any, **kwargs: Any) -> Any:
        psub = await bind(*args, **kwargs)
        fetch, failures = psub.fetch, [2]

        async def fetch_or_503(*a: Any, **k: Any) -> Any:
            if failures[0]:
                failures[0] -= 1
                raise nats.js.errors.ServiceUnavailableError
            return await fetch(*a, **k)

        psub.fetch = fetch_or_503
        return psub

    monkeypatch.setattr(bus.js, "pull_subscribe_bind", flaky_bind)
    await bus.publish(RunStopped(run=bus.run, reason="after the election"))
    got: list[Any] = []
    await consume_until(
        bus, Subscription("elected", [(Topic.RUN_STOPPED, None)], collector(got)),
        lambda: len(got) == 1,
    )  # fmt: skip
    assert got[0].reason == "after the election"
