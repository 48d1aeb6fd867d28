"""Request/reply over core NATS with queue groups (inference traffic; not stored).

``serve`` answers requests on a subject in a queue group, so replicas share the load;
each request is handled in its own task, so a handler may batch concurrent requests. A
role declares what it answers as a ``Serve`` beside its other inputs; the runtime
(``roles.runtime.role``) serves it while the role runs.
``request`` sends one and decodes the reply, raising ``RequestTimeout`` when nobody
answers in time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from bus import codec
from bus.errors import DecodeError, NoResponders, RequestTimeout
from bus.log import get_logger

log = get_logger()

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
        reply = await handler(request)
        if msg.reply:
            await msg.respond(codec.encode_any(reply))

    async def on_msg(msg: Msg) -> None:
        task = asyncio.create_task(answer(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    return await nc.subscribe(subject, queue=queue, cb=on_msg, pending_msgs_limit=100_000)


async def request(
    nc: Client, subject: str, message: msgspec.Struct, reply_types: Iterable[type], timeout_s: float
) -> Any:
    try:
        msg = await nc.request(subject, codec.encode_any(message), timeout=timeout_s)
    except (TimeoutError, nats.errors.TimeoutError) as e:
        raise RequestTimeout(f"no reply on {subject} within {timeout_s}s") from e
    except nats.errors.NoRespondersError as e:
        raise NoResponders(f"no responders on {subject}") from e
    return codec.decode(msg.data, tuple(reply_types))
