"""Request/reply over core NATS with queue groups (inference traffic; not stored).

``serve`` answers requests on a subject in a queue group, so replicas share the load;
each request is handled in its own task, so a handler may batch concurrent requests. A
role declares what it answers as a ``Serve`` beside its other inputs; the runtime
(``roles.runtime.role``) serves it while the role runs.
``request`` sends one and decodes the reply, raising ``RequestTimeout`` when nobody
answers in time.

**Signs of life.** A replica that dies holding a request never answers, and nothing in
core NATS says so: a plain request waits its whole timeout. So a requester may ask for
signs of life (``silence_s``): the request carries ``Rl-Keepalive: <seconds>``, and the
server that takes it sends an empty ``Rl-Working`` message to the reply subject at once
and then every that many seconds while the handler works (``silence_s / 3``). The
requester waits on its own inbox: a working message renews its patience, the reply
ends the wait, and ``silence_s`` without either raises ``ReplicaSilent`` (the replica
died, or the server lost the request), so the caller sends it again at once instead of
after its attempt timeout. A handler that fails stops its signs of life too. A request
that asks for none is answered exactly as before. When the requester's connection loses
its server and comes back meanwhile, the request (or its reply) may have gone with the
old connection: if nothing comes over the new one within one keepalive interval
(``silence_s / 3``) plus ``RECONNECT_GRACE_S`` (a replica still working on it says so in
that time), the same ``ReplicaSilent`` says to send it again (a restarted server then
costs ~0.9 s with the default 2 s, not ``silence_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus import codec
from bus.errors import DecodeError, NoResponders, ReplicaSilent, RequestTimeout
from bus.log import get_logger
from bus.settings import RECONNECT_GRACE_S
from bus.waits import unless_stopped

log = get_logger()

H_KEEPALIVE = "Rl-Keepalive"  # on a request: send signs of life every <value> seconds
H_WORKING = "Rl-Working"  # a sign of life: the request is being worked on
_STATUS, _NO_RESPONDERS = "Status", "503"  # nats-py's header of a server status message

Handler = Callable[[Any], Awaitable[msgspec.Struct]]


@dataclass(frozen=True)
class Serve:
    """Requests a role answers, declared next to its handler: on ``subject`` in queue
    group ``queue``, decoded as one of ``request_types``; ``on_bad_request`` builds the
    reply to one that does not decode (none: no reply, the caller times out)."""

    subject: str
    queue: str
    request_types: tuple[type, ...]
    handler: Handler
    on_bad_request: Callable[[bytes, Exception], msgspec.Struct] | None = None


async def serve(
    nc: Client,
    subject: str,
    queue: str,
    request_types: Iterable[type],
    handler: Callable[[Any], Awaitable[msgspec.Struct]],
    on_bad_request: Callable[[bytes, Exception], msgspec.Struct] | None = None,
) -> Subscription:
    types = tuple(request_types)
    tasks: set[asyncio.Task[None]] = set()

    async def answer(msg: Msg) -> None:
        try:
            request = codec.decode(msg.data, types)
        except DecodeError as e:
            log.warning("rpc.bad_request", subject=subject, error=str(e))
            if on_bad_request is not None and msg.reply:
                await msg.respond(codec.encode_any(on_bad_request(msg.data, e)))
            return
        every = _keepalive_of(msg)
        alive = asyncio.create_task(_signs_of_life(nc, msg.reply, every)) if every else None
        try:
            reply = await handler(request)
        finally:
            if alive is not None:
                alive.cancel()
        if msg.reply:
            await msg.respond(codec.encode_any(reply))

    async def on_msg(msg: Msg) -> None:
        task = asyncio.create_task(answer(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return await nc.subscribe(subject, queue=queue, cb=on_msg, pending_msgs_limit=100_000)


def _keepalive_of(msg: Msg) -> float | None:
    """The interval of signs of life a request asks for (None: none, or no reply)."""
    value = (msg.headers or {}).get(H_KEEPALIVE)
    if not value or not msg.reply:
        return None
    try:
        every = float(value)
    except ValueError:
        return None
    return every if every > 0 else None


async def _signs_of_life(nc: Client, reply: str, every: float) -> None:
    """Tell ``reply`` the request is being worked on, now and every ``every`` seconds."""
    while True:
        try:
            await nc.publish(reply, b"", headers={H_WORKING: "1"})
        except Exception as e:  # noqa: BLE001 - a lost connection: the requester sees silence
            log.debug("rpc.keepalive_failed", error=repr(e))
            return
        await asyncio.sleep(every)


async def request(
    nc: Client,
    subject: str,
    message: msgspec.Struct,
    reply_types: Iterable[type],
    timeout_s: float,
    silence_s: float | None = None,
    reconnected: asyncio.Event | None = None,
) -> Any:
    """The decoded reply to ``message`` on ``subject`` within ``timeout_s``; with
    ``silence_s``, ``ReplicaSilent`` as soon as the server holding it says nothing for
    that long (module docstring), or, when ``reconnected`` is set meanwhile (the
    connection lost its server and came back), as soon as nothing comes within a
    keepalive interval and ``RECONNECT_GRACE_S`` after: the request or its reply may have
    gone with the old connection, so it is asked again rather than after ``silence_s``."""
    if silence_s is not None:
        return await _watched_request(nc, subject, message, tuple(reply_types), timeout_s,
                                      silence_s, reconnected)  # fmt: skip
    try:
        msg = await nc.request(subject, codec.encode_any(message), timeout=timeout_s)
    except (TimeoutError, nats.errors.TimeoutError) as e:
        raise RequestTimeout(f"no reply on {subject} within {timeout_s}s") from e
    except nats.errors.NoRespondersError as e:
        raise NoResponders(f"no responders on {subject}") from e
    return codec.decode(msg.data, tuple(reply_types))


async def _watched_request(
    nc: Client,
    subject: str,
    message: msgspec.Struct,
    reply_types: tuple[type, ...],
    timeout_s: float,
    silence_s: float,
    reconnected: asyncio.Event | None = None,
) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    inbox = nc.new_inbox()  # under this identity's inbox prefix
    sub = await nc.subscribe(inbox)
    watching = reconnected  # None once the grace after a reconnect is given
    try:
        headers = {H_KEEPALIVE: f"{silence_s / 3:.3g}"}
        await nc.publish(subject, codec.encode_any(message), reply=inbox, headers=headers)
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise RequestTimeout(f"no reply on {subject} within {timeout_s}s")
            wait, lost = min(left, silence_s), ""
            if watching is not None and watching.is_set():  # came back: a grace, once,
                # long enough for a live replica's next sign of life (silence_s / 3)
                watching, lost = None, " with the connection"
                wait = min(wait, silence_s / 3 + RECONNECT_GRACE_S)
            try:
                if watching is None:
                    msg = await sub.next_msg(timeout=wait)
                elif (got := await unless_stopped(sub.next_msg(timeout=wait), watching)) is None:
                    continue  # the connection came back first
                else:
                    msg = got.result()
            except (TimeoutError, nats.errors.TimeoutError):
                if loop.time() >= deadline:
                    raise RequestTimeout(f"no reply on {subject} within {timeout_s}s") from None
                raise ReplicaSilent(
                    f"no sign of life on {subject} for {wait:g} s (the replica holding "
                    f"the request is gone, or the request was lost{lost})"
                ) from None
            h = msg.headers or {}
            if h.get(_STATUS) == _NO_RESPONDERS and not msg.data:
                raise NoResponders(f"no responders on {subject}")
            if H_WORKING in h:
                continue
            return codec.decode(msg.data, reply_types)
    finally:
        with contextlib.suppress(Exception):  # a closed connection has nothing to undo
            await sub.unsubscribe()
