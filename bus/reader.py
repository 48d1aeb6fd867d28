"""Reading a run's stored log in order (ordered push consumer, NATS_NOTES #11).

``read_log`` yields every event stored so far on the given topics, decoded, in stream
order, and returns once it has caught up: the fold that rebuilds a role's state at start
(algorithm workers, the trainer's catch-up), and the base of replay and the lake.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import nats.errors
from nats.js.api import ConsumerConfig, DeliverPolicy

from bus.errors import BodyError, DecodeError
from bus.runtime import Bus
from bus.subjects import Topic, filter_subject


async def read_log(
    bus: Bus,
    topics: Sequence[tuple[Topic, str | None]],
    types: tuple[type, ...],
    from_seq: int = 1,
    stall_timeout_s: float = 10.0,
    with_seq: bool = False,
) -> AsyncIterator[Any]:
    """Every event on ``topics`` ((topic, key or None) pairs) stored so far, in stream order.

    Undecodable entries are logged and stepped over (the durable consumer that owns them
    dead-letters them). With ``with_seq`` it yields ``(stream_seq, event)`` pairs.
    """
    filters = [filter_subject(bus.run, t, k) for t, k in topics]
    stored = 0
    for f in filters:
        info = await bus.js.stream_info(bus.stream, subjects_filter=f)
        stored += sum((info.state.subjects or {}).values())
    if not stored:
        return  # nothing to read: do not wait for a message that will never come
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=max(1, from_seq),
        filter_subjects=filters,
    )
    sub = await bus.js.subscribe("", ordered_consumer=True, config=config, stream=bus.stream)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=stall_timeout_s)
            except (TimeoutError, nats.errors.TimeoutError):
                return  # nothing (more) at or after from_seq
            try:
                event = await bus.decode_msg(msg, types)
                yield (msg.metadata.sequence.stream, event) if with_seq else event
            except (DecodeError, BodyError) as e:
                bus.log.warning("log.undecodable", subject=msg.subject, error=str(e))
            if msg.metadata.num_pending == 0:
                return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
