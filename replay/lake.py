"""The Parquet lake: a run's log materialised as tables, incrementally and idempotently.

    rlbus lake sync <run>               # on demand (a running run's server, or its store)
    rlbus role lake --run <run>         # live: syncs every few seconds (``roles.lake``)
    await sync_run(bus, lake_dir("runs", run))
    await sync_if_behind(run, url, "runs")  # rlbus sql: only if the stream moved past the lake

Layout: ``runs/<run>/lake/<table>/part-<first_seq>-<last_seq>.parquet`` (sequences
zero-padded so names sort), one folder per table of ``replay.tables.SCHEMAS``, and
``_trace/part-<first_seq>-<last_seq>.msgpack``: the trace index (``replay.trace_index``:
the few ids per event that name a rollout's chain, for ``rlbus trace``), and
``_state.json``: the last stream sequence each table and the index cover. A sync reads
the log from the oldest position + 1 (``bus.reader.LogReader``: legacy events upcast,
unreadable ones reported and skipped), keeps for each table only rows past that
table's position, writes each table's new rows as one part (temp file + rename), and
the index's entries past its position as one index part, then records the new positions. Running it twice adds nothing.

Crash safety without a transaction: a part's name says the last sequence it holds, so
on start the positions are raised to the newest part of each table (a part renamed
just before a crash is never written twice); leftover temp files are deleted; a part
whose range lies inside another's (a compaction interrupted before deleting its
inputs) is deleted. One sync at a time per lake (an ``flock`` on ``_lock``).
Many small parts (a live sync every 5 s) are merged by ``compact`` past 64 parts.
``on_progress(done, total)`` counts the sequences read of those the sync set out to read
(the stream's last sequence at the start minus the lake's position): ``rlbus lake sync``
and ``rlbus sql`` draw it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from bus.reader import LogReader, Progress, Skipped
from bus.runtime import Bus
from configs.paths import RunPaths
from replay.tables import DYNAMIC_PREFIX, SCHEMAS, TABLES, rows_for
from replay.trace_index import (
    STATE,
    IndexPart,
    index_part,
    index_parts,
    index_seq,
    write_index_part,
)
from schemas import RunStopped

PART = re.compile(r"^part-(\d+)-(\d+)\.parquet$")
NULL_IF_NEGATIVE = {"policy_versions"}  # -1 = no policy sampled this token
COMPACT_AT = 64
_NP = {pl.Int32: np.int32, pl.Float32: np.float32, pl.Boolean: np.bool_}


def lake_dir(data_dir: str | Path, run: str) -> Path:
    return RunPaths(Path(data_dir), run).lake


def parts(lake: Path, table: str) -> list[tuple[int, int, Path]]:
    """(first_seq, last_seq, path) of each part of ``table``, in sequence order."""
    folder = lake / table
    found = [(m, p) for p in folder.glob("part-*.parquet") if (m := PART.match(p.name))]
    return sorted((int(m[1]), int(m[2]), p) for m, p in found)


# -- rows to Parquet ----------------------------------------------------------------------


def _list_series(name: str, values: list[Any], dtype: pl.List) -> pl.Series:
    """A list column from numpy arrays (or None) without a Python loop over elements."""
    np_type = _NP[dtype.inner]  # type: ignore[index]
    pieces: list[np.ndarray] = [
        np.zeros(0, np_type) if v is None else np.asarray(v, np_type) for v in values
    ]
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum([len(p) for p in pieces], out=offsets[1:])
    flat = np.concatenate(pieces) if pieces else np.zeros(0, np_type)
    mask = flat < 0 if name in NULL_IF_NEGATIVE else None
    array = pa.LargeListArray.from_arrays(
        pa.array(offsets),
        pa.array(flat, mask=mask),
        mask=pa.array([v is None for v in values], type=pa.bool_()),
    )
    return pl.Series(name, pl.from_arrow(array), dtype=dtype)


@functools.cache
def _arrow_types(table: str) -> dict[str, pa.DataType]:
    empty = pl.DataFrame(schema=SCHEMAS[table]).to_arrow().schema
    return {f.name: f.type for f in empty}


def to_frame(table: str, rows: list[dict[str, Any]]) -> pl.DataFrame:
    """The rows of one table as a DataFrame with the table's declared column types.

    Scalars go through ``pa.array`` with the declared Arrow type: building a polars Series
    from Python dicts (the ``rewards`` structs) was 1000x slower."""
    columns: dict[str, Any] = dict(SCHEMAS[table])
    if prefix := DYNAMIC_PREFIX.get(table):
        extra = {k for r in rows for k in r if k.startswith(prefix) and k not in columns}
        columns.update(dict.fromkeys(sorted(extra), pl.Float64))
    arrow = _arrow_types(table)
    series = []
    for name, dtype in columns.items():
        values = [r.get(name) for r in rows]
        if isinstance(dtype, pl.List) and dtype.inner in _NP:
            series.append(_list_series(name, values, dtype))
        else:
            array = pa.array(values, type=arrow.get(name, pa.float64()))
            series.append(pl.Series(name, pl.from_arrow(array), dtype=dtype))
    return pl.DataFrame(series)


def has_nan(series: pl.Series) -> bool:
    """Whether a float anywhere in ``series`` (lists and structs included) is NaN."""
    dtype = series.dtype
    if dtype.is_float():
        return bool(series.is_nan().any())
    if isinstance(dtype, pl.List):
        return has_nan(series.list.explode())
    if isinstance(dtype, pl.Struct):
        return any(has_nan(field) for field in series.struct.unnest().get_columns())
    return False


def write_part(lake: Path, table: str, frame: pl.DataFrame) -> Path:
    """Write one part atomically: a reader sees the whole file or none of it.

    A part that holds a NaN is written without column statistics: Parquet's min/max
    leave NaN out, and a reader that prunes on them (DuckDB's filter pushdown) skipped
    those rows, so ``WHERE isnan(value)`` missed what an aggregate found. A part without
    NaN keeps its statistics (they are exact), so pruning on ``seq`` or ``step`` stays."""
    first, last = int(frame["seq"].min()), int(frame["seq"].max())  # type: ignore[arg-type]
    folder = lake / table
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"part-{first:012d}-{last:012d}.parquet"
    tmp = folder / f".{path.name}.tmp"
    statistics = not any(has_nan(column) for column in frame.get_columns())
    frame.write_parquet(tmp, compression="zstd", statistics=statistics)
    os.replace(tmp, path)
    return path


# -- state ---------------------------------------------------------------------------------


def load_state(lake: Path) -> dict[str, Any]:
    """``{"tables": {table: last seq covered}, "trace_index": last seq covered, "stopped":
    bool}``, reconciled with the parts (``index_seq`` reads the index's position alone)."""
    try:
        state = json.loads((lake / STATE).read_text())
    except FileNotFoundError:
        state = {}
    tables = {t: int(state.get("tables", {}).get(t, 0)) for t in TABLES}
    for t in TABLES:
        if found := parts(lake, t):
            tables[t] = max(tables[t], found[-1][1])
    stopped = bool(state.get("stopped", False))
    return {"tables": tables, "trace_index": index_seq(lake), "stopped": stopped}


def save_state(lake: Path, state: dict[str, Any]) -> None:
    tmp = lake / f".{STATE}.tmp"
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True))
    os.replace(tmp, lake / STATE)


