"""The durable pull-consumer loop: fetch, decode, handle, publish outputs, then ack.

A handler returns what its input caused: a list of events, or ``Effects`` (events plus
an ``after_publish`` hook for state that may only change once they are stored). The
runtime publishes, runs the hook, then acks; a handler never publishes by itself.
The other consumer kind, an ordered follower of the log, is ``bus.follower``.

At-least-once with effectively-once effects: the input is acked only after every output
is acknowledged by JetStream, and outputs carry ids derived from the input, so a
redelivered input republishes the same ids and the server dedups them.

Failure rules (the one catch-all boundary of rlbus):
- undecodable bytes or an unknown schema: dead-lettered at once with the decode error, then
  ``term()``; the role keeps consuming;
- an event the handler's validation refuses (``bus.errors.Rejected``): the same, at once;
- a handler exception: ``nak(delay)`` and redelivery, up to ``max_deliver`` deliveries, then
  dead-lettered with the last error;
- a message delivered more than ``max_deliver`` times because earlier handlers never
  answered (the process crashed on it): dead-lettered when seen again.
Every fetched message not yet answered (acked, naked or termed) gets ``in_progress()``
every ack_wait/3, the one being handled and those waiting behind it in the same fetch
alike: so ``ack_wait`` can be short (work held by a dead consumer comes back within it)
without a slow handler, or a long batch, being redelivered meanwhile. Handlers must not
block the event loop for longer than that (heavy work goes to a thread).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from bus import codec
from bus.errors import BodyError, DecodeError, HandlerBroken, Rejected
from bus.runtime import Bus
from bus.subjects import TOPICS, Topic, TopicSpec, check_schema, filter_subject
from bus.waits import unless_stopped
from schemas import DeadLettered, Event, derive_id


@dataclass(frozen=True)
class Effects:
    """What a handler caused: events to publish, and a hook run once they are stored.

    State that must move only after a successful publish (an algorithm's scored set, the
    trainer's announced step) moves in ``after_publish``: if the publish fails, the hook
    does not run and the input is redelivered.
    """

    events: Sequence[Event] = ()
    after_publish: Callable[[], Awaitable[None] | None] | None = None


Outputs = Sequence[Event] | Effects | None
Handler = Callable[[Any, "Delivery"], Awaitable[Outputs]]


async def commit(bus: Bus, outputs: Outputs) -> None:
    """Publish a handler's outputs, then run its after-publish hook (if any)."""
    if outputs is None:
        return
    if isinstance(outputs, Effects):
        if outputs.events:
            await bus.publish_many(list(outputs.events))
        if outputs.after_publish is not None:
            done = outputs.after_publish()
            if done is not None:
                await done
    elif outputs:
        await bus.publish_many(list(outputs))


@dataclass(frozen=True)
class Delivery:
    """What a handler may want to know about the message besides the event."""

    subject: str
    stream_seq: int
    deliveries: int
    pending: int = 0  # messages of the reader's subjects stored after this one (followers)


@dataclass
class Subscription:
    """A durable consumer declared next to its handler."""

    durable: str
    topics: Sequence[tuple[Topic, str | None]]  # (topic, key or None for every key)
    handler: Handler
    concurrency: int = 1  # >1: handle messages concurrently (order not kept)
    batch: int = 64
    fetch_timeout_s: float = 1.0
    deliver_new: bool = False  # start at new messages instead of the start of the log
    start_seq: int | None = None  # start at this stream sequence (a worker attached mid-run)
    # Recreate the durable at this sequence when the role starts, dropping its old
    # position (the trainer: its position is derived from its checkpoint and catch-up).
    restart_at: int | None = None
    # One process consumes this durable (the trainer's): after a reconnect, what the
    # server delivered that it never got comes again at once (``Consumer._reposition``).
    owned: bool = False
    max_ack_pending: int = 1000
    types: tuple[type, ...] = field(init=False)

    def __post_init__(self) -> None:
        specs: list[TopicSpec] = [TOPICS[t] for t, _ in self.topics]
        self.types = tuple(dict.fromkeys(s.schema for s in specs))


UNAVAILABLE_RETRY_S = 0.5  # between fetches while JetStream answers 503


def dead_lettered(
    run: str, consumer: str, role: str, msg: Msg, d: Delivery, error_type: str, error: str
) -> DeadLettered:
    """The record of a message ``consumer`` could not take: its id derives from the
    consumer and the stream sequence, so the same message is recorded once, however
    often it is met (a redelivery, a restarted follower). Its cause is the message's
    event id when the payload tells it, else the header id."""
    return DeadLettered(
        run=run,
        event_id=derive_id("dead", consumer, d.stream_seq),
        causation_id=codec.stored_event_id(msg.data or b"", msg.headers or {})
        or (msg.headers or {}).get(codec.H_MSG_ID),
        role=role,
        consumer=consumer,
        subject=d.subject,
        stream_seq=d.stream_seq,
        deliveries=d.deliveries,
        error_type=error_type,
        error=error[:4000],
        payload=bytes(msg.data or b""),
        headers={k: v for k, v in (msg.headers or {}).items() if k != codec.H_MSG_ID},
    )


class Consumer:
    def __init__(self, bus: Bus, sub: Subscription, role: str):
        self.bus = bus
        self.sub = sub
        self.role = role
        self.log = bus.log.bind(consumer=sub.durable)
        self.handled = 0
        self.dead_lettered = 0
        self._inflight: set[asyncio.Task[None]] = set()
        self._broken: HandlerBroken | None = None  # a concurrent handler broke: stop
        # Fetched and not yet answered: kept alive (by id: Msg is unhashable).
        self._held: dict[int, Msg] = {}
        self._unavailable_since: float | None = None  # JetStream answering 503 since
        self._slots = asyncio.Semaphore(max(1, sub.concurrency))

    def config(self, start: int | None = None) -> ConsumerConfig:
        """The durable's configuration; ``start``: at this stream sequence (default: the
        subscription's ``restart_at``, else its ``start_seq``)."""
        s = self.bus.settings
        given = start is not None
        if start is None:
            start = self.sub.start_seq if self.sub.restart_at is None else self.sub.restart_at
        policy = DeliverPolicy.NEW if self.sub.deliver_new else DeliverPolicy.ALL
        if start is not None and (start > 1 or given):
            policy = DeliverPolicy.BY_START_SEQUENCE
        return ConsumerConfig(
            durable_name=self.sub.durable,
            filter_subjects=[filter_subject(self.bus.run, t, k) for t, k in self.sub.topics],
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=policy,
            opt_start_seq=start if policy == DeliverPolicy.BY_START_SEQUENCE else None,
            ack_wait=s.ack_wait_s,
            max_deliver=-1,  # we count deliveries ourselves so the last one is dead-lettered
            max_ack_pending=self.sub.max_ack_pending,
        )

    async def ensure(self) -> None:
        """Create the durable consumer, or reuse it as it is (a restart resumes its position);
        with ``restart_at``, recreate it there."""
        js, stream = self.bus.js, self.bus.stream
        if self.sub.restart_at is not None:  # asked again while the server is slow or away
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self.bus.api(lambda: js.delete_consumer(stream, self.sub.durable),
                                   "delete consumer")  # fmt: skip
            await self.bus.api(lambda: js.add_consumer(stream, self.config()), "create consumer")
            self.log.info("consumer.positioned", start_seq=self.sub.restart_at)
            return
        try:
            await self.bus.api(lambda: js.consumer_info(stream, self.sub.durable), "consumer info")
        except nats.js.errors.NotFoundError:
            await self.bus.api(lambda: js.add_consumer(stream, self.config()), "create consumer")

    async def _reposition(self, psub: Any) -> Any:
        """After a reconnect, an ``owned`` durable whose process holds nothing: what the
        server had delivered and the process never got (lost with a restarted server)
        would come back only after ``ack_wait``, and with ``max_ack_pending = 1`` nothing
        else would come meanwhile. Recreated at its ack floor, it comes at once (the
        handler is idempotent: what it did but could not ack comes again too). Returns
        the subscription to fetch from."""
        js, stream, durable = self.bus.js, self.bus.stream, self.sub.durable
        info = await self.bus.api(lambda: js.consumer_info(stream, durable), "consumer info")
        if not info.num_ack_pending:
            return psub
        start = info.ack_floor.stream_seq + 1
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.bus.api(lambda: js.delete_consumer(stream, durable), "delete consumer")
        await self.bus.api(lambda: js.add_consumer(stream, self.config(start)), "create consumer")
        self.log.info("consumer.repositioned", start_seq=start, ack_pending=info.num_ack_pending)
        with contextlib.suppress(Exception):
            await psub.unsubscribe()
        return await js.pull_subscribe_bind(durable, stream)

    async def _unavailable(self, stop: asyncio.Event) -> None:
        """JetStream answered 503 (a cluster electing the stream's leader, a node coming
        back): wait and fetch again, up to ``bus.server_lost_s``, then raise. Dying on it
        would only restart the role into the same election."""
        now = asyncio.get_running_loop().time()
        if self._unavailable_since is None:
            self._unavailable_since = now
            self.log.warning("consumer.unavailable")
        elif now - self._unavailable_since > self.bus.settings.server_lost_s:
            raise nats.js.errors.ServiceUnavailableError
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), UNAVAILABLE_RETRY_S)

    async def pending(self) -> int:
        info = await self.bus.js.consumer_info(self.bus.stream, self.sub.durable)
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    async def run(
        self,
        stop: asyncio.Event,
        drain_timeout_s: float = 30.0,
        hand_back: asyncio.Event | None = None,
    ) -> None:
        """Consume until ``stop`` is set, then finish in-flight work (or nak it) and return;
        once ``hand_back`` is set, in-flight work is naked at once instead of finished."""
        await self.ensure()
        psub = await self.bus.js.pull_subscribe_bind(self.sub.durable, self.bus.stream)
        sequential = self.sub.concurrency <= 1
        keepalive = asyncio.create_task(self._keep_alive())
        reconnects = self.bus.reconnects
        try:
            while not stop.is_set():
                if self._broken is not None:  # a concurrent handler's (see HandlerBroken)
                    raise self._broken
                if reconnects != self.bus.reconnects and not self._held:
                    reconnects = self.bus.reconnects
                    if self.sub.owned:
                        psub = await self._reposition(psub)
                want = self.sub.batch if sequential else self._free_slots()
                if want == 0:
                    await asyncio.wait(self._inflight, return_when=asyncio.FIRST_COMPLETED)
                    continue
                # An idle fetch waits out its timeout: the stop ends it at once instead (a
                # message the server sends it meanwhile is redelivered after ack_wait).
                fetch = await unless_stopped(psub.fetch(want, timeout=self.sub.fetch_timeout_s), stop)  # fmt: skip
                if fetch is None:
                    break
                try:
                    msgs = fetch.result()
                except (TimeoutError, nats.errors.TimeoutError):
                    continue
                except nats.js.errors.ServiceUnavailableError:
                    await self._unavailable(stop)
                    continue
                self._unavailable_since = None
                self._held.update((id(m), m) for m in msgs)
                for i, msg in enumerate(msgs):
                    if stop.is_set() or self._broken is not None:
                        await self._hand_back(msgs[i:])  # fetched but not started
                        break
                    if sequential:
                        try:
                            await self._process(msg)
                        except HandlerBroken:
                            await self._hand_back(msgs[i + 1 :])
                            raise
                    else:
                        await self._slots.acquire()
                        task = asyncio.create_task(self._process_release(msg))
                        self._inflight.add(task)
                        task.add_done_callback(self._inflight.discard)
        finally:
            await self._drain(drain_timeout_s, hand_back)
            keepalive.cancel()
            # What is still held (a sequential consumer stopped by an error) is not kept
            # alive any more: the server redelivers it after ack_wait.
            self._held.clear()
            with contextlib.suppress(Exception):
                await psub.unsubscribe()
        if self._broken is not None:  # broke while stopping or draining: still an error
            raise self._broken

    async def _hand_back(self, msgs: Sequence[Msg]) -> None:
        for msg in msgs:
            self._held.pop(id(msg), None)
            await msg.nak()

    def _free_slots(self) -> int:
        return max(0, min(self.sub.batch, self.sub.concurrency - len(self._inflight)))

    async def _drain(self, timeout_s: float, hand_back: asyncio.Event | None) -> None:
        """Wait for the in-flight handlers up to ``timeout_s`` or until ``hand_back`` is
        set; those still running are cancelled, which naks their inputs."""
        if not self._inflight:
            return
        self.log.info("consumer.draining", inflight=len(self._inflight))
        pending = set(self._inflight)
        told = asyncio.create_task((hand_back or asyncio.Event()).wait())
        deadline = asyncio.get_running_loop().time() + timeout_s
        try:
            while pending and not told.done():
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    break
                done, _ = await asyncio.wait(
                    {*pending, told}, timeout=left, return_when=asyncio.FIRST_COMPLETED
                )
                pending -= done
        finally:
            if pending and told.done():
                self.log.info("consumer.handing_back", inflight=len(pending))
            told.cancel()
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _process_release(self, msg: Msg) -> None:
        try:
            await self._process(msg)
        except HandlerBroken as e:
            self._broken = e
        finally:
            self._slots.release()

    async def _process(self, msg: Msg) -> None:
        """Handle one message and answer it; it is no longer kept alive once this returns
        or raises (answered, or handed back)."""
        try:
            await self._handle(msg)
        finally:
            self._held.pop(id(msg), None)

    async def _handle(self, msg: Msg) -> None:
        meta = msg.metadata
        delivery = Delivery(msg.subject, meta.sequence.stream, meta.num_delivered)
        max_deliver = self.bus.settings.max_deliver
        if delivery.deliveries > max_deliver:
            await self._dead_letter(
                msg,
                delivery,
                "MaxDeliveriesExceeded",
                f"delivered {delivery.deliveries} times without an answer (did the role crash on it?)",
            )
            return
        try:
            event = check_schema(msg.subject, await self.bus.decode_msg(msg, self.sub.types))
        except (DecodeError, BodyError) as e:
            await self._dead_letter(msg, delivery, type(e).__name__, str(e))
            return
        try:
            await commit(self.bus, await self.sub.handler(event, delivery))
        except (asyncio.CancelledError, HandlerBroken):
            with contextlib.suppress(Exception):
                await msg.nak()
            raise
        except Rejected as e:
            await self._dead_letter(msg, delivery, e.error_type, str(e))
            return
        except Exception as e:  # noqa: BLE001 - the bus boundary is the one catch-all
            if delivery.deliveries >= max_deliver:
                await self._dead_letter(msg, delivery, type(e).__name__, str(e))
            else:
                self.log.warning(
                    "handler.failed", seq=delivery.stream_seq, deliveries=delivery.deliveries,
                    error=repr(e), exc_info=True,
                )  # fmt: skip
                await msg.nak(delay=self.bus.settings.nak_delay_s)
            return
        await msg.ack()
        self.handled += 1

    async def _keep_alive(self) -> None:
        """One loop per consumer (not a timer per message: those cost every message):
        every ack_wait/3 it tells the server that every message fetched and not yet
        answered is alive, the ones waiting behind a slow handler included (a sequential
        consumer's batch would otherwise expire and be delivered twice)."""
        interval = max(0.1, self.bus.settings.ack_wait_s / 3)
        while True:
            await asyncio.sleep(interval)
            for key, msg in list(self._held.items()):
                if key not in self._held:  # answered while we sent the others
                    continue
                with contextlib.suppress(Exception):
                    await msg.in_progress()

    async def _dead_letter(self, msg: Msg, d: Delivery, error_type: str, error: str) -> None:
        dead = dead_lettered(self.bus.run, self.sub.durable, self.role, msg, d, error_type, error)
        await self.bus.publish(dead)
        await msg.term()
        self.dead_lettered += 1
        self.log.error(
            "message.dead_lettered", seq=d.stream_seq, error_type=error_type, error=error[:500]
        )
