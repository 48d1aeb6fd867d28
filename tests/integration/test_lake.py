"""The lake against a real nats-server: sync, idempotence, resume, legacy and unknown
events, crash repair, SQL views and the polars API agree."""

from __future__ import annotations

import asyncio
import datetime as dt
import shutil
from pathlib import Path

import msgspec
import pytest

import replay
from bus import codec
from bus.reader import LogReader
from bus.runtime import Bus
from bus.server import EmbeddedServer
from bus.subjects import Topic, subject
from replay.lake import compact, lake_dir, load_state, parts, repair, sync_run
from replay.sql import connect
from schemas import DeadLettered, Event, RunStopped, TraceCompleted
from schemas.legacy import TraceCompletedV0
from tests.samples import a_run_log, every_event, trace

pytestmark = pytest.mark.nats

FIRST = {
    "events": 13, "runs": 2, "tasks": 1, "rollouts": 2, "rollout_tokens": 2, "samples": 1,
    "sample_tokens": 1, "batches": 1, "batch_samples": 2, "metrics": 2, "eval": 0, "weights": 1,
    "weights_stored": 1, "dead_letters": 1, "algorithms": 2,
}  # fmt: skip


def traces(run: str, n: int, start: int = 0) -> list[TraceCompleted]:
    return [
        TraceCompleted(
            run=run,
            event_id=f"more-{i}",
            env="reverse-text",
            request_id="e-task",
            group_size=8,
            step=5,
            trace=trace(run, rollout=f"r-more-{i}"),
        )  # fmt: skip
        for i in range(start, start + n)
    ]


def counts(data_dir: Path, run: str) -> dict[str, int]:
    con = connect(data_dir, run)
    try:
        return {t: con.sql(f"select count(*) from {t}").fetchall()[0][0] for t in FIRST}
    finally:
        con.close()


def n_parts(lake: Path) -> int:
    return sum(len(parts(lake, t)) for t in FIRST)


async def test_sync_is_incremental_and_idempotent(bus: Bus, tmp_path: Path) -> None:
    """Sync writes every table; a second sync adds nothing; new events resume at the next seq.
    Its progress counts the sequences to read, up to all of them; none when up to date."""
    lake = lake_dir(tmp_path, bus.run)
    await bus.publish_many(a_run_log(bus.run))
    seen: list[tuple[int, int | None]] = []
    first = await sync_run(bus, lake, on_progress=lambda done, total: seen.append((done, total)))
    assert (first.start_seq, first.last_seq, first.events) == (1, 13, 13)
    assert seen[0] == (1, 13) and seen[-1] == (13, 13)
    assert first.rows == {t: n for t, n in FIRST.items() if n}
    assert counts(tmp_path, bus.run) == FIRST
    files = n_parts(lake)

    seen.clear()
    again = await sync_run(bus, lake, on_progress=lambda done, total: seen.append((done, total)))
    assert (again.events, again.rows, again.start_seq) == (0, {}, 14) and seen == []
    assert n_parts(lake) == files and counts(tmp_path, bus.run) == FIRST

    await bus.publish_many(traces(bus.run, 3))
    more = await sync_run(bus, lake, on_progress=lambda done, total: seen.append((done, total)))
    assert (more.start_seq, more.last_seq, more.events) == (14, 16, 3)
    assert seen[-1] == (3, 3)
    assert more.rows == {"events": 3, "rollouts": 3, "rollout_tokens": 3}
    assert parts(lake, "rollouts")[-1][:2] == (14, 16)
    expected = {**FIRST, "events": 16, "rollouts": 5, "rollout_tokens": 5}
    assert counts(tmp_path, bus.run) == expected

    # the polars API sees the same rows, lazily
    tables = replay.open_run(bus.run, tmp_path, sync=False)
    got = {t: lf.select("seq").collect().height for t, lf in tables.tables().items()}
    assert got == expected
    assert tables.train_metrics.collect().height == 2