def repair(lake: Path) -> None:
    """Delete leftover temp files and parts contained in another part's range."""
    for tmp in lake.glob("*/.part-*.tmp"):  # the index's too
        tmp.unlink(missing_ok=True)
    for found in [*(parts(lake, t) for t in TABLES), index_parts(lake)]:
        for a in found:
            if any(b is not a and b[0] <= a[0] and a[1] <= b[1] for b in found):
                a[2].unlink(missing_ok=True)


def _lock_file(lake: Path) -> Any:
    lake.mkdir(parents=True, exist_ok=True)
    return open(lake / "_lock", "w")  # noqa: SIM115 - closed by the caller's ``with``


@contextlib.asynccontextmanager
async def locked(lake: Path, timeout_s: float = 60.0) -> AsyncIterator[None]:
    """One writer per lake (a live lake role and ``rlbus sql`` may sync at once)."""
    with _lock_file(lake) as fh:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"lake {lake} is locked by another sync") from None
                await asyncio.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# -- sync ----------------------------------------------------------------------------------


@dataclass
class SyncResult:
    run: str
    start_seq: int  # first sequence read
    last_seq: int  # last sequence covered by every table
    events: int = 0
    rows: dict[str, int] = field(default_factory=dict)  # new rows per table
    skipped: list[Skipped] = field(default_factory=list)
    seconds: float = 0.0


