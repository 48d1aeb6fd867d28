"""The lake as an index of the log: which stored events one rollout's chain needs.

    frames = index_frames(lake)                # the lake tables it reads, as LazyFrames
    rollout_id = resolve(frames, "5c6fb48f")   # a rollout id or prefix, or an event id or prefix
    wanted = chain_seqs(frames, rollout_id)    # the stream sequences of those events
    events = await fetch(bus, wanted)          # just those messages, in log order
    chain = trace_chain(events, rollout_id)    # the chain a scan of the whole log gives

``rlbus trace`` used to read every event of the seven topics ``trace_chain`` looks at and
search them, a cost that grows with the run. Every lake row carries ``seq``, the stream
sequence of its event, so a few filters over the lake name the handful of events the
chain needs, and ``fetch`` reads only those (``js.get_msg`` by sequence): 76 ms against
2.3 s for the scan on a 16,000-event run (``benchmarks/trace_bench.py``).

The events, chosen so that ``trace_chain`` builds from them the chain it builds from
the full scan:

- the first ``run.started`` (initial weights; the model path for token texts);
- the first event that recorded the rollout (``trace.completed`` or ``eval.completed``)
  and the first ``task.requested`` with its request id;
- every ``samples.scored`` holding a sample of it, every ``batch.assembled`` that
  trained one;
- for each such batch and each algorithm that scored the rollout, one of the batch's
  sources of that algorithm (the chain names the algorithms a batch drew on through
  its sources), and every source without samples (the lake has no algorithm for it);
- every ``weights.published`` of a version in ``[policy_min, policy_max]`` or of a
  version one of those batches produced (all of them: the chain keeps the last one
  stored per version).

An id is resolved as ``find_trace`` does (``pick_rollout``: an exact rollout id, else a
unique prefix); if no rollout id starts with it, as an event id (or a prefix, as
``rlbus events`` prints them) of a ``trace.completed``, or of an ``eval.completed`` or
``samples.scored`` that holds exactly one rollout. Anything else is ``TraceNotFound``.

The lake must be current (``replay.lake.sync_if_behind`` first). ``fetch`` checks each
message's event id against the lake and raises ``StaleLake`` when they differ (a stream
rebuilt under an old lake).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from bus.reader import stored_event
from bus.runtime import Bus
from replay import scan_table
from replay.inspect import TraceNotFound, pick_rollout
from schemas import Event

INDEX_TABLES = ("events", "runs", "tasks", "rollouts", "samples", "batch_samples", "batches", "weights")  # fmt: skip
# the topic of an event an id may name -> the table of the rollouts it holds
HOLDERS = {"trace.completed": "rollouts", "eval.completed": "rollouts", "samples.scored": "samples"}  # fmt: skip
Frames = Mapping[str, pl.LazyFrame]
col = pl.col


class StaleLake(LookupError):
    """The lake names a message the stream does not hold at that sequence."""


@dataclass(frozen=True)
class Wanted:
    """The events one rollout's chain needs: stream sequences, in log order, with the
    event id the lake recorded at each."""

    seqs: tuple[int, ...]
    event_ids: dict[int, str]


def index_frames(lake: Path) -> dict[str, pl.LazyFrame]:
    """The lake tables the index reads (``replay.scan_table``: nothing read until used)."""
    return {t: scan_table(lake, t) for t in INDEX_TABLES}


def _column(frame: pl.LazyFrame, name: str) -> list[Any]:
    return frame.select(name).collect()[name].to_list()


def _in(name: str, values: Iterable[Any]) -> pl.Expr:
    return col(name).is_in(sorted(set(values)))


def resolve(frames: Frames, ident: str) -> str:
    """The rollout id ``ident`` names (see the module docstring); ``TraceNotFound`` if none."""
    rollouts = set(_column(frames["rollouts"].filter(col("rollout_id").str.starts_with(ident)), "rollout_id"))  # fmt: skip
    if rollouts:
        return pick_rollout(ident, rollouts)
    found = (
        frames["events"].filter(col("event_id").str.starts_with(ident))
        .select("event_id", "topic").unique().sort("event_id").collect()
    )  # fmt: skip
    exact = found.filter(col("event_id") == ident)
    if exact.height == 1:
        found = exact
    if found.is_empty():
        raise TraceNotFound(f"no rollout id or event id {ident!r} in this run")
    if found.height > 1:
        ids = found["event_id"].to_list()
        raise TraceNotFound(f"{len(ids)} events start with {ident!r}: {ids[:5]}")
    event_id, topic = found.row(0)
    table = HOLDERS.get(topic)
    if table is None:
        raise TraceNotFound(
            f"event {event_id} is a {topic}: give a rollout id, or the event id of a "
            "trace.completed, eval.completed or samples.scored"
        )
    held = sorted(set(_column(frames[table].filter(col("event_id") == event_id), "rollout_id")))
    if len(held) != 1:
        more = ", ..." if len(held) > 5 else ""
        raise TraceNotFound(
            f"event {event_id} ({topic}) holds {len(held)} rollouts "
            f"({', '.join(held[:5])}{more}): give one rollout id"
        )
    return str(held[0])


def _first_seq(frame: pl.LazyFrame) -> set[int]:
    """The smallest ``seq`` of ``frame`` (the first such event in the log), or none."""
    first = frame.select(col("seq").min()).collect().item()
    return set() if first is None else {int(first)}


def _sources(frames: Frames, batches: pl.DataFrame, algorithms: set[str]) -> set[int]:
    """Per batch and per algorithm in ``algorithms``, one of the batch's sources of that
    algorithm; and every source the ``samples`` table does not know (no samples)."""
    sources = batches.select(col("seq").alias("batch"), col("sources").alias("event_id"))
    sources = sources.explode("event_id").drop_nulls("event_id")
    known = (
        frames["samples"].filter(_in("event_id", sources["event_id"]))
        .select("event_id", "algorithm", "seq").unique().collect()
    )  # fmt: skip
    joined = sources.join(known, on="event_id", how="left")
    picked = (
        joined.filter(_in("algorithm", algorithms))
        .group_by("batch", "algorithm").agg(col("seq").min())
    )  # fmt: skip
    unknown = joined.filter(col("algorithm").is_null())["event_id"]
    empty = frames["events"].filter(_in("event_id", unknown) & (col("topic") == "samples.scored"))
    return set(picked["seq"].to_list()) | set(_column(empty, "seq"))


def _weights(frames: Frames, versions: Iterable[int], batch_ids: Iterable[str]) -> set[int]:
    """Every ``weights.published`` of ``versions`` or of a version those batches produced."""
    weights = frames["weights"]
    produced = _column(weights.filter(_in("batch_id", batch_ids)), "version")
    return set(_column(weights.filter(_in("version", [*versions, *produced])), "seq"))


def chain_seqs(frames: Frames, rollout_id: str) -> Wanted:
    """The stream sequences of the events ``trace_chain`` needs for ``rollout_id`` (a full
    id, as ``resolve`` returns it); see the module docstring for which and why."""
    recorded = frames["rollouts"].filter(col("rollout_id") == rollout_id).sort("seq").head(1)
    rows = recorded.select("seq", "request_id", "policy_min", "policy_max").collect()
    if rows.is_empty():
        raise TraceNotFound(f"no trace with rollout id {rollout_id!r} in this run")
    seq, request_id, policy_min, policy_max = rows.row(0)
    seqs = {seq}
    seqs |= _first_seq(frames["runs"].filter(col("kind") == "started"))
    seqs |= _first_seq(frames["tasks"].filter(col("event_id") == request_id))
    scored = frames["samples"].filter(col("rollout_id") == rollout_id).select("seq", "algorithm")
    scored_df = scored.unique().collect()
    seqs |= set(scored_df["seq"].to_list())
    trained = _column(frames["batch_samples"].filter(col("rollout_id") == rollout_id), "seq")
    batches = frames["batches"].filter(_in("seq", trained)).select("seq", "event_id", "sources")
    batches_df = batches.collect()
    seqs |= set(batches_df["seq"].to_list())
    seqs |= _sources(frames, batches_df, set(scored_df["algorithm"].to_list()))
    seqs |= _weights(frames, range(policy_min, policy_max + 1), batches_df["event_id"].to_list())
    ids = frames["events"].filter(_in("seq", seqs)).select("seq", "event_id").collect()
    return Wanted(tuple(sorted(seqs)), dict(ids.iter_rows()))


async def fetch(bus: Bus, wanted: Wanted) -> list[Event]:
    """The events at ``wanted.seqs`` (offloaded bodies resolved, legacy versions upcast),
    in log order; ``StaleLake`` if one is not the event the lake recorded there."""

    async def one(seq: int) -> Event:
        expected = wanted.event_ids.get(seq)
        msg = await bus.stored(seq)
        event = None if msg is None else await stored_event(bus, msg)
        if event is None or event.event_id != expected:
            got = "nothing" if event is None else repr(event.event_id)
            raise StaleLake(
                f"the lake does not match stream {bus.stream}: it says seq {seq} holds "
                f"event {expected!r}, the stream has {got} (delete the run's lake and retry)"
            )
        return event

    return list(await asyncio.gather(*(one(s) for s in wanted.seqs)))


async def trace_events(bus: Bus, lake: Path, ident: str) -> tuple[str, list[Event]]:
    """(rollout id, the events its chain needs, in log order) for ``ident``, looked up in
    ``lake`` (current: sync it first) and fetched from ``bus``'s stream."""
    frames = index_frames(lake)
    rollout_id = resolve(frames, ident)
    return rollout_id, await fetch(bus, chain_seqs(frames, rollout_id))
