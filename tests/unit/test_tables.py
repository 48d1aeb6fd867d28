"""Lake row builders: every declared column, right values, per-token data only where it belongs."""

from __future__ import annotations

import numpy as np
import polars as pl
import pytest

from replay.lake import to_frame
from replay.tables import SCHEMAS, TABLES, reward_column, rows_for
from schemas import EvalCompleted, MetricsReported, TraceCompleted
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
        "events": 12, "runs": 2, "tasks": 1, "rollouts": 2, "rollout_tokens": 2, "samples": 1,
        "sample_tokens": 1, "batches": 1, "batch_samples": 2, "metrics": 2, "eval": 0,
        "weights": 1, "dead_letters": 1, "algorithms": 2,
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
