"""The log reader: a run's stored events, in stream order, from where you say.

    reader = LogReader(bus, from_seq=1)            # or since=datetime, start="last"|"new"
    async for entry in reader.entries():          # Entry(seq, subject, stored_ns, ..., event)
        ...
    reader.last_seq, reader.skipped                # where it stopped; what it stepped over

    async for seq, event in read_log(bus, [(Topic.BATCH_ASSEMBLED, None)], (BatchAssembled,),
                                     with_seq=True):   # the same reader, as a catch-up fold

It is the one place rlbus reads the log in order: the fold that rebuilds a role's state
at start (algorithm workers, the trainer's catch-up), the followers a role declares
(``bus.consumer.Follow``: the orchestrator, inference's weights), the launcher's view,
``rlbus events``, replay, export and the lake. Underneath is an ordered push consumer
(NATS_NOTES #11): no acks, flow-controlled, recreated by nats-py after a gap, the
fastest way to read a stream in order; ``ordered_config`` is the only place that
describes one.

Stored events are decoded as current or legacy versions and upcast
(``schemas.legacy.upcast``), so every reader sees current events only. A message it
cannot read (an unknown or newer schema, a corrupt payload, a missing offloaded body)
is logged, recorded in ``skipped`` with its sequence and stepped over: the durable
consumer that owns it dead-letters it, and one bad message never stops a fold or an
analytics job. ``last_seq`` counts skipped messages too.

Finished or live: without ``follow`` it returns once caught up (no message pending, or
``until_seq`` reached; with ``raise_on_stall``, as catch-up folds ask, a stall before
``until_seq`` is a ``TimeoutError``, since those messages are known to exist, while the
lake just stops there and resumes from ``last_seq`` next time); with ``follow`` it keeps waiting for new events until
``stop`` is set or it is cancelled.

Progress of a bounded read costs nothing extra: the server says with every message how
many messages of the read's subjects are still stored after it (``num_pending``), so
``read + pending`` is the read's total. ``on_progress(read, total)`` gets it after every
message (and once before the first); a command draws it, a role logs it now and then.
Messages stored while the read goes on raise the total; with ``until_seq`` it counts
messages past that bound until the read stops there (a last call says ``(read, read)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy, RawStreamMsg

from bus import codec
from bus.errors import BodyError, DecodeError
from bus.runtime import Bus
from bus.subjects import Topic, check_schema, filter_subject
from bus.waits import unless_stopped
from schemas import EVENT_TYPES, BatchAssembled, Event
from schemas.legacy import LEGACY_TYPES, upcast

ALL_TYPES: tuple[type[Event], ...] = EVENT_TYPES + LEGACY_TYPES
Topics = Sequence[tuple[Topic, str | None]]  # (topic, key or None for every key)
Progress = Callable[[int, int | None], None]  # on_progress(done, total or None if unknown)


# A message as the server stored it (subject, headers, data, metadata): what
# ``LogReader.messages`` yields, named here so readers outside ``bus`` need no client type.
StoredMsg = Msg


def decode_event(
    payload: bytes | memoryview, schema: str | None = None, subject: str | None = None
) -> Event:
    """Decode a current or legacy event and upcast it (pure; raises ``DecodeError`` and
    its subclasses ``UnknownSchema`` and, when the event is not of the type its
    ``subject`` declares, ``WrongSchema``)."""
    event: Event = upcast(codec.decode(payload, ALL_TYPES, schema))
    return event if subject is None else check_schema(subject, event)


async def stored_event(bus: Bus, msg: Msg | RawStreamMsg) -> Event:
    """A stored message as a current event: body resolved, legacy versions upcast (raises
    ``DecodeError``/``BodyError`` on a message that is no readable event)."""
    headers = msg.headers or {}
    return decode_event(await bus.payload(msg), headers.get(codec.H_SCHEMA), msg.subject)


def ordered_config(
    run: str,
    topics: Topics | None,
    from_seq: int = 1,
    since: dt.datetime | None = None,
    start: Literal["last", "new"] | None = None,
    headers_only: bool = False,
) -> ConsumerConfig:
    """The ordered consumer of a read: where it starts and which subjects it sees."""
    filters = [filter_subject(run, t, k) for t, k in topics] if topics else None
    extra: dict[str, Any]
    if start == "last":  # the newest message per filter, then whatever comes after it
        policy, extra = DeliverPolicy.LAST, {}
    elif start == "new":
        policy, extra = DeliverPolicy.NEW, {}
    elif since is not None:
        since = since if since.tzinfo else since.astimezone()
        policy, extra = DeliverPolicy.BY_START_TIME, {"opt_start_time": since.astimezone(dt.UTC)}
    else:
        policy, extra = DeliverPolicy.BY_START_SEQUENCE, {"opt_start_seq": max(1, from_seq)}
    # filter_subjects even for one: nats-py's subscribe("") overwrites filter_subject.
    return ConsumerConfig(
        deliver_policy=policy,
        filter_subjects=filters,
        headers_only=headers_only or None,
        **extra,  # type: ignore[arg-type]
    )


@dataclass(frozen=True)
class Entry:
    """One stored event with where and when the stream stored it."""

    seq: int  # stream sequence
    subject: str
    stored_ns: int  # server time of storage (the event's own ts_ns is the producer's clock)
    schema: str  # the tag as stored, before upcasting ("trace_completed/0")
    size: int  # bytes of the encoded event (of the body when offloaded)
    offloaded: bool
    event: Event  # decoded and upcast to the current version


@dataclass(frozen=True)
class Skipped:
    """A stored message the reader could not turn into an event, and why."""

    seq: int
    subject: str
    schema: str
    reason: str


class _Reconnected(Exception):
    """The connection came back while a follower waited (``LogReader._next``)."""


# A follower's ordered consumer lives in the server's memory: a restarted server has lost
# it, and nats-py recreates it (from the next sequence) once two idle heartbeats went
# missing. With nats-py's default (5 s) a follower stood still 10-20 s after a server
# restart; at 1 s it is back within about 2 s. (An idle follower costs one small
# message a second.)
FOLLOW_HEARTBEAT_S = 1.0


@dataclass
class LogReader:
    bus: Bus
    from_seq: int = 1
    since: dt.datetime | None = None  # start at the first event stored at or after this
    topics: Topics | None = None  # None: every topic
    follow: bool = False
    until_seq: int | None = None  # stop after this sequence (a bounded catch-up)
    idle_timeout_s: float = 5.0
    start: Literal["last", "new"] | None = None  # the newest message on, or new ones only
    headers_only: bool = False  # messages() only: no payloads are sent
    stop: asyncio.Event | None = None  # with ``follow``: return once set
    raise_on_stall: bool = False  # a stall before ``until_seq`` raises instead of returning
    on_progress: Progress | None = None  # (read, read + pending): see the module docstring
    skipped: list[Skipped] = field(default_factory=list)
    last_seq: int = 0  # the last sequence read, skipped ones included
    read: int = 0  # messages read, skipped ones included

    def __post_init__(self) -> None:
        self.last_seq = max(self.last_seq, self.from_seq - 1)

    async def messages(self) -> AsyncGenerator[Msg, None]:
        """The raw stored messages from the start position on, in order. A follower whose
        connection comes back after losing its server subscribes again after the last
        message it read at once (its ordered consumer lived in the server's memory;
        nats-py would recreate it only after two missed heartbeats, ~2-3 s)."""
        if self.until_seq is not None and self.from_seq > self.until_seq:
            return
        while True:
            back = self.bus.next_reconnect if self.follow else None
            async with contextlib.aclosing(self._subscribed(back)) as messages:
                async for msg in messages:
                    yield msg
            if back is None or not back.is_set() or (self.stop is not None and self.stop.is_set()):
                return

    async def _subscribed(self, back: asyncio.Event | None) -> AsyncGenerator[Msg, None]:
        """``messages`` from one subscription: from the start position, or after the last
        message read; it ends when ``back`` is set (the connection came back)."""
        resumed = back is not None and (self.read > 0 or self.last_seq >= self.from_seq)
        config = ordered_config(
            self.bus.run, self.topics, self.last_seq + 1 if resumed else self.from_seq,
            None if resumed else self.since, None if resumed else self.start,
            self.headers_only,
        )  # fmt: skip
        sub = await self.bus.api(
            lambda: self.bus.js.subscribe(
                "", ordered_consumer=True, config=config, stream=self.bus.stream,
                idle_heartbeat=FOLLOW_HEARTBEAT_S if self.follow else None,
            ),
            "read the log",
        )  # fmt: skip
        # nats-py recreates an ordered consumer after a gap from this same config object,
        # by start sequence: a start time left in it makes the server refuse the new one.
        config.opt_start_time = None
        try:
            if not self.follow:
                info = await sub.consumer_info()
                delivered = info.delivered.consumer_seq if info.delivered else 0
                if not info.num_pending and not delivered:
                    return  # nothing at or after the start: do not wait for it
                if self.on_progress is not None:  # some may be on their way to us already
                    self.on_progress(0, delivered + (info.num_pending or 0))
            while True:
                if self.stop is not None and self.stop.is_set():
                    return
                try:
                    msg = await self._next(sub, back)
                except _Reconnected:
                    return
                except (TimeoutError, nats.errors.TimeoutError) as e:
                    if self.follow:
                        continue
                    if (
                        self.raise_on_stall
                        and self.until_seq is not None
                        and self.last_seq < self.until_seq
                    ):
                        raise TimeoutError(
                            f"reading {self.bus.stream} up to seq {self.until_seq} stalled "
                            f"at seq {self.last_seq}"
                        ) from e
                    return
                meta = msg.metadata
                seq = meta.sequence.stream
                self.last_seq = seq
                self.read += 1
                if self.on_progress is not None:
                    self.on_progress(self.read, self.read + meta.num_pending)
                yield msg
                if not self.follow and meta.num_pending == 0:
                    return
                if not self.follow and self.until_seq is not None and seq >= self.until_seq:
                    if self.on_progress is not None:  # what is pending lies past the bound
                        self.on_progress(self.read, self.read)
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _next(self, sub: Any, back: asyncio.Event | None = None) -> Msg:
        """The next message, or ``TimeoutError`` after ``idle_timeout_s``, or at once when
        ``stop`` is set while it waits (a follower stopping does not wait out the idle
        timeout; the loop then sees the stop), or ``_Reconnected`` once ``back`` is set.
        Messages already buffered are taken as is."""
        if back is not None and back.is_set():
            raise _Reconnected
        waits = [e for e in (self.stop, back) if e is not None]
        if not waits or sub.pending_msgs:
            return await sub.next_msg(timeout=self.idle_timeout_s)  # type: ignore[no-any-return]
        got = await unless_stopped(sub.next_msg(timeout=self.idle_timeout_s), *waits)
        if got is not None:
            return got.result()  # type: ignore[no-any-return]
        if back is not None and back.is_set():
            raise _Reconnected
        raise TimeoutError("stopped")

    async def entries(self) -> AsyncGenerator[Entry, None]:
        """The decoded events from the start position on, in order (see the module doc)."""
        async with contextlib.aclosing(self.messages()) as messages:
            async for msg in messages:
                entry = await self._entry(msg)
                if entry is not None:
                    yield entry

    async def events(
        self, types: tuple[type, ...] | None = None, with_seq: bool = False
    ) -> AsyncGenerator[Any, None]:
        """The events (or ``(seq, event)`` pairs) of ``types`` (None: every type)."""
        async with contextlib.aclosing(self.entries()) as entries:
            async for entry in entries:
                if types is None or isinstance(entry.event, types):
                    yield (entry.seq, entry.event) if with_seq else entry.event

    async def _entry(self, msg: Msg) -> Entry | None:
        headers = msg.headers or {}
        schema = headers.get(codec.H_SCHEMA, "?")
        offloaded = headers.get(codec.H_BODY) == "ref"
        seq = msg.metadata.sequence.stream
        try:
            payload = await self.bus.payload(msg)
            event = decode_event(payload, headers.get(codec.H_SCHEMA), msg.subject)
        except (DecodeError, BodyError) as e:
            self.skipped.append(Skipped(seq, msg.subject, schema, str(e)))
            self.bus.log.warning(
                "log.skipped", seq=seq, subject=msg.subject, schema=schema, error=str(e)
            )
            return None
        ts = msg.metadata.timestamp
        return Entry(
            seq=seq,
            subject=msg.subject,
            stored_ns=int(ts.timestamp() * 1e9) if ts else 0,
            schema=schema,
            size=len(payload),
            offloaded=offloaded,
            event=event,
        )


def read_log(
    bus: Bus,
    topics: Topics,
    types: tuple[type, ...],
    from_seq: int = 1,
    stall_timeout_s: float = 10.0,
    with_seq: bool = False,
    until_seq: int | None = None,
    on_progress: Progress | None = None,
) -> AsyncGenerator[Any, None]:
    """Every event of ``types`` on ``topics`` stored so far, in stream order: a fold.

    With ``with_seq`` it yields ``(stream_seq, event)`` pairs. Close it with
    ``contextlib.aclosing`` if you break out early, so its consumer is removed at once.
    ``on_progress(read, total)`` counts the messages on ``topics``, of every type.
    """
    reader = LogReader(
        bus, from_seq=from_seq, topics=topics, until_seq=until_seq,
        idle_timeout_s=stall_timeout_s, raise_on_stall=True, on_progress=on_progress,
    )  # fmt: skip
    return reader.events(types, with_seq=with_seq)


async def last_seq(bus: Bus, topic: Topic, key: str | None = None) -> int:
    """Stream sequence of the newest message on ``topic`` (0 when there is none)."""
    try:
        msg = await bus.js.get_last_msg(bus.stream, filter_subject(bus.run, topic, key))
    except nats.js.errors.NotFoundError:
        return 0
    return int(msg.seq or 0)


async def first_event(
    bus: Bus, topic: Topic, types: tuple[type, ...], accept: Callable[[Any], bool]
) -> Any:
    """The oldest event on ``topic`` that decodes as one of ``types`` and that ``accept``
    takes, or None: undecodable or refused messages before it are stepped over (a
    reader of the run's start must not die on, or believe, what someone put after it)."""
    seq = 1
    subject = filter_subject(bus.run, topic, None)
    while True:
        try:
            msg = await bus.js.get_msg(bus.stream, seq=seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            return None
        seq = (msg.seq or seq) + 1
        try:
            event = await stored_event(bus, msg)  # type: ignore[arg-type]
        except (DecodeError, BodyError):
            continue
        if isinstance(event, types) and accept(event):
            return event


async def last_event(
    bus: Bus, topic: Topic, types: tuple[type, ...], key: str | None = None
) -> Any:
    """The newest readable event of ``types`` on ``topic`` (offloaded body resolved,
    upcast), or None: an unreadable newer message is stepped over (``newest_first``)."""
    async with contextlib.aclosing(newest_first(bus, topic, types, key)) as events:
        async for event in events:
            return event
    return None


async def newest_first(
    bus: Bus, topic: Topic, types: tuple[type, ...], key: str | None = None
) -> AsyncGenerator[Any, None]:
    """The readable events of ``types`` on ``topic``, newest first. A message that is no
    readable event (garbage, another type: ``check_schema``, a missing body) is stepped
    over, so one bad message never hides the good ones before it."""
    async with contextlib.aclosing(newest_messages(bus, topic, key)) as messages:
        async for msg in messages:
            try:
                event = await stored_event(bus, msg)  # type: ignore[arg-type]
            except (DecodeError, BodyError):
                continue
            if isinstance(event, types):
                yield event


async def newest_messages(
    bus: Bus, topic: Topic, key: str | None = None
) -> AsyncGenerator[RawStreamMsg, None]:
    """The stored messages on ``topic``, newest first, undecoded.

    JetStream reads forward only (a direct get of the next message on a subject at or
    after a sequence), so it reads windows that grow 4x backwards from the newest
    message: a subject's sparse messages among many others cost a few reads each."""
    subj = filter_subject(bus.run, topic, key)
    try:
        newest = await bus.js.get_last_msg(bus.stream, subj)
    except nats.js.errors.NotFoundError:
        return
    end, window = int(newest.seq or 0) + 1, 64  # the window: [end - window, end)
    while end > 1:
        start = max(1, end - window)
        found: list[RawStreamMsg] = []
        seq = start
        while True:
            try:
                msg = await bus.js.get_msg(bus.stream, seq=seq, subject=subj, next=True)
            except nats.js.errors.NotFoundError:
                break
            if int(msg.seq or 0) >= end:
                break
            found.append(msg)
            seq = int(msg.seq or 0) + 1
        for msg in reversed(found):
            yield msg
        end, window = start, window * 4


async def newest_batch_step(bus: Bus) -> int:
    """The step of the newest batch on the log (0 before the first), from the batch's
    ``Rl-Step`` header: a batch may be an offloaded body of megabytes, never read here.
    A message without the header (a log older than it) is decoded; one that is neither a
    batch nor readable is stepped over."""
    tag = codec.tag_of(BatchAssembled)
    async with contextlib.aclosing(newest_messages(bus, Topic.BATCH_ASSEMBLED)) as messages:
        async for msg in messages:
            headers = msg.headers or {}
            step = headers.get(codec.H_STEP)
            if step is not None and step.isdigit() and headers.get(codec.H_SCHEMA) == tag:
                return int(step)
            try:
                event = await stored_event(bus, msg)  # type: ignore[arg-type]
            except (DecodeError, BodyError):
                continue
            if isinstance(event, BatchAssembled):
                return int(event.step)
    return 0
