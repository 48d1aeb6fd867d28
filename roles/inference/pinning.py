"""Pinned versions in the inference role: eval pinning and snapshots.

Eval pinning (``EvalPinning``): a generate request may name the policy version its eval
round asks at (``GenerateRequest.pin_version``). The policy replica counts the requests
pinned to the version it serves while they are queued or generating, and holds a swap
back until none is left and ``inference.eval_pin_grace_s`` has passed since the last one,
never longer than ``inference.eval_pin_max_s`` (``PinHold``;
``weights.pin_expired`` when the bound cut a hold short), so an eval round is answered by
the version it reports. A request pinned to a newer version waits for that swap (as long
at most), and that version is loaded next; one pinned to an older version is answered
with the weights there are. Replies always carry the version that ran. Frozen models and
snapshots ignore pins.

Snapshots (``snapshot_weights``): a model of ``orchestrator.models`` with a
``policy_version`` follows the policy's announcements up to that version, then stays.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Collection, Iterator
from typing import Any

from bus.reader import first_event
from bus.runtime import Bus
from bus.subjects import Topic
from configs import RunConfig
from schemas import GenerateRequest, WeightsPublished


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


class EvalPinning:
    """One replica's eval pinning (module docstring): which version a request is served
    at, which announced version to load next, and how long a swap is held back."""

    def __init__(self, cfg: RunConfig, model_key: str, honoured: bool, log: Any) -> None:
        self.cfg = cfg
        self.model_key = model_key  # the served model: "policy" or a key of orchestrator.models
        self.honoured = honoured  # only the policy itself follows every version
        self.log = log
        inf = cfg.inference
        self.hold = PinHold(grace_s=inf.eval_pin_grace_s, max_s=inf.eval_pin_max_s)

    async def pin_of(self, req: GenerateRequest, serving: Callable[[], int]) -> int | None:
        """The version ``req`` is pinned to when this replica serves exactly it (after a
        bounded wait when it is newer than the one served), else None: a request pinned
        to an older version is answered with the weights there are, and says so."""
        pin = req.pin_version
        if pin is None or not self.honoured:
            return None
        if pin > serving():
            await self.hold.reach(pin, serving)
        return pin if pin == serving() else None

    def next_version(self, pending: Collection[int], serving: int) -> int:
        """Of the announced versions ``pending`` (not empty, all newer than ``serving``),
        the one to load next: the one pinned requests wait for, else the newest."""
        wanted = self.hold.wanted(serving) if self.honoured else None
        return wanted if wanted is not None and wanted in pending else max(pending)

    def eval_due(self, version: int) -> bool:
        """Whether the run's orchestrator evaluates ``version`` with this model: then the
        swap away from it waits for that eval's first requests (bounded)."""
        o = self.cfg.orchestrator
        return self.cfg.evaluates(version) and o.actor == self.model_key

    async def hold_swap(self, serving: int, version: int) -> float:
        """Hold the swap from ``serving`` to ``version`` while requests pinned to
        ``serving`` run (``PinHold.clear``, bounded by ``inference.eval_pin_max_s``); the
        seconds held. Pinned requests still running when the bound is hit get the new
        weights, and their replies say so."""
        if not self.honoured:
            return 0.0
        expect_s = self.cfg.inference.eval_pin_expect_s if self.eval_due(serving) else 0.0
        held_s = await self.hold.clear(serving, expect_s)
        if left := self.hold.running(serving):
            self.log.warning(
                "weights.pin_expired", serving=serving, version=version, pinned=left,
                held_s=round(held_s, 3),
            )  # fmt: skip
        return held_s


async def snapshot_weights(
    bus: Bus, pin: int | None, latest: WeightsPublished
) -> WeightsPublished | None:
    """A snapshot's weights: ``latest`` while the policy has not passed the pinned
    version ``pin`` (None: no snapshot), else that version's announcement (the trainer
    keeps its weights)."""
    if pin is None or latest.version <= pin:
        return latest
    found: WeightsPublished | None = await first_event(
        bus, Topic.WEIGHTS_PUBLISHED, (WeightsPublished,), lambda e: e.version == pin
    )
    return found
