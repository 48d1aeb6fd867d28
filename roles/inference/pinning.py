"""Pinned versions in the inference role: eval pinning and snapshots.

Eval pinning (``EvalPinning``): a generate request may name the policy version its eval
round asks at (``GenerateRequest.pin_version``). The policy replica counts the requests
pinned to the version it serves while they are queued or generating, and holds a swap
back until none is left and ``inference.eval_pin_grace_s`` has passed since the last one,
never longer than ``inference.eval_pin_max_s`` (``batcher.PinHold``;
``weights.pin_expired`` when the bound cut a hold short), so an eval round is answered by
the version it reports. A request pinned to a newer version waits for that swap (as long
at most), and that version is loaded next; one pinned to an older version is answered
with the weights there are. Replies always carry the version that ran. Frozen models and
snapshots ignore pins.

Snapshots (``snapshot_weights``): a model of ``orchestrator.models`` with a
``policy_version`` follows the policy's announcements up to that version, then stays.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from bus.reader import first_event
from bus.runtime import Bus
from bus.subjects import Topic
from configs import RunConfig
from roles.inference.batcher import PinHold
from schemas import GenerateRequest, WeightsPublished


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
