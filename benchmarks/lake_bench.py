"""Lake benchmark: how fast the log becomes tables, and how fast the tables answer.

1. Sync: publish ``--n`` TraceCompleted events (tests/samples.py traces, ``--tokens``
   completion tokens each) to a temporary embedded server, then time ``sync_run``
   (read + decode + row building + Parquet) cold, again (idempotent: nothing to do), and
   after ``--n // 10`` more events (incremental).
2. Query: ``--rows`` synthetic rollout rows written as Parquet parts into a lake, then
   the median time of a DuckDB GROUP BY over the ``rollouts`` view (and the raw parts),
   and of the same aggregation through ``replay.open_run`` (Polars).

    python -m benchmarks.lake_bench [--n 5000] [--rows 1000000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import polars as pl

import replay
from benchmarks.common import save
from bus.runtime import Bus
from bus.server import EmbeddedServer
from replay.lake import lake_dir, sync_run, to_frame, write_part
from replay.sql import connect
from schemas import TraceCompleted
from tests.samples import every_event, trace

GROUP_BY = "SELECT env, step, count(*) AS n, avg(reward) AS reward, avg(completion_tokens) AS tokens FROM {} GROUP BY env, step"  # fmt: skip


def events(run: str, n: int, tokens: int, start: int = 0) -> list[TraceCompleted]:
    (template,) = [e for e in every_event(run) if isinstance(e, TraceCompleted)]
    return [
        msgspec.structs.replace(
            template, event_id=f"ev-{i}", trace=trace(run, rollout=f"r{i}", n_tokens=tokens)
        )
        for i in range(start, start + n)
    ]


async def bench_sync(n: int, tokens: int) -> dict[str, Any]:
    run = "lakebench"
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(Path(tmp) / "nats") as server:
        bus = await Bus.connect(server.url, run=run, producer="bench")
        await bus.ensure_stream()
        await bus.publish_many(events(run, n, tokens))
        lake = lake_dir(Path(tmp) / "runs", run)
        cold = await sync_run(bus, lake)
        again = await sync_run(bus, lake)
        await bus.publish_many(events(run, n // 10, tokens, start=n))
        incr = await sync_run(bus, lake)
        await bus.close()
        size = sum(p.stat().st_size for p in lake.rglob("*.parquet"))
    rows = sum(cold.rows.values())
    return {
        "events": n,
        "completion_tokens_per_trace": tokens,
        "cold_s": round(cold.seconds, 3),
        "cold_events_per_s": round(n / cold.seconds),
        "cold_rows_per_s": round(rows / cold.seconds),
        "rows_per_event": round(rows / n, 2),
        "idempotent_resync_s": round(again.seconds, 4),
        "incremental_events": incr.events,
        "incremental_s": round(incr.seconds, 3),
        "lake_mb": round(size / 1e6, 2),
    }


def synthetic_rollouts(n: int, seed: int = 0) -> pl.DataFrame:
    """``n`` rollouts rows with the lake's columns (4 envs, 1000 steps, random rewards)."""
    rng = np.random.default_rng(seed)
    frame = to_frame("rollouts", [])
    columns: dict[str, Any] = {
        "run": np.full(n, "bench"), "seq": np.arange(1, n + 1),
        "env": rng.choice(["reverse-text", "math", "code", "chat"], n),
        "step": np.sort(rng.integers(0, 1000, n)), "reward": rng.random(n),
        "completion_tokens": rng.integers(1, 512, n), "prompt_tokens": rng.integers(16, 256, n),
        "rollout_id": np.char.add("r", np.arange(n).astype(str)), "split": np.full(n, "train"),
        "policy_min": rng.integers(0, 1000, n), "total_s": rng.random(n),
    }  # fmt: skip
    data = pl.DataFrame({c: pl.Series(c, v).cast(frame.schema[c]) for c, v in columns.items()})
    missing = [pl.lit(None, t).alias(c) for c, t in frame.schema.items() if c not in columns]
    return data.with_columns(missing).select(frame.columns)  # the lake's column order


def timed(fn: Callable[[], object], repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_query(rows: int, parts: int = 8) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        frame = synthetic_rollouts(rows)
        lake = lake_dir(tmp, "bench")
        t0 = time.perf_counter()
        for chunk in frame.iter_slices(-(-rows // parts)):
            write_part(lake, "rollouts", chunk)
        write_s = time.perf_counter() - t0
        con = connect(tmp, "bench")
        view = GROUP_BY.format("rollouts")
        groups = len(con.sql(view).fetchall())
        duck_view = timed(lambda: con.sql(view).fetchall())
        duck_raw = timed(lambda: con.sql(GROUP_BY.format("_rollouts")).fetchall())
        con.close()
        lazy = replay.open_run("bench", tmp, sync=False).rollouts
        polars_s = timed(
            lambda: (
                lazy.group_by("env", "step")
                .agg(pl.len(), pl.col("reward").mean(), pl.col("completion_tokens").mean())
                .collect()
            )
        )
    return {
        "rows": rows,
        "parts": parts,
        "groups": groups,
        "write_parquet_s": round(write_s, 3),
        "duckdb_group_by_view_ms": round(duck_view * 1e3, 1),
        "duckdb_group_by_parts_ms": round(duck_raw * 1e3, 1),
        "polars_group_by_ms": round(polars_s * 1e3, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=5000, help="TraceCompleted events to sync")
    parser.add_argument("--tokens", type=int, default=128, help="completion tokens per trace")
    parser.add_argument("--rows", type=int, default=1_000_000, help="synthetic rollout rows")
    args = parser.parse_args()
    results = {
        "sync": asyncio.run(bench_sync(args.n, args.tokens)),
        "query": bench_query(args.rows),
    }
    for section, values in results.items():
        print(section, values)
    print("saved", save("lake", results))


if __name__ == "__main__":
    main()
