"""The lake role: ``replay.lake.sync_run`` every few seconds while the run goes on.

    rlbus role lake --run <run> [--interval 5]

``rlbus up`` starts it with every run (not in the supervisor's stop order, so it stops
last): SQL and the analytics API see the run while it trains, and after the run the
lake and its trace index (``replay.trace_index``) are current, so neither the first
``rlbus sql`` nor the first ``rlbus trace`` syncs the whole log (33 s for a default
run's first trace before). Every ``interval_s`` it syncs the lake under the run
directory (then merges small parts past ``COMPACT_AT``, the index's too), and once more
on SIGTERM so the lake ends with the run's last events. It is the one role that imports ``replay``:
the lake is replay's library, and this role only schedules it (an import contract
allows exactly this).

It runs at a lower CPU priority (``NICE``): its parsing (about 20 s of one core over a
default run) takes what the loop's roles leave on a small machine instead of competing
with them, and catches up when they stop.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from bus.errors import STORE_ERRORS, TRANSIENT_ERRORS
from bus.runtime import Bus
from replay.lake import COMPACT_AT, compact, locked, parts, sync_run
from replay.tables import TABLES
from replay.trace_index import compact_index, index_parts
from roles.runtime.context import RoleContext
from roles.runtime.role import Role, serve_role

NICE = 10  # added to the process's niceness (a background indexer, not the loop)


class LakeRole(Role):
    role = "lake"

    def __init__(self, bus: Bus, ctx: RoleContext, interval_s: float = 5.0):
        super().__init__(bus, ctx.instance, ctx.cfg.bus.heartbeat_interval_s)
        self.lake = ctx.paths.lake
        self.interval_s = interval_s
        self.last_seq = 0

    async def status(self) -> dict[str, object]:
        return {"info": {"lake_seq": str(self.last_seq)}}

    def background(self) -> list[Any]:
        return [self._sync_every()]

    async def _sync_every(self) -> None:
        while True:
            try:
                await self.sync()
            except (*TRANSIENT_ERRORS, *STORE_ERRORS) as e:
                # The server away for a moment (a cluster electing a stream leader): the
                # sync is idempotent (the lake's positions), so the next one catches up;
                # an indexer dying on it would only be restarted to do the same.
                self.log.warning("lake.sync_failed", error=repr(e)[:300])
            if await self.sleep(self.interval_s):
                return

    async def teardown(self) -> None:
        await self.sync()  # the lake ends with the run's last events

    async def sync(self) -> None:
        result = await sync_run(self.bus, self.lake)
        self.last_seq = result.last_seq
        self.log.info(
            "lake.synced", last_seq=result.last_seq, events=result.events,
            rows=sum(result.rows.values()), skipped=len(result.skipped),
        )  # fmt: skip
        async with locked(self.lake):
            for t in TABLES:
                if len(parts(self.lake, t)) >= COMPACT_AT:
                    compact(self.lake, t)
            if len(index_parts(self.lake)) >= COMPACT_AT:
                compact_index(self.lake)


async def main(
    ctx: RoleContext, interval_s: float = 5.0, stop: asyncio.Event | None = None
) -> None:
    """``rlbus role lake``: sync every ``interval_s`` until SIGTERM (or ``stop``), then once more."""
    bus = await ctx.connect()
    role = LakeRole(bus, ctx, interval_s)
    if stop is None:  # its own process (an embedding caller keeps its priority)
        os.nice(NICE)
        await serve_role(role)
        return

    async def relay() -> None:  # an embedding caller (a test) stops it with its own event
        await stop.wait()
        role.request_stop()

    relay_task = asyncio.create_task(relay())
    try:
        await serve_role(role, install_signals=False)
    finally:
        relay_task.cancel()
