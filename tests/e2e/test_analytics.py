"""Analytics on a real smoke run: the lake holds the whole log, every query documented in
docs/analytics.md runs and returns its documented columns, and `rlbus sql` agrees with
what the orchestrator recorded."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import typer
from typer.testing import CliRunner

import replay
from replay.sql import connect
from roles.cli.lake import lake_app, sql
from schemas import EvalCompleted, MetricsReported, TraceCompleted
from tests.e2e.conftest import ANALYTICS_RUN

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
RUN = ANALYTICS_RUN  # the run of the session fixture ``smoke`` (tests/e2e/conftest.py)
BLOCK = re.compile(r"^### (?P<title>.+?)\n.*?```sql\n(?P<sql>.*?)```\s*\nColumns: (?P<cols>.+?)\.\n", re.S | re.M)  # fmt: skip


def documented_queries() -> list[tuple[str, str, list[str]]]:
    text = ROOT.joinpath("docs", "analytics.md").read_text()
    found = [
        (m["title"], m["sql"], [c.strip(" `") for c in m["cols"].split(",")])
        for m in BLOCK.finditer(text)
    ]
    assert len(found) == text.count("```sql"), "every sql block needs a 'Columns:' line"
    return found


QUERIES = documented_queries()


def cli() -> typer.Typer:
    app = typer.Typer()
    app.add_typer(lake_app, name="lake")
    app.command("sql")(sql)
    return app


def test_docs_document_at_least_ten_queries() -> None:
    """docs/analytics.md keeps its ten-plus queries, each with its columns."""
    assert len(QUERIES) >= 10


def test_lake_holds_every_event_of_the_run(smoke: tuple[Path, list[Any]]) -> None:
    """One events row per stored event, by type; one rollouts row per trace, eval ones included."""
    data, events = smoke
    con = connect(data, RUN)
    lake_types = dict(con.sql("select type, count(*) from events group by 1").fetchall())
    log_types = Counter(str(type(e).__struct_config__.tag).split("/")[0] for e in events)
    assert lake_types == dict(log_types)
    traces = sum(1 for e in events if isinstance(e, TraceCompleted)) + sum(
        len(e.traces) for e in events if isinstance(e, EvalCompleted)
    )
    assert con.sql("select count(*) from rollouts").fetchall() == [(traces,)]
    assert con.sql("select count(distinct split) from rollouts").fetchall() == [(2,)]
    con.close()


@pytest.mark.parametrize(("title", "query", "columns"), QUERIES, ids=[q[0] for q in QUERIES])
def test_documented_query_runs(
    smoke: tuple[Path, list[Any]], title: str, query: str, columns: list[str]
) -> None:
    """Each documented query runs on a real run's lake and returns rows with its columns."""
    con = connect(smoke[0], RUN)
    table = con.sql(query).to_arrow_table()
    con.close()
    assert table.column_names == columns, title
    assert table.num_rows > 0, title


def test_rlbus_sql_reward_matches_the_orchestrator(smoke: tuple[Path, list[Any]]) -> None:
    """Per step, the mean reward of the trained samples (rlbus sql) equals the orchestrator's
    recorded reward_mean: it averaged exactly those samples' rewards."""
    data, events = smoke
    recorded = {
        e.step: e.values["reward_mean"]
        for e in events
        if isinstance(e, MetricsReported) and e.role == "orchestrator"
    }
    q = "select batch_step as step, avg(reward) as r from trained_samples group by 1 order by 1"
    res = CliRunner().invoke(cli(), ["sql", "--run", RUN, "--data-dir", str(data), "-f", "json", q])
    assert res.exit_code == 0, res.output
    got = {row["step"]: row["r"] for row in json.loads(res.stdout)}
    assert set(got) == set(recorded) == {1, 2, 3, 4}
    for step, value in recorded.items():
        assert got[step] == pytest.approx(value, rel=1e-12, abs=1e-12), step


def test_sql_formats_and_shell(smoke: tuple[Path, list[Any]], tmp_path: Path) -> None:
    """CSV, Parquet (--out), the table printer and the stdin shell all return the same rows."""
    data = str(smoke[0])
    base = ["sql", "--run", RUN, "--data-dir", data, "--no-sync"]
    q = "select rollout_id, reward, rewards from rollouts order by rollout_id"
    n = len(replay.open_run(RUN, data, sync=False).rollouts.collect())
    csv = CliRunner().invoke(cli(), [*base, "-f", "csv", q])
    assert csv.exit_code == 0, csv.output
    assert len(csv.stdout.strip().splitlines()) == n + 1
    out = tmp_path / "r.parquet"
    assert CliRunner().invoke(cli(), [*base, "-f", "parquet", "-o", str(out), q]).exit_code == 0
    assert pl.read_parquet(out).height == n
    assert CliRunner().invoke(cli(), [*base, "-f", "parquet", q]).exit_code != 0
    shell = CliRunner().invoke(
        cli(),
        base,
        input="select count(*) as n\n  from rollouts;\nselect nope;\n.quit\nselect 1;\n",
    )
    assert shell.exit_code == 0, shell.output
    assert f"│ {n} │" in shell.stdout and "error:" in shell.stdout
    assert shell.stdout.count("(1 rows)") == 1  # input after .quit is not run


def test_polars_api_matches_sql(smoke: tuple[Path, list[Any]]) -> None:
    """open_run's LazyFrames agree with the SQL views (row counts, a staleness histogram)."""
    data = smoke[0]
    run = replay.open_run(RUN, data)  # finished run, lake complete: no sync, no server
    assert run.synced is None
    con = connect(data, RUN)
    for name, frame in run.tables().items():
        assert frame.collect().height == con.sql(f"select count(*) from {name}").fetchall()[0][0]
    hist = (
        run.batch_samples.filter(pl.col("phase") == "rl")
        .group_by("staleness")
        .len()
        .sort("staleness")
    )
    sql_hist = con.sql(
        "select staleness, count(*) from batch_samples where phase = 'rl' group by 1 order by 1"
    ).fetchall()
    assert [tuple(r) for r in hist.collect().iter_rows()] == sql_hist
    trained = run.rollouts.filter(pl.col("batch_step").is_not_null()).collect().height
    assert trained == con.sql("select count(*) from rollouts where batch_step is not null").fetchall()[0][0]  # fmt: skip
    con.close()
