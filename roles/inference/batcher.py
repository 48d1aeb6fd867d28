"""Gather concurrent requests into batches and run each batch in a worker thread.

Requests arrive one per RPC task. The first request to arrive opens a window of
``batch_window_ms``; everything that arrives before it closes (up to ``max_batch_size``)
runs as ONE batch via ``asyncio.to_thread``, so the event loop keeps receiving requests
(and heartbeats) while the model computes. Requests that queued up while a batch ran
start the next batch at once: their window has long expired.

Batches run one at a time under ``lock``. Anything else that must not overlap a batch
(a weights swap) takes the same lock, and therefore happens between two batches, never
in the middle of one. asyncio.Lock is fair (FIFO), so a swap waits for at most the
running batch.

    batcher = Batcher(run_batch, max_batch_size=64, batch_window_ms=5)
    result = await batcher.submit(request)    # from many tasks at once

Beside it: ``throughput`` (rates from two snapshots of a backend's counters, for the
role's metrics) and ``PinHold`` (what holds a weights swap back while an eval's pinned
requests run).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")
R = TypeVar("R")

# run_batch(items, queue_s) -> one result per item, in order; queue_s[i] is how long
# item i waited between submit and the start of its batch.
RunBatch = Callable[[list[T], list[float]], Sequence[R]]


class BatcherClosed(RuntimeError):
    """The batcher was closed before this request ran."""


@dataclass
class BatchStats:
    """Cumulative counters (read by metrics; written only by the batch loop)."""

    batches: int = 0
    items: int = 0
    largest_batch: int = 0
    busy_s: float = 0.0  # time spent running batches
    queue_s: float = 0.0  # summed waiting time of all items
    sizes: list[int] = field(default_factory=list)  # last few batch sizes, for debugging

    def record(self, size: int, busy_s: float, queue_s: float) -> None:
        self.batches += 1
        self.items += size
        self.largest_batch = max(self.largest_batch, size)
        self.busy_s += busy_s
        self.queue_s += queue_s
        self.sizes = [*self.sizes[-31:], size]


@dataclass
class _Pending(Generic[T, R]):
    item: T
    enqueued: float
    future: asyncio.Future[R]


class Batcher(Generic[T, R]):
    def __init__(
        self,
        run_batch: RunBatch[T, R],
        *,
        max_batch_size: int = 64,
        batch_window_ms: float = 5.0,
        lock: asyncio.Lock | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self._run_batch = run_batch
        self.max_batch_size = max_batch_size
        self.window_s = max(0.0, batch_window_ms) / 1000.0
        self.lock = lock or asyncio.Lock()
        self.stats = BatchStats()
        self._pending: deque[_Pending[T, R]] = deque()
        self._arrived = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    # -- submitting ---------------------------------------------------------------------

    async def submit(self, item: T) -> R:
        return (await self.submit_many([item]))[0]

    async def submit_many(self, items: Sequence[T]) -> list[R]:
        """Queue ``items`` (they may land in different batches) and await their results."""
        if self._closed:
            raise BatcherClosed("batcher is closed")
        self._ensure_running()
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        pending = [_Pending(item, now, loop.create_future()) for item in items]
        self._pending.extend(pending)
        self._idle.clear()
        self._arrived.set()
        return list(await asyncio.gather(*(p.future for p in pending)))

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._loop(), name="batcher")

    # -- the loop -----------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            while not self._pending:
                self._idle.set()
                self._arrived.clear()
                await self._arrived.wait()
            await self._fill_window()
            n = min(len(self._pending), self.max_batch_size)
            batch = [self._pending.popleft() for _ in range(n)]
            await self._run(batch)

    async def _fill_window(self) -> None:
        """Wait until the oldest request's window closes or the batch is full."""
        deadline = self._pending[0].enqueued + self.window_s
        while len(self._pending) < self.max_batch_size:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._arrived.wait()

    async def _run(self, batch: list[_Pending[T, R]]) -> None:
        live = [p for p in batch if not p.future.done()]  # a cancelled caller needs no answer
        if not live:
            return
        async with self.lock:
            start = time.perf_counter()
            waited = [start - p.enqueued for p in live]
            try:
                results = await asyncio.to_thread(self._run_batch, [p.item for p in live], waited)
                if len(results) != len(live):
                    raise RuntimeError(f"batch returned {len(results)} results for {len(live)}")
            except Exception as e:  # noqa: BLE001 - every caller of the batch gets the error
                for p in live:
                    if not p.future.done():
                        p.future.set_exception(e)
                return
            finally:
                self.stats.record(len(live), time.perf_counter() - start, sum(waited))
        for p, r in zip(live, results, strict=True):
            if not p.future.done():
                p.future.set_result(r)

    # -- shutting down ------------------------------------------------------------------

    async def close(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests, finish the queued ones (up to ``timeout_s``), then stop."""
        self._closed = True
        if self._task is not None and not self._task.done():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._idle.wait()
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        while self._pending:
            p = self._pending.popleft()
            if not p.future.done():
                p.future.set_exception(BatcherClosed("batcher closed before the request ran"))


# -- metrics -----------------------------------------------------------------------------


def throughput(prev: dict[str, float], cur: dict[str, float], dt: float) -> dict[str, float] | None:
    """Rates over one interval from two cumulative ``Backend.stats()``; None when idle."""

    def delta(key: str) -> float:
        return cur.get(key, 0.0) - prev.get(key, 0.0)

    requests = delta("generate_requests") + delta("score_requests")
    if requests <= 0 or dt <= 0:
        return None
    values = {
        "tokens_per_s": delta("completion_tokens") / dt,
        "prompt_tokens_per_s": delta("prompt_tokens") / dt,
        "requests_per_s": requests / dt,
        "failed_requests": delta("failed_requests"),
    }
    if (batches := delta("batches")) > 0:
        items = delta("batched_items")
        values["batch_size_mean"] = items / batches
        values["queue_s_mean"] = delta("queue_s") / max(items, 1.0)
        values["busy_frac"] = delta("busy_s") / dt
    return values


# -- eval pinning -------------------------------------------------------------------------


class PinHold:
    """Holds a weights swap back while requests pinned to the serving version run.

    An eval round asks at one policy version (``GenerateRequest.pin_version``); if a
    replica swapped weights halfway, most of the round would be answered by later
    versions and the figure reported "at vN" would not be vN's. So each pinned request is
    counted while it is queued or generating (``pinned``), and the swap waits
    (``clear``) until none pinned to the old version is left and ``grace_s`` has passed
    since the last one ended (the gap between an eval's turns and groups), for at most
    ``max_s``: training is delayed by a bounded amount, never stalled. A request pinned to
    a version newer than the one served waits for that swap (``reach``), at most
    ``max_s`` after the first request pinned to it arrived; the replica loads that version
    next (``wanted``) even when newer ones are announced.

        hold = PinHold(grace_s=0.5, max_s=15.0)
        with hold.pinned(version):             # around answering a pinned request
            ...
        held_s = await hold.clear(version)     # before swapping version out
        held_s = await hold.clear(version, expect_s=3.0)  # ... an eval of it is due
        hold.swapped(new_version)              # after a swap (wakes ``reach``)
    """

    def __init__(
        self, *, grace_s: float, max_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.grace_s = max(0.0, grace_s)
        self.max_s = max(0.0, max_s)
        self._clock = clock
        self._running: dict[int, int] = {}  # version -> pinned requests queued or running
        self._last_end: dict[int, float] = {}  # version -> when its last one ended
        self._first_ask: dict[int, float] = {}  # newer version -> when it was first awaited
        self._waiting: dict[int, int] = {}  # newer version -> requests waiting for it now
        self._refused: set[int] = set()  # versions this replica refused: never reached
        self._changed = asyncio.Event()

    def running(self, version: int) -> int:
        """Requests pinned to ``version`` now queued or generating."""
        return self._running.get(version, 0)

    @contextlib.contextmanager
    def pinned(self, version: int) -> Iterator[None]:
        """Count a request pinned to ``version`` for as long as the block runs."""
        self._running[version] = self.running(version) + 1
        try:
            yield
        finally:
            left = self._running.pop(version) - 1
            if left:
                self._running[version] = left
            self._last_end[version] = self._clock()
            self._notify()

    async def clear(self, version: int, expect_s: float = 0.0) -> float:
        """Wait until ``version`` may be swapped out (class docstring); the seconds held.
        ``expect_s`` > 0: an eval of ``version`` is due (``RunConfig.evaluates``), so hold
        it until its first pinned request has come (for at most ``expect_s``), then by
        the rule above: eval requests can reach the replica after the next version is
        announced (the env servers had train groups queued before them)."""
        start = self._clock()
        deadline = start + self.max_s
        expected = start + min(expect_s, self.max_s)
        while (now := self._clock()) < deadline:
            if self.running(version):
                until = deadline
            elif version not in self._last_end and now < expected:
                until = expected
            else:
                until = min(self._last_end.get(version, -math.inf) + self.grace_s, deadline)
                if now >= until:
                    break
            await self._wait(until - now)
        return self._clock() - start

    async def reach(self, version: int, serving: Callable[[], int]) -> bool:
        """Wait until ``serving()`` is at least ``version``, for at most ``max_s`` after
        the first request pinned to it came; whether it got there."""
        first = self._first_ask.setdefault(version, self._clock())
        self._waiting[version] = self._waiting.get(version, 0) + 1
        try:
            while serving() < version:
                left = first + self.max_s - self._clock()
                if left <= 0 or version in self._refused:
                    return False
                await self._wait(left)
            return True
        finally:
            self._waiting[version] -= 1
            if not self._waiting[version]:
                del self._waiting[version]

    def wanted(self, serving: int) -> int | None:
        """The oldest version newer than ``serving`` that requests wait for (``reach``):
        the one to load next, so that their eval is answered by it."""
        return min((v for v in self._waiting if v > serving), default=None)

    def swapped(self, serving: int) -> None:
        """Weights ``serving`` serve now (or a swap was refused): wake the waiters of
        ``reach`` and forget what was kept for older versions."""
        for v in [v for v in self._first_ask if v <= serving]:
            del self._first_ask[v]
        for v in [v for v in self._last_end if v < serving]:
            del self._last_end[v]
        self._notify()

    def refused(self, version: int) -> None:
        """The replica refused weights ``version`` (not finite, unreadable): requests
        waiting for it are served with what it has."""
        self._refused.add(version)
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, timeout_s)):
                await self._changed.wait()
