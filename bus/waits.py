"""Waits that an event ends: ``unless_stopped``, the one way a piece of bus work is cut
short, by a role stopping (an idle fetch, a follower's read) or by the connection coming
back after it lost its server (a publish's acks, a request, an object put or read: what
the old connection carried is never answered); and ``retry_transient``, the bounded
retry of a call that failed for a reason that says nothing about what it asked for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from bus.errors import TRANSIENT_ERRORS

T = TypeVar("T")


async def unless_stopped(
    work: Awaitable[T], *stops: asyncio.Event, grace_s: float = 0.0
) -> asyncio.Future[T] | None:
    """Run ``work`` until it completes (its finished future: ``result()`` returns or
    raises what it did) or until one of ``stops`` is set first and ``grace_s`` more have
    passed (None: ``work`` is cancelled). A caller cancelled meanwhile cancels ``work``
    too, and the cancellation goes on (it is never read as a stop)."""
    task = asyncio.ensure_future(work)
    watchers = [asyncio.ensure_future(e.wait()) for e in stops]
    try:
        await asyncio.wait({task, *watchers}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and grace_s > 0:
            await asyncio.wait({task}, timeout=grace_s)
    except BaseException:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise
    finally:
        for w in watchers:
            w.cancel()
    if task.done():
        return task
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # (passes a cancellation on)
    return None


async def _sleep(seconds: float) -> bool:
    await asyncio.sleep(seconds)
    return False


async def retry_transient(
    call: Callable[[], Awaitable[T]],
    *,
    attempts: int,
    backoff_s: float,
    on_retry: Callable[[int, float, Exception], None],
    sleep: Callable[[float], Awaitable[bool]] = _sleep,
) -> T:
    """``call()``, tried up to ``attempts`` times while it fails with one of
    ``bus.errors.TRANSIENT_ERRORS`` (a digest mismatch, a missing object or a non-finite
    tensor is not transient), waiting ``backoff_s`` and twice as long after each try.

    ``on_retry(attempt, delay_s, error)`` is told before each wait; ``sleep(s)`` returning
    True (the role is stopping) gives up at once. Any other error, or the last transient
    one, is raised: bounded, so a server that stays away still ends in an answer.
    """
    attempt = 1
    while True:
        try:
            return await call()
        except TRANSIENT_ERRORS as e:
            if attempt >= attempts:
                raise
            delay = backoff_s * 2 ** (attempt - 1)
            on_retry(attempt, delay, e)
            if await sleep(delay):
                raise
            attempt += 1
