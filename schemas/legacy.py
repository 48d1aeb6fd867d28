"""Old versions of events, kept so that old logs still replay.

A breaking change to an event is a new class with a new tag; the old class moves here,
unchanged, and a pure upcaster beside it (``UPCASTERS``, applied by ``upcast``) turns it
into the current one. The log reader (``bus.reader``) decodes stored events with
``EVENT_TYPES + LEGACY_TYPES`` and upcasts them, so every reader of a run (a role
catching up, replay, the lake) sees current events only. Durable work-queue consumers
decode current types only: a legacy event there is an unknown schema, dead-lettered.

Upcasters never read the clock or the network: replay reproduces the same events from
the same bytes. The envelope (id, run, causation, timestamp, producer) is carried over
unchanged, so ids, dedup and causation chains survive the upgrade.

Each legacy class has a committed golden (``tests/golden/<name>.v<version>.msgpack``)
decoded and upcast by ``tests/unit/test_upcast.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemas.base import Event
from schemas.rollout import Trace, TraceCompleted


class TraceCompletedV0(Event, frozen=True, tag="trace_completed/0"):
    """``TraceCompleted`` before the top-level ``env`` field (the subject key) existed:
    readers took the env from ``trace.env``."""

    request_id: str
    group_size: int
    step: int
    trace: Trace


LEGACY_TYPES: tuple[type[Event], ...] = (TraceCompletedV0,)


def _envelope(event: Event) -> dict[str, Any]:
    return {
        "run": event.run,
        "event_id": event.event_id,
        "causation_id": event.causation_id,
        "ts_ns": event.ts_ns,
        "producer": event.producer,
    }


def trace_completed_v0_to_v1(old: TraceCompletedV0) -> TraceCompleted:
    """v1 added the top-level ``env`` (the subject key); it always equals ``trace.env``."""
    return TraceCompleted(
        **_envelope(old),
        env=old.trace.env,
        request_id=old.request_id,
        group_size=old.group_size,
        step=old.step,
        trace=old.trace,
    )


UPCASTERS: dict[type[Event], Callable[[Any], Event]] = {
    TraceCompletedV0: trace_completed_v0_to_v1,
}


def upcast(event: Event) -> Event:
    """The current version of ``event`` (itself when it is already current)."""
    for _ in range(16):  # a chain v0 -> v1 -> ... is short; a loop would be a bug
        step = UPCASTERS.get(type(event))
        if step is None:
            return event
        event = step(event)
    raise RuntimeError(f"upcast chain of {type(event).__name__} does not terminate")
