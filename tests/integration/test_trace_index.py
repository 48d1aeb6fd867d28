"""The trace index is written with the lake, so the first `rlbus trace` after a run reads
it instead of syncing the whole log (issue 31, item 10: 33 s on a fresh default run).

Against a real nats-server: every sync appends an index part beside the tables' parts;
a lake synced before the index existed gets one on its next sync without a duplicated
row; parts written across syncs, compacted, or left by a crash give the full scan's
chain; `rlbus up` runs the live lake role that writes both as the run goes, stopped last.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from bus.reader import read_log
from bus.runtime import Bus
from replay.inspect import TOPICS, TYPES, trace_chain
from replay.lake import lake_dir, load_state, parts, repair, save_state, sync_run
from replay.tables import TABLES
from replay.trace_index import (
    FOLDER,
    chain_seqs,
    compact_index,
    fetch,
    index_parts,
    index_seq,
    load_index,
    sync_if_behind,
)
from tests.integration.test_trace_fast import small_run

pytestmark = pytest.mark.nats


async def same_chains(bus: Bus, lake: Path, rollouts: tuple[str, ...] = ("r0", "r1")) -> None:
    """The index's chain of each rollout is the full scan's."""
    full = [e async for e in read_log(bus, TOPICS, TYPES)]
    index = load_index(lake)
    for rollout in rollouts:
        events = await fetch(bus, chain_seqs(index, rollout))
        got, want = trace_chain(events, rollout), trace_chain(full, rollout)
        assert json.dumps(got, default=str) == json.dumps(want, default=str)


def table_parts(lake: Path) -> dict[str, list[Path]]:
    return {t: [p for _, _, p in parts(lake, t)] for t in TABLES}


async def synced_twice(bus: Bus, tmp_path: Path) -> tuple[list[Any], Path]:
    """A small run's log and its lake, synced after its first 10 events and at its end."""
    log = small_run(bus.run)
    lake = lake_dir(tmp_path, bus.run)
    await bus.publish_many(log[:10])
    await sync_run(bus, lake)
    await bus.publish_many(log[10:])
    await sync_run(bus, lake)
    return log, lake


async def test_each_sync_writes_an_index_part_that_covers_what_it_read(
    bus: Bus, tmp_path: Path
) -> None:
    """Two syncs, two index parts named by their sequences; the index's position is the
    tables'; a check against a current index syncs nothing."""
    log, lake = await synced_twice(bus, tmp_path)
    assert [(a, b) for a, b, _ in index_parts(lake)] == [(1, 10), (11, len(log))]
    state = load_state(lake)
    assert index_seq(lake) == state["trace_index"] == min(state["tables"].values()) == len(log)
    assert await sync_if_behind(bus, lake) is False
    await same_chains(bus, lake)

    assert compact_index(lake) is not None
    assert [(a, b) for a, b, _ in index_parts(lake)] == [(1, len(log))]
    await same_chains(bus, lake)


async def test_a_lake_synced_before_the_index_gets_one_without_duplicate_rows(
    bus: Bus, tmp_path: Path
) -> None:
    """An older lake (tables current, no index): the next sync reads the log again for
    the index alone; the tables gain no row."""
    await bus.publish_many(small_run(bus.run))
    lake = lake_dir(tmp_path, bus.run)
    await sync_run(bus, lake)
    shutil.rmtree(lake / FOLDER)
    state = json.loads((lake / "_state.json").read_text())
    del state["trace_index"]
    save_state(lake, state)
    before = table_parts(lake)
    assert index_seq(lake) == 0

    assert await sync_if_behind(bus, lake) is True
    assert table_parts(lake) == before
    assert index_seq(lake) == len(small_run(bus.run))
    await same_chains(bus, lake)


async def test_index_crash_leftovers_are_repaired(bus: Bus, tmp_path: Path) -> None:
    """A lost state, a stray temp part, or the inputs of an interrupted compaction left
    beside its output never duplicate an index entry."""
    log, lake = await synced_twice(bus, tmp_path)
    first = index_parts(lake)[0][2]
    kept = first.read_bytes()
    compact_index(lake)
    first.write_bytes(kept)  # as if the compaction died before deleting its inputs
    (lake / FOLDER / ".part-000000000099-000000000099.msgpack.tmp").write_bytes(b"partial")
    (lake / "_state.json").unlink()  # and the state was lost

    assert (await sync_run(bus, lake)).rows == {}
    repair(lake)
    assert [(a, b) for a, b, _ in index_parts(lake)] == [(1, len(log))]
    assert not list((lake / FOLDER).glob(".part-*"))
    assert len(load_index(lake).events) == len(log)
    await same_chains(bus, lake)


def test_rlbus_up_runs_the_live_lake_role_and_stops_it_last() -> None:
    """The lake (and so the trace index) is written as the run goes, and ends with the
    events the other roles publish while they drain."""
    from configs import load_config
    from roles.up.launcher import role_commands
    from roles.up.processes import RoleProcess
    from roles.up.supervisor import stop_groups

    commands = role_commands(load_config("smoke"))
    assert ("lake", ["lake"]) in commands
    roles = [RoleProcess(name, args, Path("unused.log")) for name, args in commands]
    assert [r.name for r in stop_groups(roles)[-1]] == ["lake"]
