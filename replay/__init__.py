"""Replay and analytics: the run is its log.

    import replay
    run = replay.open_run("smoke1", data_dir="runs")         # syncs the lake first if needed
    run.rollouts.group_by("step").agg(pl.col("reward").mean()).collect()

- reading a run's log in order is ``bus.reader.LogReader`` (legacy versions upcast by
  ``schemas.legacy``, unknown ones reported and skipped), the same reader roles use.
- ``algorithm``, ``trainer``, ``rubric``, ``orchestrator``:
  re-run a role's pure core over the recorded log and diff (``rlbus replay``);
  ``diff``: the pure comparisons they share (exact, the first difference first).
- ``lake``: the log materialised as Parquet tables (``rlbus lake sync``);
  ``tables``: the pure row builders; ``sql``: DuckDB views (``rlbus sql``);
  ``trace_index``: which stored events a rollout's chain needs, written with the lake.
- ``inspect``: one rollout and its causation chain through the log (``rlbus trace``).
- ``portable``: a whole run in one file, loadable on another machine (``rlbus export``,
  ``rlbus import``).
- ``plots``: a run's curves in one PNG, read from its log alone (``rlbus plot``).
- ``open_run``: the same tables as polars LazyFrames (below).

Heavy imports (polars, duckdb, nats) happen inside functions: importing ``replay`` is free.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import polars as pl

    from bus.reader import Progress
    from replay.lake import SyncResult


@dataclass(frozen=True)
class RunTables:
    """Every lake table of one run as a polars LazyFrame (``scan_parquet``; nothing is read
    until ``collect``). ``rollouts`` has ``batch_step`` joined in, as the SQL view; its
    ``rewards``/``metrics`` stay lists of {name, value} (polars has no MAP type)."""

    run: str
    lake: Path
    synced: SyncResult | None  # what the sync of ``open_run`` added (None: not synced)
    events: pl.LazyFrame
    runs: pl.LazyFrame
    tasks: pl.LazyFrame
    rollouts: pl.LazyFrame
    rollout_tokens: pl.LazyFrame
    samples: pl.LazyFrame
    sample_tokens: pl.LazyFrame
    batches: pl.LazyFrame
    batch_samples: pl.LazyFrame
    metrics: pl.LazyFrame
    eval: pl.LazyFrame
    weights: pl.LazyFrame
    weights_stored: pl.LazyFrame
    dead_letters: pl.LazyFrame
    algorithms: pl.LazyFrame

    @property
    def train_metrics(self) -> pl.LazyFrame:
        import polars as pl

        return self.metrics.filter(pl.col("role") == "trainer")

    @property
    def orchestrator_metrics(self) -> pl.LazyFrame:
        import polars as pl

        return self.metrics.filter(pl.col("role") == "orchestrator")

    def tables(self) -> dict[str, pl.LazyFrame]:
        skip = {"run", "lake", "synced"}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}


def scan_table(lake: Path, table: str) -> pl.LazyFrame:
    """One table's parts as a LazyFrame; columns are the union over parts (a part written
    before a new ``reward_<name>`` existed reads it as null)."""
    import polars as pl

    from replay.lake import parts, to_frame

    files = [p for _, _, p in parts(lake, table)]
    if not files:
        return to_frame(table, []).lazy()
    schema: dict[str, Any] = {}
    for f in files:
        for name, dtype in pl.read_parquet_schema(f).items():
            schema.setdefault(name, dtype)
    return pl.scan_parquet(files, schema=schema, missing_columns="insert")


def sync_lake(
    run: str,
    data_dir: str | Path = "runs",
    nats_url: str | None = None,
    force: bool = False,
    on_progress: Progress | None = None,
) -> SyncResult | None:
    """Sync ``run``'s lake if its stream holds events past the lake (the policy of
    ``open_run``'s ``sync=None``; ``force`` is ``sync=True``: sync whatever the lake
    says); None when it did not sync. A finished run is asked too: its log can go on
    after the run (a shadow ``rlbus algorithm attach`` appends samples). Callable from
    async code too (it then syncs on a thread with its own event loop, and calls
    ``on_progress(events read, events to read)`` from that thread)."""
    from bus.server import reachable_server
    from configs.paths import RunPaths
    from replay.lake import sync, sync_if_behind

    paths = RunPaths(Path(data_dir), run)
    # --nats-url, $RLBUS_NATS_URL, the run's running server, or one started on its store.
    with reachable_server(paths.nats, nats_url) as url:
        if url is None:
            if force:
                raise LookupError(f"no NATS server for run {run!r} and no store under {data_dir}")
            return None
        coro = (sync if force else sync_if_behind)(run, url, paths.data_dir, on_progress)
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # called from async code
            return pool.submit(asyncio.run, coro).result()


def open_run(
    run: str,
    data_dir: str | Path = "runs",
    sync: bool | None = None,
    nats_url: str | None = None,
) -> RunTables:
    """The run's lake tables as LazyFrames.

    ``sync=None`` (default): sync first through a reachable server (``nats_url``,
    $RLBUS_NATS_URL, the run's running embedded server, or a temporary server started on
    its store), except for a finished run whose lake already holds its ``run.stopped``
    and whose server is not running. ``sync=True``: always sync (error if impossible).
    ``sync=False``: read the lake as it is.
    """
    import polars as pl

    from configs.paths import RunPaths
    from replay.sql import UNFILTERED
    from replay.tables import TABLES

    paths = RunPaths(Path(data_dir), run)
    synced = None if sync is False else sync_lake(run, paths.data_dir, nats_url, force=bool(sync))
    lake = paths.lake
    frames = {t: scan_table(lake, t) for t in TABLES}
    # As SQL's views: messages a reader dead-lettered are not part of the run.
    dead = frames["dead_letters"].select("run", pl.col("stream_seq").alias("seq"))
    for t in TABLES:
        if t not in UNFILTERED:
            frames[t] = frames[t].join(dead, on=["run", "seq"], how="anti")
    trained = (
        frames["batch_samples"]
        .group_by("run", "rollout_id")
        .agg(pl.col("step").min().alias("batch_step"))
    )
    frames["rollouts"] = frames["rollouts"].join(trained, on=["run", "rollout_id"], how="left")
    return RunTables(run=run, lake=lake, synced=synced, **frames)


__all__ = ["RunTables", "open_run", "scan_table", "sync_lake"]