async def test_views_join_batches_to_rollouts(bus: Bus, tmp_path: Path) -> None:
    """SQL views: rewards as a MAP, batch_step from the batch that trained the rollout."""
    await bus.publish_many(a_run_log(bus.run))
    await sync_run(bus, lake_dir(tmp_path, bus.run))
    con = connect(tmp_path, bus.run)
    rows = con.sql(
        "select split, rewards['lcs'], reward_lcs, batch_step from rollouts order by seq"
    ).fetchall()
    assert rows == [("train", 0.75, 0.75, 3), ("train", 0.75, 0.75, 3)]
    (trained,) = con.sql("select batch_step, algorithm, staleness from trained_samples").fetchall()
    assert trained == (3, "grpo", -1)
    wide = con.sql("select step, loss, grad_norm from train_metrics_wide").fetchall()
    assert wide == [(3, 0.5, 1.25)]
    con.close()


async def test_legacy_upcast_and_unknown_version_skipped(bus: Bus, tmp_path: Path) -> None:
    """A v0 event is upcast into the lake; a trace_completed/9 is reported, skipped, not raised,
    and not reported again by the next sync."""

    class TraceCompletedV9(Event, frozen=True, tag="trace_completed/9"):
        env: str

    v0 = TraceCompletedV0(run=bus.run, event_id="v0", request_id="q", group_size=1, step=1,
                          trace=trace(bus.run, rollout="r-v0"))  # fmt: skip
    future = TraceCompletedV9(run=bus.run, event_id="v9", env="reverse-text")
    subj = subject(bus.run, Topic.TRACE_COMPLETED, "reverse-text")
    for event in (v0, future):
        headers = {**codec.headers_for(event), codec.H_SCHEMA: codec.tag_of(type(event))}
        await bus.js.publish(subj, msgspec.msgpack.encode(event), headers=headers)
    await bus.publish_many(traces(bus.run, 1))

    lake = lake_dir(tmp_path, bus.run)
    result = await sync_run(bus, lake)
    assert result.last_seq == 3 and result.events == 2
    (skipped,) = result.skipped
    assert (skipped.seq, skipped.schema) == (2, "trace_completed/9")
    assert "trace_completed/9" in skipped.reason
    con = connect(tmp_path, bus.run)
    assert con.sql("select rollout_id, env from rollouts order by seq").fetchall() == [
        ("r-v0", "reverse-text"),
        ("r-more-0", "reverse-text"),
    ]
    assert con.sql("select schema from events order by seq").fetchall() == [
        ("trace_completed/0",),
        ("trace_completed/1",),
    ]
    con.close()
    assert (await sync_run(bus, lake)).skipped == []


async def test_crash_leftovers_are_repaired(bus: Bus, tmp_path: Path) -> None:
    """A lost state file, a stray temp file or an interrupted compaction never duplicate rows."""
    lake = lake_dir(tmp_path, bus.run)
    await bus.publish_many(a_run_log(bus.run))
    await sync_run(bus, lake)
    await bus.publish_many(traces(bus.run, 2))
    await sync_run(bus, lake)
    expected = counts(tmp_path, bus.run)

    (lake / "_state.json").unlink()  # crash before the state was saved
    (lake / "rollouts" / ".part-000000000099-000000000099.parquet.tmp").write_bytes(b"partial")
    assert (await sync_run(bus, lake)).rows == {}
    assert counts(tmp_path, bus.run) == expected
    assert not list(lake.glob("*/.part-*"))

    old = [p for _, _, p in parts(lake, "rollouts")]
    kept = tmp_path / "kept.parquet"
    shutil.copy(old[0], kept)
    assert compact(lake, "rollouts") is not None and len(parts(lake, "rollouts")) == 1
    shutil.copy(kept, old[0])  # as if the compaction died before deleting its inputs
    repair(lake)
    assert len(parts(lake, "rollouts")) == 1
    assert counts(tmp_path, bus.run) == expected
    assert load_state(lake)["tables"]["rollouts"] == len(every_event()) + 2


