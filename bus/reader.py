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
import nats.js.errors
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
    until_seq: int | None = None,
) -> AsyncIterator[Any]:
    """Every event on ``topics`` ((topic, key or None) pairs) stored so far, in stream order.

    Undecodable entries are logged and stepped over (the durable consumer that owns them
    dead-letters them). With ``with_seq`` it yields ``(stream_seq, event)`` pairs. With
    ``until_seq`` it stops after that sequence, and a stall before it is a ``TimeoutError``
    (those messages are known to exist). Close it with ``contextlib.aclosing`` if you
    break out early, so its consumer is removed at once.
    """
    if until_seq is not None and until_seq < from_seq:
        return
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
            except (TimeoutError, nats.errors.TimeoutError) as e:
                if until_seq is not None:
                    raise TimeoutError(f"reading {filters} up to seq {until_seq} stalled") from e
                return  # nothing (more) at or after from_seq
            seq = msg.metadata.sequence.stream
            try:
                event = await bus.decode_msg(msg, types)
                yield (seq, event) if with_seq else event
            except (DecodeError, BodyError) as e:
                bus.log.warning("log.undecodable", subject=msg.subject, error=str(e))
            if msg.metadata.num_pending == 0 or (until_seq is not None and seq >= until_seq):
                return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def last_seq(bus: Bus, topic: Topic, key: str | None = None) -> int:
    """Stream sequence of the newest message on ``topic`` (0 when there is none)."""
    try:
        msg = await bus.js.get_last_msg(bus.stream, filter_subject(bus.run, topic, key))
    except nats.js.errors.NotFoundError:
        return 0
    return int(msg.seq or 0)


async def last_event(
    bus: Bus, topic: Topic, types: tuple[type, ...], key: str | None = None
) -> Any:
    """The newest event on ``topic`` (decoded, offloaded body resolved), or None."""
    try:
        msg = await bus.js.get_last_msg(bus.stream, filter_subject(bus.run, topic, key))
    except nats.js.errors.NotFoundError:
        return None
    return await bus.decode_msg(msg, types)
