"""A group-scored env trains (issue 34): a 2-step smoke run (`rlbus up`, real role
processes) on `reverse-text` with its group rubric turned on from config
(`args = {rank_weight = 1.0}`: each rollout's rank in its group beside its lcs), then
the replays a user runs on it. About 20 s here (2 cores).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from schemas import EvalCompleted, TaskRequested, TraceCompleted
from tests.e2e.helpers import finished_run, rlbus

RUN = "grp1"
RANKED = 'orchestrator.train.env=[{id="reverse-text", group_size=4, args={rank_weight=1.0}}]'


@pytest.mark.e2e
async def test_a_group_scored_env_trains_and_replays_exactly(tmp_path: Path) -> None:
    """Every finished rollout's recorded reward holds its group's rank: `rank` among its
    named rewards, the reward the mean of lcs and rank, and the ranks of a whole RL group
    of 4 summing to 2 (each pair of rollouts shares one win); the run trains its 2 steps;
    `rlbus replay rubric` re-scores every group to the same rewards (MATCH), grpo's
    advantages replay exactly, and the lake has a `reward_rank` for every finished rollout."""
    events = await finished_run(tmp_path, RUN, RANKED, steps=2)

    phases = {e.event_id: e.phase for e in events if isinstance(e, TaskRequested)}
    traces = [e for e in events if isinstance(e, TraceCompleted)]
    evals = [t for e in events if isinstance(e, EvalCompleted) for t in e.traces]
    finished = [t for t in [*(e.trace for e in traces), *evals] if not t.errors]
    assert finished and all(set(t.rewards) == {"lcs", "rank"} for t in finished)
    for t in finished:
        assert t.reward == pytest.approx((t.rewards["lcs"] + t.rewards["rank"]) / 2)
    groups: dict[str, list[float]] = defaultdict(list)
    for e in traces:
        if phases[e.request_id] == "rl" and not e.trace.errors:
            groups[e.request_id].append(e.trace.rewards["rank"])
    whole = [ranks for ranks in groups.values() if len(ranks) == 4]
    assert whole and all(sum(ranks) == pytest.approx(2.0) for ranks in whole)

    rubric = rlbus(tmp_path, "replay", RUN, "rubric")
    assert rubric.returncode == 0, rubric.stdout + rubric.stderr
    assert "MATCH rubric" in rubric.stdout and "groups scored together" in rubric.stdout
    grpo = rlbus(tmp_path, "replay", RUN, "algorithm", "grpo")
    assert grpo.returncode == 0, grpo.stdout + grpo.stderr
    assert "MATCH grpo" in grpo.stdout

    query = (
        "select count(*) as n, count(reward_rank) as ranked from rollouts where error_type is null"
    )
    sql = rlbus(tmp_path, "sql", "--run", RUN, "-f", "json", query)
    assert sql.returncode == 0, sql.stdout + sql.stderr
    (row,) = json.loads(sql.stdout)
    assert row["n"] == len(finished) and row["ranked"] == row["n"]