async def test_reader_from_time_filtered_and_following(bus: Bus) -> None:
    """The log reader starts at a time, filters topics, and in follow mode sees new events."""
    await bus.publish_many(traces(bus.run, 2))
    await asyncio.sleep(0.05)
    mark = dt.datetime.now(dt.UTC)
    await asyncio.sleep(0.05)
    await bus.publish_many([*a_run_log(bus.run)[:2], *traces(bus.run, 1, start=2)])

    since = [e.seq async for e in LogReader(bus, since=mark).entries()]
    assert since == [3, 4, 5]
    only = LogReader(bus, topics=[(Topic.TRACE_COMPLETED, None)], from_seq=2)
    assert [e.event.event_id async for e in only.entries()] == ["more-1", "more-2"]
    assert [e async for e in LogReader(bus, from_seq=6).entries()] == []

    follower = LogReader(bus, from_seq=5, follow=True, idle_timeout_s=0.2)
    seen: list[int] = []

    async def follow() -> None:
        async for entry in follower.entries():
            seen.append(entry.seq)
            if entry.seq == 6:
                return

    task = asyncio.create_task(follow())
    await asyncio.sleep(0.5)
    await bus.publish_many(traces(bus.run, 1, start=3))
    await asyncio.wait_for(task, 10)
    assert seen == [5, 6]


async def test_open_run_syncs_through_a_server(
    bus: Bus, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """open_run(sync=True) syncs first (here from async code, on its own thread)."""
    await bus.publish_many(a_run_log(bus.run))
    tables = replay.open_run(bus.run, tmp_path, sync=True, nats_url=nats_server.url)
    assert tables.synced is not None and tables.synced.events == 13
    assert tables.rollouts.collect().height == 2
    assert tables.rollouts.select("batch_step").collect().to_series().to_list() == [3, 3]
    # Up to date: the default asks the stream and does not sync; a new event: it does.
    assert replay.open_run(bus.run, tmp_path, nats_url=nats_server.url).synced is None
    await bus.publish(RunStopped(run=bus.run, reason="again"))
    again = replay.open_run(bus.run, tmp_path, nats_url=nats_server.url).synced
    assert again is not None and again.events == 1


async def test_live_lake_role_follows_the_run(
    bus: Bus, nats_server: EmbeddedServer, tmp_path: Path
) -> None:
    """The lake role syncs on its interval while events arrive, and once more on stop."""
    from configs import load_config
    from roles.lake.role import main
    from roles.runtime.context import RoleContext

    cfg = load_config("smoke", [f"bus.data_dir={tmp_path}"])
    ctx = RoleContext(run=bus.run, url=nats_server.url, cfg=cfg, instance="lake-test")
    stop = asyncio.Event()
    task = asyncio.create_task(main(ctx, interval_s=0.2, stop=stop))
    lake = lake_dir(tmp_path, bus.run)

    async def synced_to(seq: int) -> None:
        while load_state(lake)["tables"]["events"] < seq:
            await asyncio.sleep(0.05)

    await bus.publish_many(a_run_log(bus.run))
    await asyncio.wait_for(synced_to(13), 10)
    await bus.publish_many(traces(bus.run, 2))
    await asyncio.wait_for(synced_to(14), 10)
    stop.set()
    await asyncio.wait_for(task, 10)
    assert counts(tmp_path, bus.run)["rollouts"] == 4


async def test_a_dead_lettered_message_is_left_out_of_the_tables(bus: Bus, tmp_path: Path) -> None:
    """A message a reader dead-lettered (a forged or impossible event) is not part of the
    run: SQL views and open_run leave it out; the raw log (events) keeps it."""
    acks = await bus.publish_many(traces(bus.run, 3))
    forged = acks[1].seq
    dead = next(e for e in every_event(bus.run) if isinstance(e, DeadLettered))
    await bus.publish(msgspec.structs.replace(dead, stream_seq=forged))
    await sync_run(bus, lake_dir(tmp_path, bus.run))
    con = connect(tmp_path, bus.run)
    try:
        seqs = [s for (s,) in con.sql("select seq from rollouts order by seq").fetchall()]
        assert seqs == [acks[0].seq, acks[2].seq]
        assert con.sql(
            "select count(*) from events where seq = $1", params=[forged]
        ).fetchall() == [(1,)]
    finally:
        con.close()
    tables = replay.open_run(bus.run, tmp_path, sync=False)
    assert sorted(tables.rollouts.select("seq").collect()["seq"].to_list()) == seqs
