"""The monitor role: follows a run's metrics into TensorBoard and W&B.

    rlbus role monitor --run <run>                  # the sinks of [monitor] in the config
    rlbus monitor <run> --to tensorboard            # a finished run, read to its end

A follower of ``metrics.reported.*`` (no durable consumer: the log
is read in order, and each sink's ``SinkPosition`` says where it stopped, so a restart
writes nothing twice). Every two seconds the sinks are flushed and their positions
recorded; as it stops (``rlbus up`` stops it last) it reads the log to its end first, so
the sinks end with the metrics the other roles reported as they stopped. ``rlbus up`` starts it when ``[monitor] sinks`` is not empty;
it can also be attached to a live run or pointed at a finished one.
"""

from __future__ import annotations

import contextlib
from typing import Any

from bus.consumer import Delivery
from bus.follower import Follow
from bus.reader import read_log
from bus.runtime import Bus
from bus.subjects import Topic
from roles.monitor.feed import MetricFeed
from roles.monitor.sinks import make_feeds
from roles.runtime.context import RoleContext
from roles.runtime.role import Role, serve_role
from schemas import MetricsReported

TOPICS = [(Topic.METRICS_REPORTED, None)]
CHECKPOINT_EVERY_S = 2.0


class MonitorRole(Role):
    role = "monitor"

    def __init__(self, bus: Bus, ctx: RoleContext, feeds: list[MetricFeed]):
        super().__init__(bus, ctx.instance, ctx.cfg.bus.heartbeat_interval_s)
        self.feeds = feeds

    def subscriptions(self) -> list[Any]:
        start = min(f.from_seq for f in self.feeds)
        return [Follow("monitor", TOPICS, self.on_event, from_seq=start)]

    async def on_event(self, event: Any, delivery: Delivery) -> list[Any]:
        for feed in self.feeds:
            feed.apply(event, delivery.stream_seq)
        return []

    def background(self) -> list[Any]:
        return [self._checkpoint_every()]

    async def _checkpoint_every(self) -> None:
        while not await self.sleep(CHECKPOINT_EVERY_S):
            for feed in self.feeds:
                feed.checkpoint()

    async def status(self) -> dict[str, object]:
        seq = min(f.seq for f in self.feeds)
        return {"info": {"sinks": ",".join(f.sink.name for f in self.feeds), "seq": str(seq)}}

    async def teardown(self) -> None:
        # Roles that stopped before this one reported their last metrics as they went:
        # read the log to its end so the sinks end with the run's last numbers.
        events = read_log(self.bus, TOPICS, (MetricsReported,),
                          from_seq=min(f.from_seq for f in self.feeds), with_seq=True)  # fmt: skip
        async with contextlib.aclosing(events) as stream:
            async for seq, event in stream:
                for feed in self.feeds:
                    feed.apply(event, seq)
        for feed in self.feeds:
            feed.close()
            self.log.info("monitor.closed", sink=feed.sink.name, seq=feed.seq,
                          metrics=feed.delivered)  # fmt: skip


async def main(ctx: RoleContext) -> None:
    """Entry point of ``rlbus role monitor``: the config's ``[monitor] sinks``."""
    sinks = ctx.cfg.monitor.sinks
    if not sinks:
        raise SystemExit("rlbus role monitor: [monitor] sinks is empty in the run's config")
    # The resolved config every role reads is the one the orchestrator publishes in
    # run.started (metrics come before run.started, so it is not waited for).
    config = ctx.cfg.model_dump(mode="json")
    feeds = make_feeds(list(sinks), ctx.cfg.monitor, ctx.paths, config)
    bus = await ctx.connect()
    await serve_role(MonitorRole(bus, ctx, feeds))
