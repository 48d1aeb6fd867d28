"""Lake row builders: every declared column, right values, per-token data only where it belongs."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import polars as pl
import pytest

from replay.lake import lake_dir, to_frame, write_part
from replay.sql import connect
from replay.tables import SCHEMAS, TABLES, reward_column, rows_for
from schemas import (
    EvalCompleted,
    FilterVerdict,
    MetricsReported,
    ToolCall,
    Trace,
    TraceCompleted,
    TraceError,
)
from tests.samples import every_event, trace

TOKEN_TABLES = {"rollout_tokens", "sample_tokens"}


def all_rows() -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {t: [] for t in TABLES}
    for seq, event in enumerate(every_event(), start=1):
        for table, rows in rows_for(event, seq, subject=f"rl.golden.x.{seq}").items():
            out[table].extend(rows)
    return out


def test_every_row_has_exactly_the_declared_columns() -> None:
    """Each row fills every column of its table (plus ``reward_<name>`` in rollouts only)."""
    rows = all_rows()
    for table, table_rows in rows.items():
        for row in table_rows:
            extra = set(row) - set(SCHEMAS[table])
            assert set(SCHEMAS[table]) <= set(row), (table, set(SCHEMAS[table]) - set(row))
            if table == "rollouts":
                assert extra == {"reward_lcs"}
            else:
                assert not extra, (table, extra)
            assert row["run"] == "golden" and isinstance(row["seq"], int)


def test_each_event_kind_lands_in_its_tables() -> None:
    """One events row per event; traces, eval traces, samples, batches... in their tables."""
    counts = {t: len(r) for t, r in all_rows().items()}
    assert counts == {
        "events": 13, "runs": 2, "tasks": 1, "rollouts": 2, "rollout_tokens": 2, "samples": 1,
        "sample_tokens": 1, "batches": 1, "batch_samples": 2, "metrics": 2, "eval": 0,
        "weights": 1, "weights_stored": 1, "dead_letters": 1, "algorithms": 2,
    }  # fmt: skip


def test_per_token_data_only_in_token_tables() -> None:
    """Wide tables hold no arrays or bytes; token tables hold aligned per-token arrays."""
    for table, table_rows in all_rows().items():
        for row in table_rows:
            arrays = [k for k, v in row.items() if isinstance(v, np.ndarray | bytes | memoryview)]
            if table in TOKEN_TABLES:
                assert arrays
            else:
                assert not arrays, (table, arrays)
    (tokens, _) = all_rows()["rollout_tokens"]
    n = tokens["n_tokens"]
    assert n == 5 + 12
    assert len(tokens["token_ids"]) == len(tokens["sampled"]) == len(tokens["logprobs"]) == n
    assert tokens["token_ids"].tolist() == [*range(5), *range(10, 22)]


def test_rollout_row_values() -> None:
    """Token counts, named rewards, first error kind and timings come from the trace."""
    e = every_event()[3]
    assert isinstance(e, TraceCompleted)
    (row,) = rows_for(e, 4)["rollouts"]
    assert (
        row["completion_tokens"] == 11 and row["prompt_tokens"] == 6
    )  # one answer token unsampled
    assert row["reward"] == 0.75 and row["reward_lcs"] == 0.75
    assert row["rewards"] == [{"name": "lcs", "value": 0.75}]
    assert row["error_type"] is None and row["num_errors"] == 0
    assert row["generate_s"] == 0.1 and row["total_s"] is None
    assert (row["split"], row["step"], row["request_id"], row["policy_max"]) == ("train", 2, "e-task", 3)  # fmt: skip
    err = TraceCompleted(run="golden", env="reverse-text", request_id="q", group_size=1, step=0, trace=trace(rollout="err"))  # fmt: skip
    assert rows_for(err, 1)["rollouts"][0]["error_type"] == "none"


def test_eval_traces_are_rollouts_of_their_split() -> None:
    """Each trace inside EvalCompleted is one rollouts row; the group size is the trace count."""
    e = every_event()[4]
    assert isinstance(e, EvalCompleted)
    (row,) = rows_for(e, 5)["rollouts"]
    assert row["step"] == 10 and row["group_size"] == 1 and row["request_id"] == "e-task"


def test_samples_and_batches_summaries() -> None:
    """Advantage summary over masked tokens; staleness = step - 1 - policy_min per batch sample."""
    rows = all_rows()
    (s,) = rows["samples"]
    assert (s["n_tokens"], s["n_masked"], s["n_sft"]) == (17, 11, 0)
    assert s["adv_mean"] == s["adv_min"] == s["adv_max"] == 0.5
    assert s["algorithm"] == "grpo" and s["group_excluded"] == 1 and s["zero_advantage"] is False
    (b,) = rows["batches"]
    assert b["sources"] == ["e-scored"] and b["n_samples"] == 2 and b["dropped_stale"] == 1
    assert [x["staleness"] for x in rows["batch_samples"]] == [3 - 1 - 3] * 2
    assert [x["position"] for x in rows["batch_samples"]] == [0, 1]


def test_eval_metrics_are_split_by_env_and_k() -> None:
    """``<env>/avg@k`` keys become (env, metric, k) rows of the eval table."""
    e = MetricsReported(run="r", role="eval", step=4, policy_version=4,
                        values={"a-b/avg@4": 0.5, "a-b/pass@4": 1.0, "a-b/errors": 0.0})  # fmt: skip
    rows = rows_for(e, 1)
    assert len(rows["metrics"]) == 3
    got = {(r["env"], r["metric"], r["k"], r["value"]) for r in rows["eval"]}
    assert got == {
        ("a-b", "avg@4", 4, 0.5),
        ("a-b", "pass@4", 4, 1.0),
        ("a-b", "errors", None, 0.0),
    }


@pytest.mark.parametrize("table", TABLES)
def test_frames_have_the_declared_types(table: str) -> None:
    """DataFrames (even empty ones) carry the declared dtypes, so parts union cleanly."""
    rows = all_rows()[table]
    frame = to_frame(table, rows)
    for name, dtype in SCHEMAS[table].items():
        assert frame.schema[name] == dtype, (table, name)
    assert frame.height == len(rows)
    assert to_frame(table, []).height == 0


def test_unsampled_tokens_have_null_policy_version() -> None:
    """Prompt tokens carry no policy version (null); sampled ones the version that sampled them."""
    frame = to_frame("rollout_tokens", all_rows()["rollout_tokens"][:1])
    versions = frame["policy_versions"][0].to_list()
    assert versions == [None] * 5 + [3] * 12
    assert frame.schema["policy_versions"] == pl.List(pl.Int32)


def test_reward_columns_are_sql_safe() -> None:
    """Named rewards with odd characters still give plain column names."""
    assert reward_column("lcs") == "reward_lcs"
    assert reward_column("format/strict-ok") == "reward_format_strict_ok"


def judged_trace(rollout: str) -> Trace:
    """A trace with everything the new rollout columns read: two rollout errors, turn
    errors, filter verdicts, two tool calls, env state and a frozen actor."""
    base = trace(rollout=rollout)
    calls = [ToolCall(id="c0", name="calc"), ToolCall(id="c1", name="calc")]
    answer = msgspec.structs.replace(base.messages[1], tool_calls=calls)
    return msgspec.structs.replace(
        base,
        messages=[base.messages[0], answer],
        errors=[
            TraceError(kind="bad_reply", message="x"),
            TraceError(kind="task_error", message="y"),
        ],
        turn_errors=[TraceError(kind="parse_error", message="p", message_id=1)] * 3,
        filters=[
            FilterVerdict(name="gibberish", value=0.5, flagged=True, enforced=True),
            FilterVerdict(name="loops", value=0.1, flagged=False),
        ],
        is_filtered=True,
        from_policy=False,
        state={"b": [1, 2], "a": "x"},
        stop_condition="has_error",
    )


def rollout_row(t: Trace) -> dict:
    """The rollouts row of ``t`` alone in a ``trace.completed``."""
    event = TraceCompleted(run="golden", env=t.env, request_id="q", group_size=1, step=0, trace=t)
    return rows_for(event, 1)["rollouts"][0]


def test_rollout_row_errors_filters_tools_and_state() -> None:
    """Every error kind (rollout and turn), the verdicts, tool calls and state are columns."""
    row = rollout_row(judged_trace("j"))
    assert row["error_type"] == "bad_reply" and row["num_errors"] == 2
    assert row["error_kinds"] == ["bad_reply", "task_error"]
    assert row["turn_errors"] == 3 and row["turn_error_kinds"] == ["parse_error"] * 3
    assert row["is_filtered"] is True and row["flagged_filters"] == ["gibberish"]
    assert row["filters"] == [
        {"name": "gibberish", "value": 0.5, "flagged": True, "enforced": True},
        {"name": "loops", "value": 0.1, "flagged": False, "enforced": False},
    ]
    assert row["from_policy"] is False and row["tool_calls"] == 2
    assert json.loads(row["state"]) == {"a": "x", "b": [1, 2]}
    assert row["stop_condition"] == "has_error"
    plain = rollout_row(trace(rollout="p"))  # recorded before stop conditions were: NULL
    assert plain["stop_condition"] is None
    assert (plain["error_kinds"], plain["turn_errors"], plain["filters"]) == ([], 0, [])
    assert (plain["is_filtered"], plain["from_policy"], plain["tool_calls"]) == (False, True, 0)
    assert plain["state"] == "{}"


NEW_ROLLOUT_COLUMNS = (
    "error_kinds", "turn_errors", "turn_error_kinds", "is_filtered", "filters",
    "flagged_filters", "from_policy", "tool_calls", "state", "stop_condition",
)  # fmt: skip


def test_errors_and_filters_per_kind_are_a_group_by(tmp_path: Path) -> None:
    """In SQL, errors per kind and filter rates per filter are an UNNEST and a GROUP BY,
    and parts written before these columns existed still union with new ones (NULL)."""
    lake = lake_dir(tmp_path, "golden")
    rows = [rollout_row(judged_trace("j")), rollout_row(trace(rollout="p"))]
    write_part(lake, "rollouts", to_frame("rollouts", rows))
    old = to_frame("rollouts", [rollout_row(trace(rollout="o"))]).with_columns(
        seq=pl.lit(2, pl.Int64)
    )
    write_part(lake, "rollouts", old.drop(*NEW_ROLLOUT_COLUMNS))
    con = connect(tmp_path, "golden")
    errors = con.sql("""
        SELECT source, kind, count(*) AS n FROM (
            SELECT 'rollout' AS source, unnest(error_kinds) AS kind FROM rollouts
            UNION ALL SELECT 'turn', unnest(turn_error_kinds) FROM rollouts)
        GROUP BY ALL ORDER BY ALL""").fetchall()
    assert errors == [
        ("rollout", "bad_reply", 1),
        ("rollout", "task_error", 1),
        ("turn", "parse_error", 3),
    ]
    rates = con.sql("""
        SELECT v.name, count(*) AS judged, count(*) FILTER (WHERE v.flagged) AS flagged
        FROM (SELECT unnest(filters) AS v FROM rollouts) GROUP BY ALL ORDER BY ALL""").fetchall()
    assert rates == [("gibberish", 1, 1), ("loops", 1, 0)]
    flags = con.sql("SELECT rollout_id, is_filtered FROM rollouts ORDER BY rollout_id").fetchall()
    assert flags == [("j", True), ("o", None), ("p", False)]
    stops = con.sql("SELECT stop_condition, count(*) FROM rollouts GROUP BY 1 ORDER BY 1")
    assert stops.fetchall() == [("has_error", 1), (None, 2)]
    con.close()
