"""A prompt that outgrows the context trains (issue 34): a 2-step smoke run (`rlbus up`,
real role processes) on the multi-turn `alphabet-sort` with `inference.max_model_len`
too small for any second turn (its first prompts are 46-52 tokens, each follow-up adds
10 or more): the policy's rollouts end `prompt_too_long`, truncated and scored, and
they train (`rlbus sql` over the lake); rubric replay MATCHes. The RL algorithm is
`sft` (weight 1 on every sampled token) so that a barely warmed-up policy's equal
rewards cannot leave the run without a batch. About 25 s here (2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.helpers import finished_run, rlbus

RUN = "stop1"


@pytest.mark.e2e
async def test_rollouts_whose_prompt_outgrows_the_context_are_truncated_and_train(
    tmp_path: Path,
) -> None:
    await finished_run(
        tmp_path, RUN, "inference.max_model_len=56",
        'orchestrator.train.env=[{id="alphabet-sort", group_size=4}]',
        'orchestrator.algorithms=[{id="sft"}]', steps=2,
    )  # fmt: skip

    query = """
        SELECT r.stop_condition, bool_and(r.truncated) AS truncated,
               count(DISTINCT r.rollout_id) AS rollouts,
               count(t.rollout_id) FILTER (WHERE t.phase = 'rl') AS trained,
               min(r.num_turns) AS min_turns, max(r.num_turns) AS max_turns
        FROM rollouts r LEFT JOIN rollouts_trained t USING (run, rollout_id)
        WHERE r.split = 'train' AND r.error_type IS NULL
        GROUP BY r.stop_condition ORDER BY r.stop_condition"""
    sql = rlbus(tmp_path, "sql", "--run", RUN, "-f", "json", query)
    assert sql.returncode == 0, sql.stdout + sql.stderr
    rows = {r["stop_condition"]: r for r in json.loads(sql.stdout)}
    # The policy's rollouts: one turn, then the prompt was too long, and RL trained them.
    too_long = rows["prompt_too_long"]
    assert too_long["truncated"] and too_long["trained"] > 0
    assert too_long["min_turns"] == too_long["max_turns"] == 1
    # The scripted teacher's warm start knows no context: it answers every turn.
    assert set(rows) <= {"prompt_too_long", "max_turns_reached"}

    rubric = rlbus(tmp_path, "replay", RUN, "rubric")
    assert rubric.returncode == 0, rubric.stdout + rubric.stderr
    assert "MATCH rubric" in rubric.stdout
