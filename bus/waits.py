"""Waits that an event ends: ``unless_stopped``, the one way a piece of bus work is cut
short, by a role stopping (an idle fetch, a follower's read) or by the connection coming
back after it lost its server (a publish's acks, a request, an object put or read: what
the old connection carried is never answered).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

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
