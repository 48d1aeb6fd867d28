"""Waits that an event ends (``bus.waits.unless_stopped``, no server needed): what they do
with their work when the event comes, after a grace, or when their caller is cancelled;
and the object store starting a put or read again after a reconnect."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bus.offload import BodyStore
from bus.waits import unless_stopped


def sleeper(log: list[str], s: float = 100.0) -> Any:
    async def work() -> str:
        log.append("started")
        try:
            await asyncio.sleep(s)
        except asyncio.CancelledError:
            log.append("cancelled")
            raise
        return "done"

    return work


async def test_work_ends_with_an_event_after_its_grace_and_with_its_caller() -> None:
    log: list[str] = []
    # Finished first: its future.
    done = await unless_stopped(sleeper(log, 0.0)(), asyncio.Event())
    assert done is not None and done.result() == "done"
    # Any of the events set first: cancelled, None.
    stop, back = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(unless_stopped(sleeper(log)(), stop, back))
    await asyncio.sleep(0.01)
    back.set()
    assert await task is None
    assert log == ["started", "started", "cancelled"]
    # With a grace, work that finishes within it is kept.
    back = asyncio.Event()
    back.set()
    kept = await unless_stopped(sleeper(log, 0.05)(), back, grace_s=1.0)
    assert kept is not None and kept.result() == "done"
    # The caller cancelled: so is the work, and the cancellation goes on.
    task = asyncio.create_task(unless_stopped(sleeper(log)(), asyncio.Event()))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log[-2:] == ["started", "cancelled"]


async def test_the_object_store_starts_work_again_when_the_connection_comes_back() -> None:
    back = asyncio.Event()
    store = BodyStore(None, "b", reconnected=lambda: back)  # type: ignore[arg-type]
    log: list[str] = []
    tries = iter([sleeper(log), sleeper(log, 0.0)])
    task = asyncio.create_task(store._again_on_reconnect(lambda: next(tries)()))
    await asyncio.sleep(0.01)
    back.set()  # the first try is cut off after the grace; the second one finishes
    assert await task == "done"
    assert log == ["started", "cancelled", "started"]
