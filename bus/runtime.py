"""The bus runtime: a connection to one run, publishing events with dedup ids and acks.

``Bus`` is the one object a role holds. It connects (with reconnect), ensures the run's
stream, encodes events with their headers, offloads large bodies, and publishes with
bounded retries: every publish carries ``Nats-Msg-Id`` = the event id, so a retry (or a
redelivered input republishing derived ids) is stored once. ``publish_many`` pipelines
(``publish_async`` with a bounded window, each wait bounded: nats-py's future can hang
when the server rejects a message, NATS_NOTES #1).

Event ids are predictable (derived from their causes, so a restart republishes the same
ones), so the header id is not the event id itself but ``derive_id(key, event id)``, the
key derived from the publishing identity's password (``msg_id``): a client of another
identity cannot predict it, so cannot preempt an event by storing something else under
its id first; the same identity (a restarted role, another instance of its kind) makes
the same header id, so exactly-once holds across restarts. An anonymous bus (no
identity: tests, a server without authentication) uses the event id as it is. A message
of the same identity may still hold an id (a buggy instance "squatting" it): a duplicate
ack is checked against what is stored, and a squatted event is stored under a salted
header id instead of vanishing.

    bus = await Bus.connect("nats://127.0.0.1:4222", run="demo", producer="trainer-0")
    await bus.ensure_stream()
    await bus.publish(RunStopped(run="demo", reason="user"))
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import DiscardPolicy, PubAck, RawStreamMsg, StorageType, StreamConfig

from bus import codec, rpc
from bus.auth import ClientCreds, connect_options, kind_buckets, run_buckets
from bus.errors import PublishError, ServerLost, ServerUnreachable
from bus.log import get_logger
from bus.offload import BodyStore, sha256_digest
from bus.registry import Heartbeat, list_roles
from bus.settings import RECONNECT_GRACE_S, BusSettings
from bus.subjects import (
    objects_bucket,
    roles_bucket_name,
    run_of_stream,
    stream_name,
    stream_subjects,
    subject_for,
)
from bus.waits import unless_stopped
from schemas import BodyRef, Event, RoleHeartbeat, derive_id

Prepared = tuple[str, bytes, dict[str, str]]  # (subject, payload, headers) as published


@dataclass(frozen=True)
class StreamState:
    """What the server holds of a run's stream."""

    run: str
    stream: str
    messages: int
    bytes: int
    last_seq: int


_RETRYABLE = (
    asyncio.TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.js.errors.ServiceUnavailableError,
    nats.errors.ConnectionReconnectingError,
    nats.js.errors.APIError,
)


# A JetStream request that may succeed once the cluster has (re-)elected a leader.
_LEADERLESS = (
    asyncio.TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
)
T = TypeVar("T")


@dataclass
class _Link:
    """The connection's state as its callbacks see it."""

    closing: bool = False  # set by close(): a disconnect then is expected, not news
    lost_since: float | None = None  # monotonic time of the disconnect, while reconnecting
    last_error: Exception | None = None
    reconnects: int = 0
    # Set (and replaced by a fresh one) at each reconnect: what a wait for a reply the
    # old connection may have lost watches (``Bus.reconnected``).
    reconnected: asyncio.Event = field(default_factory=asyncio.Event)

    def reconnect(self) -> None:
        self.lost_since = None
        self.reconnects += 1
        self.reconnected.set()
        self.reconnected = asyncio.Event()


