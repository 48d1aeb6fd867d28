"""Old versions of events, kept so that old logs still replay.

A breaking change to an event is a new class with a new tag; the old class moves here,
unchanged, and ``replay.upcast`` turns it into the current one. Readers of stored logs
(``replay.log``) decode with ``EVENT_TYPES + LEGACY_TYPES`` and upcast; live roles only
ever decode current types, so a legacy event on a live consumer is an unknown schema.

Each legacy class has a committed golden (``tests/golden/<name>.v<version>.msgpack``)
decoded and upcast by ``tests/unit/test_upcast.py``.
"""

from __future__ import annotations

from schemas.base import Event
from schemas.rollout import Trace


class TraceCompletedV0(Event, frozen=True, tag="trace_completed/0"):
    """``TraceCompleted`` before the top-level ``env`` field (the subject key) existed:
    readers took the env from ``trace.env``."""

    request_id: str
    group_size: int
    step: int
    trace: Trace


LEGACY_TYPES: tuple[type[Event], ...] = (TraceCompletedV0,)
