"""NaN in the lake: a filter finds the same rows as an aggregate, pushdown or not.

Parquet's min/max statistics leave NaN out, and DuckDB prunes row groups on them, so
``WHERE isnan(value)`` once found nothing while ``count(*) FILTER (WHERE isnan(value))``
found every NaN. The metrics come through the lake's real path (stream, sync, writer).
"""

from __future__ import annotations

from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from bus.runtime import Bus
from replay.lake import lake_dir, parts, sync_run, to_frame
from replay.sql import connect
from schemas import MetricsReported

pytestmark = pytest.mark.nats

NAN = float("nan")
LOSSES = [0.5, NAN, 0.25, NAN, 0.125, 0.0625]  # two NaN among finite values


def nan_counts(data_dir: Path, run: str) -> tuple[int, int, int]:
    """NaN rows found by a pushed-down filter, by an aggregate, and by ``value > 1``."""
    con = connect(data_dir, run)
    try:
        ((where,),) = con.sql("select count(*) from train_metrics where isnan(value)").fetchall()
        ((agg,),) = con.sql(
            "select count(*) filter (where isnan(value)) from train_metrics"
        ).fetchall()
        ((above,),) = con.sql("select count(*) from train_metrics where value > 1").fetchall()
    finally:
        con.close()
    return where, agg, above


async def test_nan_rows_are_found_by_a_filter_as_by_an_aggregate(bus: Bus, tmp_path: Path) -> None:
    await bus.publish_many(
        [
            MetricsReported(run=bus.run, role="trainer", step=i + 1, values={"loss": loss})
            for i, loss in enumerate(LOSSES)
        ]
    )
    await sync_run(bus, lake_dir(tmp_path, bus.run))

    # NaN sorts above every number in DuckDB, so `value > 1` is the NaN rows too.
    assert nan_counts(tmp_path, bus.run) == (2, 2, 2)
    ((_, _, part),) = parts(lake_dir(tmp_path, bus.run), "metrics")
    value = pq.ParquetFile(part).schema_arrow.get_field_index("value")
    assert not pq.ParquetFile(part).metadata.row_group(0).column(value).is_stats_set


def test_a_part_written_with_statistics_before_the_fix_is_read_right(tmp_path: Path) -> None:
    """A lake written before the writer left statistics out: the reader's option."""
    rows = [
        {"run": "old", "seq": i + 1, "role": "trainer", "step": i + 1, "metric": "loss",
         "value": loss, "producer": "t", "ts_ns": 0}
        for i, loss in enumerate(LOSSES)
    ]  # fmt: skip
    folder = lake_dir(tmp_path, "old") / "metrics"
    folder.mkdir(parents=True)
    part = folder / "part-000000000001-000000000006.parquet"
    to_frame("metrics", rows).write_parquet(part, compression="zstd")  # the old writer
    stats = pq.ParquetFile(part).metadata.row_group(0).column(6).statistics
    assert stats.has_min_max and stats.max == 0.5  # the NaN is not in them

    assert nan_counts(tmp_path, "old") == (2, 2, 2)
    assert pl.read_parquet(part)["value"].is_nan().sum() == 2
