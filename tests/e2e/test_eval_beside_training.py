"""Eval beside training: a smoke run (`rlbus up`, real role processes) that evaluates an
env it does not train on (`[[orchestrator.eval.env]]`, docs/configuration.md).

One run of 2 steps (about 40 s here) that trains on reverse-text and evaluates
reverse-text with the eval defaults and alphabet-sort, eval-only, with its own task count
and sampling table; every check reads that run's log, summary and lake.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

import replay
from bus.server import EmbeddedServer
from replay.sql import connect
from schemas import (
    EvalCompleted,
    MetricsReported,
    SamplesScored,
    TaskRequested,
    TraceCompleted,
    stable_seed,
)
from tests.e2e.helpers import all_events, rlbus_up, summary

RUN = "evo1"
ONLY = "alphabet-sort"  # evaluated, never trained on
EVAL_ENVS = (
    'orchestrator.eval.env=[{id="reverse-text"}, '
    f'{{id="{ONLY}", num_tasks=2, sampling={{max_completion_tokens=8, seed=5}}}}]'
)


@pytest.mark.e2e
async def test_an_eval_only_env_is_evaluated_every_round_and_never_trained(
    tmp_path: Path,
) -> None:
    """`rlbus up` starts an env server for the eval-only env; each eval round (v0, the
    warm start's v1, the final v2) asks it its 2 tasks with its own sampling (8 tokens,
    its own seed root) beside reverse-text's 4 with the eval defaults; every request is
    answered (`eval.completed.alphabet-sort`) and scored into the round's figures, which
    reach the live output, summary.json and the lake's eval table; and not one training
    request, trace or scored sample is of that env."""
    proc = rlbus_up(tmp_path, RUN, "max_steps=2", EVAL_ENVS)
    out, _ = await asyncio.to_thread(proc.communicate, timeout=300)
    assert proc.returncode == 0, out[-4000:]
    assert (tmp_path / RUN / "logs" / f"env-{ONLY}.log").exists()
    with EmbeddedServer(tmp_path / RUN / "nats") as server:
        events = await all_events(server.url, RUN)

    asked = [e for e in events if isinstance(e, TaskRequested) and e.env == ONLY]
    rounds = sorted({r.policy_version for r in asked})
    assert rounds == [0, 1, 2] and all(r.phase == "eval" for r in asked)
    for v in rounds:
        mine = sorted((r for r in asked if r.policy_version == v), key=lambda r: r.task.index)
        assert [r.task.index for r in mine] == [0, 1]
        for r in mine:
            assert r.task.split == "eval" and r.sampling.max_completion_tokens == 8
            assert r.sampling.temperature == 0.0  # inherited from orchestrator.eval.sampling
            assert r.seed == stable_seed(5, "eval", ONLY, r.task.index)
        theirs = [e for e in events if isinstance(e, TaskRequested) and e.phase == "eval"
                  and e.env == "reverse-text" and e.policy_version == v]  # fmt: skip
        assert len(theirs) == 4 and all(r.sampling.max_completion_tokens == 16 for r in theirs)
    answers = [e for e in events if isinstance(e, EvalCompleted) and e.env == ONLY]
    assert sorted(a.request_id for a in answers) == sorted(r.event_id for r in asked)
    assert all(len(a.traces) == 1 and not a.errors for a in answers)
    figures = {e.step: e.values for e in events if isinstance(e, MetricsReported) and e.role == "eval"}  # fmt: skip
    for v in rounds:
        mine = [a for a in answers if any(r.event_id == a.request_id and r.policy_version == v for r in asked)]  # fmt: skip
        assert figures[v][f"{ONLY}/avg@1"] == pytest.approx(sum(a.rewards[0] for a in mine) / 2)
        assert "reverse-text/avg@1" in figures[v]

    # Never trained: no training request, trace or sample of it, while reverse-text trains.
    train = [e for e in events if isinstance(e, TaskRequested) and e.phase in ("rl", "sft")]
    assert train and {e.env for e in train} == {"reverse-text"}
    assert not [
        e for e in events if isinstance(e, TraceCompleted | SamplesScored) and e.env == ONLY
    ]

    assert f"eval {ONLY}/avg@1" in out  # the final summary lines
    assert f"{ONLY}/avg@1" in summary(tmp_path, RUN)["eval"]["2"]
    result = await asyncio.to_thread(replay.sync_lake, RUN, tmp_path, None, True)
    assert result is not None
    con = connect(tmp_path, RUN)
    rows = con.sql(
        f"select split, count(*) from rollouts where env = '{ONLY}' group by split"
    ).fetchall()
    assert rows == [("eval", 6)]
    evals = con.sql(
        f"select policy_version from eval where env = '{ONLY}' and metric = 'avg@1' order by 1"
    ).fetchall()
    assert evals == [(0,), (1,), (2,)]
