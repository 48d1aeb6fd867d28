"""The second consumer kind: a follower of the log, declared next to its handler.

    Follow("orchestrator", [(Topic.RUN_STARTED, None), ...], self.on_event)      # from seq 1
    Follow("weights", [(Topic.WEIGHTS_PUBLISHED, None)], self.on_weights, start="last")

A durable ``Subscription`` (``bus.consumer``) shares work between replicas and keeps a
position on the server; a follower keeps none. It reads the log in order through the
one log reader (``bus.reader.LogReader``: an ordered push consumer, legacy versions
upcast) from a sequence, from the newest message (``start="last"``) or from new
messages only (``start="new"``), and calls its handler on every event. The handler
returns what the event caused, exactly like a durable handler (a list of events or
``bus.consumer.Effects``); the runtime publishes it, then runs the after-publish hook.
There is nothing to ack: a restarted follower reads the log again, and the events it
re-derives carry the same ids, which the server drops as duplicates.

A message the follower cannot decode (garbage, an unknown schema, a missing body) is
dead-lettered and stepped over (``on_undecodable="dead_letter"``, the default): a
``DeadLettered`` event records it with the error, its id derived from the follower's
name and the message's sequence, so a restarted follower (or a replay of the same log)
steps over exactly the same messages and records each once (the stream drops the repeat).
An event the handler refuses (it raises ``bus.errors.Rejected``: a value its fold cannot
take) is dead-lettered the same way, whatever ``on_undecodable`` says, since the handler
asked for it. One bad message never stops a fold. ``"skip"`` only logs an undecodable one (a follower that reads from
the newest message, whose durable owner dead-letters it); ``"raise"`` fails the follower.
Roles declare followers in ``Role.subscriptions()``, and ``serve_role`` runs them beside
the durables.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Literal

from nats.aio.msg import Msg

from bus.consumer import Delivery, Handler, commit, dead_lettered
from bus.errors import BodyError, DecodeError, Rejected
from bus.reader import LogReader, Topics, stored_event
from bus.runtime import Bus


@dataclass
class Follow:
    """An ordered follower of the log declared next to its handler (no durable state)."""

    name: str
    topics: Topics
    handler: Handler
    from_seq: int = 1
    start: Literal["last", "new"] | None = None  # instead of from_seq
    on_undecodable: Literal["dead_letter", "skip", "raise"] = "dead_letter"
    idle_timeout_s: float = 1.0  # how often it looks at the stop event while idle


class Follower:
    """Runs one ``Follow`` until ``stop`` is set."""

    def __init__(self, bus: Bus, follow: Follow, role: str):
        self.bus = bus
        self.follow = follow
        self.role = role
        self.log = bus.log.bind(follower=follow.name)
        self.handled = 0
        self.skipped = 0

    async def run(self, stop: asyncio.Event) -> None:
        f = self.follow
        reader = LogReader(
            self.bus, from_seq=f.from_seq, topics=f.topics, follow=True, start=f.start,
            idle_timeout_s=f.idle_timeout_s, stop=stop,
        )  # fmt: skip
        async with contextlib.aclosing(reader.messages()) as messages:
            async for msg in messages:
                meta = msg.metadata
                delivery = Delivery(
                    msg.subject, meta.sequence.stream, meta.num_delivered, meta.num_pending
                )
                try:
                    event = await stored_event(self.bus, msg)
                except (DecodeError, BodyError) as e:
                    if f.on_undecodable == "raise":
                        raise
                    self.skipped += 1
                    self.log.error("follower.undecodable", seq=delivery.stream_seq, error=repr(e))
                    if f.on_undecodable == "dead_letter":
                        await self._dead_letter(msg, delivery, e)
                    continue
                try:
                    outputs = await f.handler(event, delivery)
                except Rejected as e:
                    self.skipped += 1
                    self.log.error("follower.rejected", seq=delivery.stream_seq, error=str(e))
                    await self._dead_letter(msg, delivery, e)
                    await commit(self.bus, e.outputs)  # type: ignore[arg-type]
                    continue
                await commit(self.bus, outputs)
                self.handled += 1

    async def _dead_letter(self, msg: Msg, delivery: Delivery, error: Exception) -> None:
        name = type(error).__name__
        dead = dead_lettered(
            self.bus.run, self.follow.name, self.role, msg, delivery, name, str(error)
        )
        await self.bus.publish(dead)
