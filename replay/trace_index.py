"""The trace index: which stored events one rollout's chain needs, written with the lake.

    index = load_index(lake)                   # every part of lake/_trace/, merged
    rollout_id = resolve(index, "5c6fb48f")    # a rollout id or prefix, or an event id or prefix
    wanted = chain_seqs(index, rollout_id)     # the stream sequences of those events
    events = await fetch(bus, wanted)          # just those messages, in log order
    chain = trace_chain(events, rollout_id)    # the chain a scan of the whole log gives

``rlbus trace`` used to read every event of the seven topics ``trace_chain`` looks at and
search them, a cost that grows with the run. A few ids per event name the handful of
events a chain needs, and ``fetch`` reads only those (``js.get_msg`` by sequence).

Those ids are kept apart from the Parquet tables, in ``lake/_trace/part-<first>-<last>.msgpack``
(``IndexPart``: plain tuples, msgspec): ``replay.lake.sync_run`` writes one part with
every flush of its table parts, from the rows it builds anyway (``index_part``), under
the same lock and with the same crash rules (the part's name says the last sequence it
covers; ``load_state`` raises the index's position to it). So the index grows as the
lake is written: by ``rlbus up``'s live lake role while the run goes on, and a trace
after the run reads a few small files, without polars or pyarrow (a third of the
command's time went to importing them), and never syncs the whole lake first. A lake
synced before the index existed gets it on its next sync (its position is 0: the log is
read once more, for the index alone).

The events, chosen so that ``trace_chain`` builds from them the chain it builds from
the full scan:

- the first ``run.started`` (initial weights; the model path for token texts);
- the first event that recorded the rollout (``trace.completed`` or ``eval.completed``)
  and the first ``task.requested`` with its request id;
- every ``samples.scored`` holding a sample of it, every ``batch.assembled`` that
  trained one;
- for each such batch and each algorithm that scored the rollout, one of the batch's
  sources of that algorithm (the chain names the algorithms a batch drew on through
  its sources), and every source without samples (the index has no algorithm for it);
- every ``weights.published`` of a version in ``[policy_min, policy_max]`` or of a
  version one of those batches produced (all of them: the chain keeps the last one
  stored per version).

An id is resolved as ``find_trace`` does (``pick_rollout``: an exact rollout id, else a
unique prefix); if no rollout id starts with it, as an event id (or a prefix, as
``rlbus events`` prints them) of a ``trace.completed``, or of an ``eval.completed`` or
``samples.scored`` that holds exactly one rollout. Anything else is ``TraceNotFound``.

The index must be current (``replay.lake.sync_if_behind`` first). ``fetch`` checks each
message's event id against the index and raises ``StaleLake`` when they differ (a
stream rebuilt under an old lake).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from replay.inspect import TraceNotFound, pick_rollout

if TYPE_CHECKING:
    from bus.reader import Progress
    from bus.runtime import Bus
    from schemas import Event

FOLDER = "_trace"  # under the lake, beside the tables' folders
STATE = "_state.json"  # the lake's positions (``replay.lake``), the index's among them
PART = re.compile(r"^part-(\d+)-(\d+)\.msgpack$")
# the topic of an event an id may name -> what holds its rollouts
HOLDERS = ("trace.completed", "eval.completed", "samples.scored")


class StaleLake(LookupError):
    """The lake names a message the stream does not hold at that sequence."""


class IndexPart(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What the chains of the rollouts need from events ``first..last`` of the log.

    New fields get defaults (parts already written decode without them)."""

    events: list[tuple[int, str, str]] = []  # (seq, event id, topic): every event
    started: list[int] = []  # seq of each run.started
    tasks: list[tuple[int, str]] = []  # (seq, event id) of task.requested
    # (seq, event id, rollout id, request id, policy_min, policy_max): each recorded rollout
    rollouts: list[tuple[int, str, str, str, int, int]] = []
    samples: list[tuple[int, str, str, str]] = []  # (seq, event id, algorithm, rollout id)
    batch_samples: list[tuple[int, str]] = []  # (seq of the batch, rollout id)
    batches: list[tuple[int, str, list[str]]] = []  # (seq, event id, sources)
    weights: list[tuple[int, int, str]] = []  # (seq, version, batch id)

    def __len__(self) -> int:
        return len(self.events)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(IndexPart)


