"""SQL over the lake: a DuckDB connection with one view per table, for one run or all.

    con = connect("runs", run="smoke1")           # run=None: every run under runs/
    con.sql("select step, avg(reward) from rollouts group by step").fetchall()
    frame = query("select * from train_metrics_wide", "runs", "smoke1")   # a polars DataFrame

Views read the Parquet parts in place (``read_parquet(..., union_by_name=true)``, so
parts written before a new named reward appeared still union; ``can_have_nan``, so a
filter on a float column finds its NaNs: ``_parquet_options``). Every table but
``events`` (the raw log) and ``dead_letters`` leaves out the messages a reader
dead-lettered (``UNFILTERED``): forged and impossible events are not part of the run. A table with no parts
yet is an empty view with the declared columns, so every documented query runs on any
run. Call ``replay.lake.sync`` first (``rlbus sql`` does) to see the newest events; a
connection sees the parts that existed when it was made.

Views beyond the tables (docs/analytics.md lists every column):
- ``rollouts``: ``rewards``/``metrics`` as MAPs (``rewards['lcs']``), plus ``batch_step``,
  the first step whose batch trained a sample of the rollout (NULL if none).
- ``rollouts_trained``: one row per trained (rollout, branch): rollout columns plus the
  batch's step, phase, position and the sample's staleness.
- ``trained_samples``: the algorithm's samples that a batch trained (joined through the
  batch's ``sources``, so a shadow algorithm's samples of the same rollout are not).
- ``train_metrics`` / ``orchestrator_metrics`` (long) and ``*_wide`` (one column per
  metric, built from the metric names present when connecting).
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import polars as pl

from configs.paths import RunPaths
from replay.lake import to_frame
from replay.tables import TABLES

_VIEWS = {
    "rollouts": """
        SELECT r.* REPLACE (map_from_entries(r.rewards) AS rewards,
                            map_from_entries(r.metrics) AS metrics,
                            map_from_entries(r.member_rewards) AS member_rewards,
                            map_from_entries(r.member_models) AS member_models),
               b.batch_step
        FROM _rollouts r
        LEFT JOIN (SELECT run, rollout_id, min(step) AS batch_step
                   FROM _batch_samples GROUP BY run, rollout_id) b
        USING (run, rollout_id)""",
    "rollouts_trained": """
        SELECT r.* EXCLUDE (batch_step), b.step AS batch_step, b.branch, b.phase,
               b.position, b.staleness
        FROM rollouts r JOIN _batch_samples b USING (run, rollout_id)""",
    "trained_samples": """
        SELECT s.*, b.step AS batch_step, b.phase, b.position, b.staleness
        FROM _batch_samples b
        JOIN _batches bt ON bt.run = b.run AND bt.step = b.step
        JOIN _samples s ON s.run = b.run AND s.rollout_id = b.rollout_id
             AND s.branch = b.branch AND list_contains(bt.sources, s.event_id)""",
    "train_metrics": """
        SELECT run, seq, step, policy_version, metric, value, ts_ns
        FROM _metrics WHERE role = 'trainer'""",
    "orchestrator_metrics": """
        SELECT run, seq, step, policy_version, metric, value, ts_ns
        FROM _metrics WHERE role = 'orchestrator'""",
}
WIDE = ("train_metrics", "orchestrator_metrics")
# A message some reader dead-lettered (undecodable, or refused by its validation: a
# forged or impossible event) is not part of the run: the tables leave it out, all but
# the raw log and the dead letters themselves.
UNFILTERED = ("events", "dead_letters")
_DEAD = (
    "SELECT 1 FROM (SELECT run, stream_seq AS seq_of FROM _dead_letters) d WHERE d.run = x.run AND"
)


def _ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _parquet_options(con: duckdb.DuckDBPyConnection) -> str:
    """Options of every ``read_parquet`` of the lake.

    Parquet writers leave NaN out of a float column's min/max statistics, and DuckDB by
    default reads them as "no NaN here", so a pushed-down filter skipped whole row
    groups: ``WHERE isnan(value)`` found nothing where ``count(*) FILTER (WHERE
    isnan(value))`` found the NaNs (``value > x`` missed them too: NaN sorts above every
    number). The lake now writes no statistics into a part that holds a NaN
    (``replay.lake.write_part``); ``can_have_nan`` covers parts written before that, on
    a DuckDB that has the option."""
    known = con.sql(
        "SELECT bool_or(list_contains(parameters, 'can_have_nan')) FROM duckdb_functions() "
        "WHERE function_name = 'read_parquet'"
    ).fetchall()
    return ", union_by_name=true" + (", can_have_nan=true" if known[0][0] else "")


def table_glob(data_dir: str | Path, run: str | None, table: str) -> str:
    """The glob of a table's parts: one run's, or every run's under ``data_dir``."""
    return str(RunPaths(Path(data_dir), run or "*").lake / table / "*.parquet")


