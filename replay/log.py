"""Reading a run's log: every stored event, decoded and upcast, in stream order.

    reader = LogReader(bus, from_seq=1)            # or since=datetime, topics=[...]
    async for entry in reader.entries():          # Entry(seq, subject, stored_ns, ..., event)
        ...
    reader.last_seq, reader.skipped                # where it stopped; what it stepped over

The reader of record for replay and the lake. Unlike ``bus.reader.read_log`` (the
catch-up fold of live roles, which knows only current schemas), it decodes legacy
versions too (``schemas.legacy``) and upcasts them (``replay.upcast``), and it never
raises on a message it cannot read: an unknown or newer schema (``trace_completed/9``
written by a newer rlbus), a corrupt payload or a missing offloaded body is logged,
recorded in ``skipped`` with its sequence, and stepped over, so one bad message never
stops an analytics job. ``last_seq`` counts skipped messages too: a resumed reader
does not trip over them again.

Finished or live: without ``follow`` it returns once caught up (no message pending, or
``until_seq`` reached); with ``follow`` it keeps waiting for new events until cancelled.
It is an ordered push consumer (NATS_NOTES #11): no acks, flow-controlled, the fastest
way to read a stream in order.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from bus import codec
from bus.errors import BodyError, DecodeError
from bus.offload import BodyStore
from bus.runtime import Bus
from bus.subjects import Topic, filter_subject
from replay.upcast import upcast
from schemas import EVENT_TYPES, Event
from schemas.legacy import LEGACY_TYPES

ALL_TYPES: tuple[type[Event], ...] = EVENT_TYPES + LEGACY_TYPES


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


def decode_event(payload: bytes | memoryview, schema: str | None = None) -> Event:
    """Decode a current or legacy event and upcast it (pure; raises ``DecodeError`` and
    its subclass ``UnknownSchema``)."""
    event: Event = codec.decode(payload, ALL_TYPES, schema)
    return upcast(event)


@dataclass
class LogReader:
    bus: Bus
    from_seq: int = 1
    since: dt.datetime | None = None  # start at the first event stored at or after this
    topics: Sequence[tuple[Topic, str | None]] | None = None  # None: every topic
    follow: bool = False
    until_seq: int | None = None  # stop after this sequence (a bounded catch-up)
    idle_timeout_s: float = 5.0
    skipped: list[Skipped] = field(default_factory=list)
    last_seq: int = 0  # the last sequence read, skipped ones included

    def __post_init__(self) -> None:
        self.last_seq = max(self.last_seq, self.from_seq - 1)

    def _config(self) -> ConsumerConfig:
        filters = (
            [filter_subject(self.bus.run, t, k) for t, k in self.topics] if self.topics else None
        )
        if self.since is not None:
            since = self.since if self.since.tzinfo else self.since.astimezone()
            return ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_TIME,
                opt_start_time=since.astimezone(dt.UTC),
                filter_subjects=filters,
            )
        return ConsumerConfig(
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(1, self.from_seq),
            filter_subjects=filters,
        )

    async def entries(self) -> AsyncIterator[Entry]:
        """The events from the start position on, in order (see the module docstring)."""
        if self.until_seq is not None and self.from_seq > self.until_seq:
            return
        sub = await self.bus.js.subscribe(
            "", ordered_consumer=True, config=self._config(), stream=self.bus.stream
        )
        try:
            if not self.follow:
                info = await sub.consumer_info()
                delivered = info.delivered.consumer_seq if info.delivered else 0
                if not info.num_pending and not delivered:
                    return  # nothing at or after the start: do not wait for it
            while True:
                try:
                    msg = await sub.next_msg(timeout=self.idle_timeout_s)
                except (TimeoutError, nats.errors.TimeoutError):
                    if self.follow:
                        continue
                    return
                meta = msg.metadata
                seq = meta.sequence.stream
                entry = await self._entry(msg, seq)
                self.last_seq = seq
                if entry is not None:
                    yield entry
                if not self.follow and (
                    meta.num_pending == 0 or (self.until_seq is not None and seq >= self.until_seq)
                ):
                    return
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _entry(self, msg: Msg, seq: int) -> Entry | None:
        headers = msg.headers or {}
        schema = headers.get(codec.H_SCHEMA, "?")
        payload: bytes = msg.data
        offloaded = headers.get(codec.H_BODY) == "ref"
        try:
            if offloaded:
                ref = codec.decode_ref(payload)
                payload = await BodyStore(self.bus.js, ref.bucket).get(ref.name, ref.digest)
            event = decode_event(payload, headers.get(codec.H_SCHEMA))
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