def index_part(tables: Mapping[str, list[dict[str, Any]]], part: IndexPart) -> None:
    """Add to ``part`` the index entries of one event, from its lake rows (``rows_for``)."""
    for r in tables["events"]:
        part.events.append((r["seq"], r["event_id"], r["topic"] or ""))
    for r in tables.get("runs", ()):
        if r["kind"] == "started":
            part.started.append(r["seq"])
    for r in tables.get("tasks", ()):
        part.tasks.append((r["seq"], r["event_id"]))
    for r in tables.get("rollouts", ()):
        part.rollouts.append((r["seq"], r["event_id"], r["rollout_id"], r["request_id"] or "",
                              r["policy_min"], r["policy_max"]))  # fmt: skip
    for r in tables.get("samples", ()):
        part.samples.append((r["seq"], r["event_id"], r["algorithm"], r["rollout_id"]))
    for r in tables.get("batch_samples", ()):
        part.batch_samples.append((r["seq"], r["rollout_id"]))
    for r in tables.get("batches", ()):
        part.batches.append((r["seq"], r["event_id"], list(r["sources"])))
    for r in tables.get("weights", ()):
        part.weights.append((r["seq"], r["version"], r["batch_id"] or ""))


# -- parts on disk -------------------------------------------------------------------------


def index_parts(lake: Path) -> list[tuple[int, int, Path]]:
    """(first_seq, last_seq, path) of each index part, in sequence order."""
    found = [(m, p) for p in (lake / FOLDER).glob("part-*.msgpack") if (m := PART.match(p.name))]
    return sorted((int(m[1]), int(m[2]), p) for m, p in found)


def index_seq(lake: Path) -> int:
    """The last stream sequence the index covers (0: none): its position in the lake's
    state, raised to its newest part's (a part renamed just before a crash). Reads no
    table, imports nothing heavy: what ``rlbus trace`` checks before it syncs."""
    try:
        state = json.loads((lake / STATE).read_text())
    except FileNotFoundError:
        state = {}
    found = index_parts(lake)
    return max(int(state.get("trace_index", 0)), found[-1][1] if found else 0)


async def sync_if_behind(bus: Bus, lake: Path, on_progress: Progress | None = None) -> bool:
    """Sync the lake (``replay.lake.sync_run``: its tables and this index) when ``bus``'s
    stream holds events past the index; whether it synced. A lake the live lake role kept
    current costs one stream lookup here."""
    state = await bus.stream_state()
    if state is None:
        raise LookupError(f"run {bus.run!r} has no stream ({bus.stream}) on this server")
    if state.last_seq <= index_seq(lake):
        return False
    from replay.lake import sync_run  # polars and pyarrow: only to write

    await sync_run(bus, lake, on_progress=on_progress)
    return True


def write_index_part(lake: Path, part: IndexPart) -> Path:
    """One part, atomically (temp file + rename), named by the sequences it covers."""
    seqs = [seq for seq, _, _ in part.events]
    folder = lake / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"part-{min(seqs):012d}-{max(seqs):012d}.msgpack"
    tmp = folder / f".{path.name}.tmp"
    tmp.write_bytes(_ENCODER.encode(part))
    os.replace(tmp, path)
    return path


def read_parts(lake: Path) -> IndexPart:
    """Every part merged into one, in log order."""
    merged = IndexPart()
    for _, _, path in index_parts(lake):
        p = _DECODER.decode(path.read_bytes())
        for name in IndexPart.__struct_fields__:
            getattr(merged, name).extend(getattr(p, name))
    return merged


def compact_index(lake: Path) -> Path | None:
    """Merge every index part into one (call under ``replay.lake.locked``); None if < 2."""
    found = index_parts(lake)
    if len(found) < 2:
        return None
    merged = write_index_part(lake, read_parts(lake))
    for _, _, p in found:
        if p != merged:
            p.unlink()
    return merged


# -- lookups ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Wanted:
    """The events one rollout's chain needs: stream sequences, in log order, with the
    event id the index recorded at each."""

    seqs: tuple[int, ...]
    event_ids: dict[int, str]


def load_index(lake: Path) -> IndexPart:
    """The lake's whole trace index (empty when the lake has none yet)."""
    return read_parts(lake)


