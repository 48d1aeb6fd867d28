"""What a wait that a reconnect may end does with its work (no server needed): the
object store's put and read (``BodyStore._unless_reconnected``) and a request's next
message (``bus.rpc._next``)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from bus import rpc
from bus.offload import BodyStore, _Reconnected


def sleeper(log: list[str]) -> Any:
    async def work() -> str:
        log.append("started")
        try:
            await asyncio.sleep(100)
        except asyncio.CancelledError:
            log.append("cancelled")
            raise
        return "done"

    return work


async def test_a_put_or_read_cut_off_by_a_reconnect_or_a_cancelled_caller_stops_its_work() -> None:
    back = asyncio.Event()
    store = BodyStore(None, "b", reconnected=lambda: back)  # type: ignore[arg-type]
    log: list[str] = []
    # The caller is cancelled: so is the work, and the cancellation is not a reconnect.
    task = asyncio.create_task(store._unless_reconnected(sleeper(log)()))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert log == ["started", "cancelled"]
    # The connection comes back: after the grace the work is cancelled, to start again.
    task = asyncio.create_task(store._unless_reconnected(sleeper(log)()))
    await asyncio.sleep(0.01)
    back.set()
    with pytest.raises(_Reconnected):
        await task
    assert log == ["started", "cancelled", "started", "cancelled"]


class Inbox:
    def __init__(self) -> None:
        self.waiting: list[str] = []

    async def next_msg(self, timeout: float) -> str:
        self.waiting.append("waiting")
        try:
            await asyncio.sleep(timeout)
        except asyncio.CancelledError:
            self.waiting.append("cancelled")
            raise
        raise TimeoutError


async def test_a_request_waiting_when_the_connection_comes_back_stops_listening() -> None:
    back = asyncio.Event()
    inbox = Inbox()
    waiter = asyncio.ensure_future(back.wait())
    task = asyncio.create_task(rpc._next(inbox, 100, waiter))
    await asyncio.sleep(0.01)
    back.set()
    with pytest.raises(rpc._Reconnected):
        await task
    assert inbox.waiting == ["waiting", "cancelled"]
    # A caller cancelled while it waits leaves no read behind either.
    never = asyncio.ensure_future(asyncio.Event().wait())
    task = asyncio.create_task(rpc._next(inbox, 100, never))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    never.cancel()
    assert inbox.waiting[-2:] == ["waiting", "cancelled"]
