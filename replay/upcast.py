"""Upcasters: pure functions turning a legacy event into the current version of it.

    from replay.upcast import upcast
    event = upcast(decoded)      # current events pass through unchanged

One function per legacy version, registered in ``UPCASTERS`` by the legacy class; an
upcaster may return another legacy event, and ``upcast`` applies them until the event
is current. Upcasters never read the clock or the network: replay reproduces the same
events from the same bytes. The envelope (id, run, causation, timestamp, producer) is
carried over unchanged, so ids, dedup and causation chains survive the upgrade.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemas import Event, TraceCompleted
from schemas.legacy import TraceCompletedV0


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