def resolve(index: IndexPart, ident: str) -> str:
    """The rollout id ``ident`` names (see the module docstring); ``TraceNotFound`` if none."""
    rollouts = {r[2] for r in index.rollouts if r[2].startswith(ident)}
    if rollouts:
        return pick_rollout(ident, rollouts)
    found = sorted({(e[1], e[2]) for e in index.events if e[1].startswith(ident)})
    exact = [f for f in found if f[0] == ident]
    if len(exact) == 1:
        found = exact
    if not found:
        raise TraceNotFound(f"no rollout id or event id {ident!r} in this run")
    if len(found) > 1:
        ids = [f[0] for f in found]
        raise TraceNotFound(f"{len(ids)} events start with {ident!r}: {ids[:5]}")
    event_id, topic = found[0]
    if topic not in HOLDERS:
        raise TraceNotFound(
            f"event {event_id} is a {topic}: give a rollout id, or the event id of a "
            "trace.completed, eval.completed or samples.scored"
        )
    rows: list[tuple[Any, ...]] = index.samples if topic == "samples.scored" else index.rollouts
    at = 3 if topic == "samples.scored" else 2  # where the rollout id is in those rows
    held = sorted({r[at] for r in rows if r[1] == event_id})
    if len(held) != 1:
        more = ", ..." if len(held) > 5 else ""
        raise TraceNotFound(
            f"event {event_id} ({topic}) holds {len(held)} rollouts "
            f"({', '.join(held[:5])}{more}): give one rollout id"
        )
    return str(held[0])


def _sources(index: IndexPart, batches: list[tuple[int, str, list[str]]], algorithms: set[str]) -> set[int]:  # fmt: skip
    """Per batch and per algorithm in ``algorithms``, one of the batch's sources of that
    algorithm; and every source the index has no samples of."""
    wanted = {src for _, _, sources in batches for src in sources}
    scored = {s[1]: (s[0], s[2]) for s in index.samples if s[1] in wanted}  # id -> (seq, algo)
    picked: dict[tuple[int, str], int] = {}  # (batch, algorithm) -> the smallest seq
    unknown: set[str] = set()
    for batch, _, sources in batches:
        for src in sources:
            if src not in scored:
                unknown.add(src)
                continue
            seq, algorithm = scored[src]
            if algorithm in algorithms:
                key = (batch, algorithm)
                picked[key] = min(seq, picked.get(key, seq))
    empty = {e[0] for e in index.events if e[1] in unknown and e[2] == "samples.scored"}
    return set(picked.values()) | empty


def chain_seqs(index: IndexPart, rollout_id: str) -> Wanted:
    """The stream sequences of the events ``trace_chain`` needs for ``rollout_id`` (a full
    id, as ``resolve`` returns it); see the module docstring for which and why."""
    recorded = [r for r in index.rollouts if r[2] == rollout_id]
    if not recorded:
        raise TraceNotFound(f"no trace with rollout id {rollout_id!r} in this run")
    seq, _, _, request_id, policy_min, policy_max = min(recorded)
    seqs = {seq}
    seqs |= set(sorted(index.started)[:1])  # the first run.started
    seqs |= set(sorted(t[0] for t in index.tasks if t[1] == request_id)[:1])
    scored = [(s[0], s[2]) for s in index.samples if s[3] == rollout_id]
    seqs |= {s for s, _ in scored}
    trained = {b for b, rid in index.batch_samples if rid == rollout_id}
    batches = [b for b in index.batches if b[0] in trained]
    seqs |= {b[0] for b in batches}
    seqs |= _sources(index, batches, {a for _, a in scored})
    produced = {b[1] for b in batches}
    versions = set(range(policy_min, policy_max + 1))
    versions |= {w[1] for w in index.weights if w[2] in produced}
    seqs |= {w[0] for w in index.weights if w[1] in versions}
    ids = {e[0]: e[1] for e in index.events if e[0] in seqs}
    return Wanted(tuple(sorted(seqs)), ids)


async def fetch(bus: Bus, wanted: Wanted) -> list[Event]:
    """The events at ``wanted.seqs`` (offloaded bodies resolved, legacy versions upcast),
    in log order; ``StaleLake`` if one is not the event the index recorded there."""
    from bus.reader import stored_event

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
    ``lake``'s index (current: sync it first) and fetched from ``bus``'s stream."""
    index = load_index(lake)
    rollout_id = resolve(index, ident)
    return rollout_id, await fetch(bus, chain_seqs(index, rollout_id))