async def sync_run(
    bus: Bus, lake: Path, chunk_events: int = 2000, on_progress: Progress | None = None
) -> SyncResult:
    """Append every event stored since the last sync to the lake (see the module docstring)."""
    t0 = time.perf_counter()
    async with locked(lake):
        repair(lake)
        state = load_state(lake)
        pos: dict[str, int] = state["tables"]
        start = min(*pos.values(), state["trace_index"]) + 1
        until = await stream_last_seq(bus)
        result = SyncResult(run=bus.run, start_seq=start, last_seq=start - 1)
        reader = LogReader(bus, from_seq=start, until_seq=until)
        buffer: dict[str, list[dict[str, Any]]] = {t: [] for t in TABLES}
        index = IndexPart()  # the trace index's entries, written with the tables' parts

        def report() -> None:  # by sequence: skipped messages are read too
            if on_progress is not None and until >= start:
                on_progress(reader.last_seq - start + 1, until - start + 1)

        def flush(upto: int) -> None:
            nonlocal index
            for t in TABLES:
                if buffer[t]:
                    write_part(lake, t, to_frame(t, buffer[t]))
                    result.rows[t] = result.rows.get(t, 0) + len(buffer[t])
                    buffer[t] = []
                pos[t] = max(pos[t], upto)
            if len(index):
                write_index_part(lake, index)
                index = IndexPart()
            state["trace_index"] = max(state["trace_index"], upto)
            save_state(lake, state)

        async for e in reader.entries():
            tables = rows_for(e.event, e.seq, subject=e.subject, stored_ns=e.stored_ns,
                              schema=e.schema, size=e.size, offloaded=e.offloaded)  # fmt: skip
            for t, rows in tables.items():
                if e.seq > pos[t]:
                    buffer[t].extend(rows)
            if e.seq > state["trace_index"]:
                index_part(tables, index)
            state["stopped"] = state["stopped"] or isinstance(e.event, RunStopped)
            result.events += 1
            if result.events % chunk_events == 0:
                flush(e.seq)
            report()
        flush(max(reader.last_seq, start - 1))
        report()
        result.skipped = reader.skipped
        result.last_seq = min(pos.values())
    result.seconds = time.perf_counter() - t0
    return result


def compact(lake: Path, table: str) -> Path | None:
    """Merge all parts of ``table`` into one (call under ``locked``); None if < 2 parts."""
    found = parts(lake, table)
    if len(found) < 2:
        return None
    frames = [pl.read_parquet(p) for _, _, p in found]
    merged = write_part(lake, table, pl.concat(frames, how="diagonal_relaxed"))
    for _, _, p in found:
        if p != merged:
            p.unlink()
    return merged


def synced_seq(lake: Path) -> int:
    """The last stream sequence every table of the lake and its trace index cover (0:
    never synced)."""
    state = load_state(lake)
    return min(*state["tables"].values(), state["trace_index"])


async def stream_last_seq(bus: Bus) -> int:
    """The last sequence stored in the run's stream; ``LookupError`` if it has none."""
    state = await bus.stream_state()
    if state is None:
        raise LookupError(f"run {bus.run!r} has no stream ({bus.stream}) on this server")
    return state.last_seq


async def sync_if_behind(
    run: str, url: str, data_dir: str | Path = "runs", on_progress: Progress | None = None
) -> SyncResult | None:
    """Sync ``run``'s lake only if its stream holds events past the lake's position.

    The question is asked of the stream, not of the lake: a finished run's lake that
    holds its ``run.stopped`` can still fall behind, because the log goes on after the
    run (a shadow ``rlbus algorithm attach`` on a finished run appends its samples).
    None when the lake was up to date."""
    lake = lake_dir(data_dir, run)
    bus = await Bus.connect(url, run=run, producer="lake")
    try:
        if await stream_last_seq(bus) <= synced_seq(lake):
            return None
        return await sync_run(bus, lake, on_progress=on_progress)
    finally:
        await bus.close()


async def sync(
    run: str, url: str, data_dir: str | Path = "runs", on_progress: Progress | None = None
) -> SyncResult:
    """Connect to ``url`` and sync ``run``'s lake under ``data_dir``."""
    bus = await Bus.connect(url, run=run, producer="lake")
    try:
        return await sync_run(bus, lake_dir(data_dir, run), on_progress=on_progress)
    finally:
        await bus.close()