def connect(
    data_dir: str | Path = "runs", run: str | None = None, database: str = ":memory:"
) -> duckdb.DuckDBPyConnection:
    """A DuckDB connection with the lake's views (see the module docstring)."""
    con = duckdb.connect(database)
    options = _parquet_options(con)
    root = Path(data_dir)
    # dead_letters first: every table but the raw log (events) leaves out what it names
    for t in sorted(TABLES, key=lambda t: t != "dead_letters"):
        pattern = table_glob(root, run, t)
        if list(root.glob(str(Path(pattern).relative_to(root)))):
            source = f"read_parquet({_literal(pattern)}{options})"
        else:  # no parts yet: an empty relation with the declared columns
            con.register(f"_{t}_empty", to_frame(t, []).to_arrow())
            source = f"_{t}_empty"
        if t not in UNFILTERED:
            source = f"(SELECT * FROM {source} x WHERE NOT EXISTS ({_DEAD} d.seq_of = x.seq))"
        con.execute(f"CREATE VIEW {_ident('_' + t)} AS SELECT * FROM {source}")
        if t not in _VIEWS:
            con.execute(f"CREATE VIEW {_ident(t)} AS SELECT * FROM {_ident('_' + t)}")
    for name, body in _VIEWS.items():
        con.execute(f"CREATE VIEW {_ident(name)} AS {body}")
    # `rlbus replay <run> algorithm <other>` writes shadow scores beside the lake, with the
    # samples table's columns, so SQL can compare algorithms on the same rollouts.
    shadow = str(RunPaths(root, run or "*").shadow_samples / "*.parquet")
    if list(root.glob(str(Path(shadow).relative_to(root)))):
        con.execute(
            f"CREATE VIEW shadow_samples AS SELECT * FROM read_parquet({_literal(shadow)}{options})"
        )
    else:
        con.execute("CREATE VIEW shadow_samples AS SELECT * FROM _samples WHERE false")
    for name in WIDE:
        metrics = [m for (m,) in con.sql(f"SELECT DISTINCT metric FROM {name} ORDER BY 1").fetchall()]  # fmt: skip
        columns = "".join(
            f", max(value) FILTER (WHERE metric = {_literal(m)}) AS {_ident(m)}" for m in metrics
        )
        con.execute(
            f"CREATE VIEW {_ident(name + '_wide')} AS SELECT run, step{columns} "
            f"FROM {name} GROUP BY run, step"
        )
    return con


def views(con: duckdb.DuckDBPyConnection) -> list[str]:
    """The public views (internal ``_<table>`` ones left out)."""
    rows = con.sql(
        "SELECT view_name FROM duckdb_views() WHERE NOT internal AND view_name NOT LIKE '\\_%' ESCAPE '\\' ORDER BY 1"
    ).fetchall()
    return [r[0] for r in rows]


def run_query(con: duckdb.DuckDBPyConnection, sql: str) -> pl.DataFrame | None:
    """The result of ``sql`` as a DataFrame (None for a statement without a result).

    ``to_arrow_table`` rather than ``arrow()``: the latter returns a reader that blocks the
    connection until drained (NATS_NOTES #17)."""
    rel = con.sql(sql)
    if rel is None:
        return None
    frame = pl.from_arrow(rel.to_arrow_table())
    assert isinstance(frame, pl.DataFrame)
    return frame


def query(sql: str, data_dir: str | Path = "runs", run: str | None = None) -> pl.DataFrame:
    """One query over the lake as it is now (no sync), as a polars DataFrame."""
    con = connect(data_dir, run)
    try:
        frame = run_query(con, sql)
    finally:
        con.close()
    if frame is None:
        raise ValueError("the statement returned no result")
    return frame