class Bus:
    def __init__(
        self, nc: Client, run: str, producer: str, settings: BusSettings,
        identity: ClientCreds | None = None,
    ) -> None:  # fmt: skip
        """``identity``: the credentials ``nc`` connected with (None: anonymous); its
        key makes the header ids (``msg_id``)."""
        self.nc = nc
        self.identity = identity
        self._id_key = None if identity is None else derive_id("msg-id", identity.password)
        self.js = nc.jetstream(publish_async_max_pending=settings.publish_window)
        self.run = run
        self.producer = producer
        self.settings = settings
        self.stream = stream_name(run)
        # its own object store (an anonymous bus: the run's shared one); it reads any
        bucket = objects_bucket(run, None if identity is None else identity.kind)
        self.objects = BodyStore(self.js, bucket, replicas=settings.replicas,
                                 reconnected=lambda: self.next_reconnect)  # fmt: skip
        self.log = get_logger(run=run, role=producer)
        self.url = ""
        self.lost: ServerLost | None = None  # set by watch_server when it gives up
        self._link = _Link()

    @property
    def reconnects(self) -> int:
        """How often the connection has come back after losing its server."""
        return self._link.reconnects

    @property
    def next_reconnect(self) -> asyncio.Event:
        """An event set when the connection next comes back after losing its server
        (take it before the wait it may end)."""
        return self._link.reconnected

    @classmethod
    async def connect(
        cls,
        url: str,
        run: str,
        producer: str = "",
        settings: BusSettings | None = None,
        connect_timeout_s: float = 20.0,
        **kw: Any,
    ) -> Bus:
        """Connect to ``url`` (raises ``ServerUnreachable`` after ``connect_timeout_s``).

        ``url`` may list several servers, comma-separated (a cluster's nodes): nats-py
        connects to one and fails over to the others. Credentials and the CA that signs
        the servers' certificates come from the environment (``connect_options``)."""
        log = get_logger(run=run, role=producer)
        link = _Link()

        async def on_error(e: Exception) -> None:
            link.last_error = e
            if link.lost_since is None:  # while (re)connecting, one line says it instead
                log.warning("nats.error", error=repr(e))

        async def on_disconnect() -> None:
            if not link.closing:
                link.lost_since = link.lost_since or time.monotonic()
                log.warning("nats.disconnected", url=url)

        async def on_reconnect() -> None:
            link.reconnect()
            log.info("nats.reconnected")

        link.lost_since = time.monotonic()  # until connected: nats-py retries a refused URL
        servers = [u.strip() for u in url.split(",") if u.strip()]
        nc = Client()
        options = connect_options() | kw  # the environment's identity, unless given here
        connecting = nc.connect(
            servers,
            name=f"rlbus-{run}-{producer}",
            max_reconnect_attempts=-1,  # bounded in time by watch_server, not in attempts
            reconnect_time_wait=0.5,  # type: ignore[arg-type]  # a float works; the hint says int
            pending_size=64 * 1024 * 1024,  # large publishes survive a reconnect (NATS_NOTES #14)
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            **options,
        )
        try:
            await asyncio.wait_for(connecting, connect_timeout_s)
        except TimeoutError:
            await nc.close()  # the socket of an attempt in progress (a TLS mismatch...)
            raise ServerUnreachable(
                f"cannot reach a NATS server at {url} within {connect_timeout_s:g} s "
                f"(last error: {link.last_error!r})"
            ) from None
        link.lost_since = None
        bus = cls(nc, run, producer, settings or BusSettings(), _identity_of(options))
        bus._link = link
        bus.url = url
        return bus

    async def watch_server(self, every_s: float = 1.0) -> None:
        """Return never while the server is reachable; raise ``ServerLost`` (also kept in
        ``self.lost``) once it has been unreachable for ``settings.server_lost_s``, closing
        the connection first, so what drains afterwards fails at once instead of waiting
        on a server that is gone. Says what it waits for every 10 s meanwhile."""
        said = 0.0
        while True:
            await asyncio.sleep(every_s)
            since = self._link.lost_since
            if since is None or self._link.closing:
                said = 0.0
                continue
            lost_s = time.monotonic() - since
            if lost_s >= self.settings.server_lost_s:
                self.log.error("nats.server_lost", url=self.url, lost_s=round(lost_s, 1))
                self.lost = ServerLost(
                    f"lost the NATS server at {self.url} for {lost_s:.0f} s "
                    f"(bus.server_lost_s = {self.settings.server_lost_s:g}); exiting"
                )
                await self.nc.close()
                raise self.lost
            if lost_s - said >= 10.0:
                said = lost_s
                self.log.warning("nats.waiting_for_server", url=self.url, lost_s=round(lost_s))

    async def outage_over(self, grace_s: float = 2.0) -> None:
        """After a failure that may be the server going away: return once the connection
        is up (at the earliest after ``grace_s``, the time nats-py takes to notice a lost
        socket) or once ``watch_server`` has given up on it (``self.lost`` set). Bounded by
        ``settings.server_lost_s`` while ``watch_server`` runs."""
        settle_by = time.monotonic() + grace_s
        while self.lost is None:
            down = self._link.lost_since is not None or not self.nc.is_connected
            if not down and time.monotonic() >= settle_by:
                return
            await asyncio.sleep(0.1)

    async def api(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        """``call()`` (a JetStream API request), asked again while it times out or finds
        no leader: a cluster elects a stream's leader in seconds after losing a node or
        starting. Bounded by ``settings.publish_patience_s``; then the error is raised."""
        deadline = time.monotonic() + self.settings.publish_patience_s
        while True:
            try:
                return await call()
            except _LEADERLESS as e:
                if time.monotonic() > deadline:
                    raise
                self.log.info("jetstream.retry", what=what, error=repr(e))
                await asyncio.sleep(0.5)

    async def has_stream(self) -> bool:
        """Whether the server holds the run's stream (the run exists there)."""
        try:
            await self.api(lambda: self.js.stream_info(self.stream), "stream info")
        except nats.js.errors.NotFoundError:
            return False
        return True

    async def runs(self) -> list[str]:
        """The runs whose streams this server holds, sorted; empty when this client's
        identity may not list them (a run's identities see their own run only)."""
        return [s.run for s in await self.run_streams()]

    async def run_streams(self) -> list[StreamState]:
        """Every run's stream on this server, by run; empty when this client's identity
        may not list them."""
        try:
            infos = await self.js.streams_info()
        except (nats.errors.TimeoutError, nats.js.errors.APIError):
            return []
        found = [(run, info) for info in infos
                 if (run := run_of_stream(info.config.name or "")) is not None]  # fmt: skip
        return sorted((_state(run, info) for run, info in found), key=lambda s: s.run)

    async def stream_state(self) -> StreamState | None:
        """The run's stream as the server holds it; None when it has none."""
        try:
            info = await self.api(lambda: self.js.stream_info(self.stream), "stream info")
        except nats.js.errors.NotFoundError:
            return None
        return _state(self.run, info)

    async def last_seq(self) -> int:
        """The last sequence stored in the run's stream (0: none yet, or no stream)."""
        state = await self.stream_state()
        return 0 if state is None else state.last_seq

    async def stored(self, seq: int) -> RawStreamMsg | None:
        """The message stored at ``seq`` in the run's stream; None when there is none."""
        try:
            return await self.js.get_msg(self.stream, seq)
        except nats.js.errors.NotFoundError:
            return None

    async def consumer_backlog(self, durable: str) -> tuple[int, int] | None:
        """(waiting, in flight) on the run's durable consumer ``durable``: its pending
        and unacknowledged counts; None when it does not exist."""
        try:
            info = await self.js.consumer_info(self.stream, durable)
        except nats.js.errors.NotFoundError:
            return None
        return int(info.num_pending or 0), int(info.num_ack_pending or 0)

    def bodies(self, bucket: str | None = None) -> BodyStore:
        """The object store ``bucket`` (default: the run's own), for offloaded bodies
        and weights."""
        if bucket in (None, self.objects.bucket):
            return self.objects
        return BodyStore(self.js, bucket, reconnected=lambda: self.next_reconnect)

    async def object_stores(self) -> list[BodyStore]:
        """The run's object stores that exist (asking never creates one)."""
        out = []
        for bucket in run_buckets(self.run):
            try:
                await self.js.object_store(bucket)
            except nats.js.errors.BucketNotFoundError:
                continue
            out.append(self.bodies(bucket))
        return out

    async def live_roles(self) -> list[RoleHeartbeat]:
        """Every role instance of the run in the registry (alive, stale or stopped)."""
        return await list_roles(self.js, self.run)

    def heartbeat(
        self, role: str, instance: str, interval_s: float, *, consumer: str | None = None,
        probe: Callable[[], Awaitable[dict[str, object]]] | None = None,
    ) -> Heartbeat:  # fmt: skip
        """A heartbeat of ``role``/``instance`` in the run's registry (``start`` it)."""
        return Heartbeat(self.js, self.run, role, instance, interval_s, consumer=consumer,
                         probe=probe)  # fmt: skip

    async def delete_run(self) -> None:
        """Delete what the server holds of the run: its stream, objects and registry."""
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.js.delete_stream(self.stream)
        for bucket in run_buckets(self.run):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                await self.js.delete_object_store(bucket)
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.js.delete_key_value(roles_bucket_name(self.run))

    async def serve(self, declared: rpc.Serve) -> Served:
        """Answer the requests ``declared`` names (``bus.rpc.serve``) until the returned
        handle's ``stop``."""
        d = declared
        sub = await rpc.serve(self.nc, d.subject, d.queue, d.request_types, d.handler,
                              d.on_bad_request)  # fmt: skip
        return Served(sub)

    async def request(
        self, subject: str, req: msgspec.Struct, reply_types: Iterable[type], timeout_s: float,
        silence_s: float | None = None,
    ) -> Any:  # fmt: skip
        """One request's decoded reply (``bus.rpc.request``; ``silence_s``: with signs of
        life, ``ReplicaSilent`` when they stop, or when the connection comes back and
        nothing comes over the new one)."""
        return await rpc.request(self.nc, subject, req, reply_types, timeout_s, silence_s,
                                 reconnected=self.next_reconnect)  # fmt: skip

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Wait until the server has everything sent so far (a subscription, replies)."""
        await self.nc.flush(timeout=timeout_s)  # type: ignore[arg-type]  # a float works

    async def ensure_stream(self) -> None:
        """Create the run's stream if missing (idempotent; never changes an existing one)."""
        if await self.has_stream():
            return
        cfg = StreamConfig(
            name=self.stream,
            subjects=stream_subjects(self.run),
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            duplicate_window=self.settings.duplicate_window_s,
            num_replicas=self.settings.replicas,
        )
        try:  # asked again while a cluster elects its meta leader (a retry of a create
            # that did land finds the same stream: created, or "already in use" below)
            await self.api(lambda: self.js.add_stream(cfg), "stream create")
        except nats.js.errors.BadRequestError:
            await self.js.stream_info(self.stream)  # created concurrently by another role
        self.log.info("stream.ready", stream=self.stream)

    async def ensure_run(self) -> None:
        """Create what a run keeps on the server, each with ``settings.replicas`` copies:
        its stream, its object stores (one per kind that stores objects; an anonymous
        bus: the one shared store) and its role registry. The launcher does this before
        any role starts (roles' identities may only look them up: ``bus.auth``)."""
        from bus.registry import roles_bucket

        await self.ensure_stream()
        buckets = [self.objects.bucket] if self.identity is None else kind_buckets(self.run)
        for bucket in buckets:
            store = BodyStore(self.js, bucket, replicas=self.settings.replicas)
            await self.api(store.store, f"object store {bucket}")
        await self.api(
            lambda: roles_bucket(self.js, self.run, replicas=self.settings.replicas),
            "role registry",
        )

    # -- publishing -------------------------------------------------------------------

    async def prepare(self, event: Event) -> tuple[str, bytes, dict[str, str]]:
        """(subject, payload, headers) for ``event``, offloading a large body."""
        if event.producer == "" and self.producer:
            event = _with_producer(event, self.producer)
        payload = codec.encode(event)
        headers = codec.headers_for(event, self.msg_id(event.event_id))
        if len(payload) > self.settings.offload_threshold_bytes:
            # Named by the event and its content: a republished event whose body differs (a
            # rerun rollout) or a squatter's body under the same id never overwrites the
            # body a stored copy points at.
            digest = sha256_digest(payload)
            name = f"{codec.BODY_PREFIX}{event.event_id}.{digest.removeprefix('sha256:')[:16]}"
            await self.objects.put(name, payload)
            ref = BodyRef(
                bucket=self.objects.bucket,
                name=name,
                size=len(payload),
                digest=digest,
                schema=headers[codec.H_SCHEMA],
            )
            payload = codec.encode_any(ref)
            headers[codec.H_BODY] = "ref"
        return subject_for(event), payload, headers

    def msg_id(self, event_id: str) -> str:
        """The header id ``event_id`` is published under: keyed by this bus's identity,
        so no other identity can take it first (module docstring)."""
        return event_id if self._id_key is None else derive_id(self._id_key, event_id)

    async def publish(self, event: Event) -> PubAck:
        return (await self.publish_many([event]))[0]

    async def publish_many(self, events: Sequence[Event]) -> list[PubAck]:
        """Publish in order, pipelined; returns acks in order or raises ``PublishError``."""
        prepared = [await self.prepare(e) for e in events]
        return await self.publish_raw(prepared)

    async def publish_raw(self, prepared: Sequence[Prepared]) -> list[PubAck]:
        """Publish already prepared messages in order; acks in order, each naming where
        the message is stored (a squatted one: its salted copy, see ``_settle``)."""
        acks = await self._publish_acked(prepared)
        # Only a duplicate costs a check (a read of the stored copy): the happy path
        # stays one pipelined round trip. Checked a slice at a time, concurrently.
        dups = [i for i, a in enumerate(acks) if a.duplicate]
        for start in range(0, len(dups), _CHECKS_AT_ONCE):
            part = dups[start : start + _CHECKS_AT_ONCE]
            settled = await asyncio.gather(*(self._settle(prepared[i], acks[i]) for i in part))
            for i, ack in zip(part, settled, strict=True):
                acks[i] = ack
        return acks

    async def _settle(self, item: Prepared, ack: PubAck) -> PubAck:
        """The ack of the copy of ``item`` the stream holds, given a duplicate ``ack``.

        A duplicate ack names the stored message that holds the header id. If that is the
        same event (subject, schema, payload ``event_id``: not the whole payload, a rerun
        rollout republished under its id may differ, and the first copy wins), this is an
        ordinary duplicate. Otherwise the id was squatted: the same payload goes out under
        ``derive_id(id, "squatted", k)``, deterministic so a restarted publisher or a
        replay lands on the copy already stored, and is checked again, up to
        ``settings.squat_steps`` times."""
        subj, payload, headers = item
        mine = _identity(subj, payload, headers)
        msg_id = tried = headers.get(codec.H_MSG_ID, "")
        for k in range(1, self.settings.squat_steps + 2):
            stored = await self._stored_identity(ack)
            if stored == mine:
                return ack
            if k > self.settings.squat_steps:
                break
            self.log.error(
                "publish.squatted", subject=subj, id=tried, seq=ack.seq,
                stored_subject=stored[0], stored_schema=stored[1], stored_event_id=stored[2],
            )  # fmt: skip
            tried = derive_id(msg_id, "squatted", k)
            (ack,) = await self._publish_acked(
                [(subj, payload, {**headers, codec.H_MSG_ID: tried})]
            )
            if not ack.duplicate:
                return ack
        raise PublishError(
            f"{subj}: id {msg_id} and {self.settings.squat_steps} salted ids all hold other messages"
        )

    async def _stored_identity(self, ack: PubAck) -> _Identity:
        """(subject, schema, event id) of the message an ack points at; empty if gone."""
        try:
            msg = await self.js.get_msg(ack.stream or self.stream, ack.seq)
        except nats.js.errors.NotFoundError:
            return ("", None, None)  # deleted: nothing holds our event under that id
        except _RETRYABLE as e:
            raise PublishError(f"cannot read stored message {ack.seq} back: {e!r}") from e
        return _identity(msg.subject or "", msg.data or b"", msg.headers or {})

    async def _publish_acked(self, prepared: Sequence[Prepared]) -> list[PubAck]:
        """Publish in order, pipelined and retried; acks as the server gives them."""
        acks: list[PubAck | None] = [None] * len(prepared)
        todo = list(range(len(prepared)))
        last_error: BaseException | None = None
        started = time.monotonic()
        attempt = -1
        while True:  # at least publish_attempts tries, and for at least publish_patience_s
            attempt += 1
            tried_enough = attempt >= self.settings.publish_attempts
            if tried_enough and time.monotonic() - started >= self.settings.publish_patience_s:
                break
            if attempt:
                await asyncio.sleep(min(2.0, 0.05 * 2**attempt) * (0.5 + random.random()))
            failed: list[int] = []
            for chunk in _chunks(todo, prepared, self.settings.publish_window_bytes):
                back = self.next_reconnect  # before sending: a reconnect meanwhile counts
                futs: list[asyncio.Future[PubAck] | None] = []
                for i in chunk:
                    subj, payload, headers = prepared[i]
                    try:
                        # No Nats-Expected-Stream header: a run's subjects belong to its
                        # stream by construction, and the header costs every message.
                        futs.append(await self.js.publish_async(subj, payload, headers=headers))
                    except _RETRYABLE as e:
                        last_error = e
                        futs.append(None)
                # One bounded wait for the whole window (a wait_for per future costs every
                # message); whatever is not acked in time is retried with the same id.
                pending = [f for f in futs if f is not None]
                if pending:
                    # A reconnect ends the wait sooner: what the lost connection carried
                    # is never acked, and is retried rather than waited out (after a
                    # grace for what went over the new one).
                    await unless_stopped(
                        asyncio.wait(pending, timeout=self.settings.publish_timeout_s),
                        back, grace_s=RECONNECT_GRACE_S,
                    )  # fmt: skip
                    for f in pending:
                        if not f.done():
                            f.cancel()
                for i, fut in zip(chunk, futs, strict=True):
                    if fut is None or fut.cancelled():
                        failed.append(i)
                    elif (exc := fut.exception()) is not None:
                        if not isinstance(exc, _RETRYABLE):
                            raise exc
                        last_error = exc
                        failed.append(i)
                    else:
                        acks[i] = fut.result()
            if not failed:
                return [a for a in acks if a is not None]
            self.log.warning(
                "publish.retry", attempt=attempt + 1, failed=len(failed), error=repr(last_error)
            )
            todo = failed
        raise PublishError(
            f"{len(todo)} message(s) not acknowledged after {attempt} attempts in "
            f"{time.monotonic() - started:.0f} s: {last_error!r}"
        )

    # -- reading one message back -----------------------------------------------------

    async def payload(self, msg: Msg | RawStreamMsg) -> bytes:
        """A stream message's encoded event, its offloaded body fetched and verified."""
        data: bytes = msg.data or b""
        if (msg.headers or {}).get(codec.H_BODY) == "ref":
            ref = codec.decode_ref(data)
            data = await self.bodies(ref.bucket).get(ref.name, ref.digest)
        return data

    async def decode_msg(self, msg: Msg | RawStreamMsg, types: Iterable[type]) -> Any:
        """Decode a stream message (resolving an offloaded body) as one of ``types``."""
        schema = (msg.headers or {}).get(codec.H_SCHEMA)
        return codec.decode(await self.payload(msg), types, schema)

    async def close(self) -> None:
        if self.nc.is_closed:
            return
        self._link.closing = True
        # Draining needs a live connection: one that is reconnecting (its server gone)
        # can only be closed, and a drain that finds it so raises instead.
        if not self.nc.is_connected:
            await self.nc.close()
            return
        try:
            await asyncio.wait_for(self.nc.drain(), 10)
        except (
            TimeoutError,
            nats.errors.ConnectionClosedError,
            nats.errors.ConnectionReconnectingError,
        ):
            await self.nc.close()


class Served:
    """Requests being answered (``Bus.serve``)."""

    def __init__(self, sub: Any) -> None:
        self._sub = sub

    async def stop(self) -> None:
        """Take no more requests (those in progress still get their reply)."""
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()


def _state(run: str, info: Any) -> StreamState:
    state = info.state
    return StreamState(run, info.config.name or "", int(state.messages), int(state.bytes),
                       int(state.last_seq))  # fmt: skip


_CHECKS_AT_ONCE = 64  # duplicate acks checked concurrently

_Identity = tuple[str, str | None, str | None]  # (subject, Rl-Schema, payload event_id)


def _identity(subject: str, payload: bytes, headers: dict[str, str]) -> _Identity:
    """What makes a stored message "the same event" for the duplicate check: subject,
    schema and event id (the payload's, which readers dedup on: ``codec.stored_event_id``)."""
    return (subject, headers.get(codec.H_SCHEMA), codec.stored_event_id(payload, headers))


def _identity_of(options: dict[str, Any]) -> ClientCreds | None:
    """The credentials a connection was made with (None: anonymous)."""
    if "user" not in options:
        return None
    return ClientCreds(options["user"], options["password"], options.get("inbox_prefix", ""))


def _with_producer(event: Event, producer: str) -> Event:
    return msgspec.structs.replace(event, producer=producer)


def _chunks(todo: list[int], prepared: Sequence[Prepared], max_bytes: int) -> Iterable[list[int]]:
    """Split the publish list so no window holds more than ``max_bytes`` in flight."""
    chunk: list[int] = []
    size = 0
    for i in todo:
        n = len(prepared[i][1])
        if chunk and size + n > max_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append(i)
        size += n
    if chunk:
        yield chunk
