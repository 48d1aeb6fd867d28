"""How a rollout ends (``Trace.stop_condition``, ``roles.lib.envs.stop``; issue 34): the
priority rule over every pair of conditions; a prompt that outgrows the context after
turn 1 ends the rollout truncated, scored and trainable (a real torch backend serving
``inference.max_model_len`` from a loaded config), while at turn 1 it stays an error;
``max_turns`` and the env's done from a loaded config; the condition in the lake, where
``rlbus sql`` groups by it; rubric replay still MATCHes."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from configs import RunConfig, load_config
from configs.orchestrator import POLICY
from replay.lake import lake_dir, to_frame, write_part
from replay.rubric import RubricLog, rescore
from roles.algorithm import create
from roles.algorithm.samples import score_group
from roles.cli.lake import sql
from roles.env_server.role import rollout_group
from roles.inference.role import make_backend
from roles.lib.envs.harness import Generate, run_rollout
from roles.lib.envs.registry import make_env
from roles.lib.envs.stop import (
    HAS_ERROR,
    MAX_TURNS_REACHED,
    PROMPT_TOO_LONG,
    SCHEDULE_EXHAUSTED,
    STOP_CONDITIONS,
    stop_condition,
)
from roles.runtime.context import RoleContext
from roles.up.rollout import build_requests, plan_requests
from schemas import (
    GenerateRequest,
    InferenceFailed,
    Seating,
    TaskRef,
    TaskRequested,
    Trace,
    TraceCompleted,
)
from schemas.arrays import i32, mask, pack_i32
from tests.unit.test_harness import SAMPLING, FakeGenerate, R, check_invariants

RUN = "stops"


# -- the rule ------------------------------------------------------------------------------


def test_the_priority_is_error_then_schedule_then_prompt_too_long_then_max_turns() -> None:
    """Of any two conditions that hold at once, the higher wins, in either order; a lone
    one is itself; a condition that did not hold (None) changes nothing."""
    assert STOP_CONDITIONS == (HAS_ERROR, SCHEDULE_EXHAUSTED, PROMPT_TOO_LONG, MAX_TURNS_REACHED)
    for high, low in itertools.combinations(STOP_CONDITIONS, 2):
        assert stop_condition(high, low) == stop_condition(low, high) == high, (high, low)
    for name in STOP_CONDITIONS:
        assert stop_condition(name) == stop_condition(None, name, None) == name
    assert stop_condition(*STOP_CONDITIONS[::-1]) == HAS_ERROR
    with pytest.raises(ValueError, match="no stop condition"):
        stop_condition(None)
    with pytest.raises(ValueError, match="unknown"):
        stop_condition("is_completed", MAX_TURNS_REACHED)


# -- a prompt that outgrows the context (the harness, with scripted replies) -----------------


def too_long(tokens: int = 300) -> InferenceFailed:
    return InferenceFailed(request_id="x", kind="context_too_long",
                           message=f"prompt has {tokens} tokens; the model takes 256 in all")  # fmt: skip


async def test_a_prompt_too_long_after_turn_one_ends_truncated_and_scored() -> None:
    """alphabet-sort, turn 2's prompt refused: the rollout is ok, truncated,
    ``prompt_too_long``, scored by the rubric on what was said (the follow-up it never
    answered counts 0), and what the model saw is exactly turn 1: the follow-up keeps
    no tokens and the reply no closing tokens, so no sample is longer than the context."""
    env = make_env("alphabet-sort", {})
    data = env.task("train", 0)
    answer = ",".join(sorted(data["names"]))
    gen = FakeGenerate((answer, "stop"), too_long())
    trace = await run_rollout(env, TaskRef(index=0, data=data), gen, R, SAMPLING, rollout_id="r")
    assert trace.ok and trace.stop_condition == PROMPT_TOO_LONG and trace.truncated
    assert trace.num_turns == 1 and len(gen.calls) == 2
    assert trace.metrics == {"turn_1_correct": 1.0, "turn_2_correct": 0.0}
    assert trace.reward == 0.5 and trace.rewards == {"correct": 0.5}
    assert [m.role for m in trace.messages] == ["system", "user", "assistant", "user"]
    follow_up = trace.messages[-1]
    assert follow_up.content.startswith("Add: ") and follow_up.token_ids == b""
    assert follow_up.content_span is None
    check_invariants(trace, gen.calls[0]["prompt"] + gen.completions[0])
    refused = gen.calls[1]["prompt"]  # turn 1 closed, then the follow-up: never read
    assert len(refused) > len(gen.calls[0]["prompt"] + gen.completions[0])


async def test_a_prompt_too_long_at_the_first_turn_stays_an_error() -> None:
    """Nothing was generated: the rollout errors (``context_too_long``, reward 0), as the
    orchestrator's error stop expects; and a multi-agent rollout whose context runs out
    before the actor's seat came names that, not ``no_actor_turn``."""
    env = make_env("alphabet-sort", {})
    first = await run_rollout(env, TaskRef(index=0, data=env.task("train", 0)),
                              FakeGenerate(too_long()), R, SAMPLING, rollout_id="r")  # fmt: skip
    assert [e.kind for e in first.errors] == ["context_too_long"]
    assert first.stop_condition == HAS_ERROR and not first.truncated and first.reward == 0.0
    debate = make_env("debate", {})
    seats = Seating(learner="debater_b", opponent="opponent")  # a (opponent) speaks first
    trace = await run_rollout(debate, TaskRef(index=0, data=debate.task("train", 0)),
                              FakeGenerate(("abc", "stop"), too_long()), R, SAMPLING,
                              rollout_id="d", seating=seats)  # fmt: skip
    assert [e.kind for e in trace.errors] == ["context_too_long"]
    assert trace.stop_condition == HAS_ERROR and trace.num_turns == 1


# -- from a loaded config ------------------------------------------------------------------


def config(tmp_path: Path, *overrides: str) -> RunConfig:
    return load_config("smoke", [f"bus.data_dir={tmp_path}", *overrides])


async def roll(cfg: RunConfig, env_id: str, generate: Generate, n: int = 2) -> tuple[TaskRequested, list[Trace]]:  # fmt: skip
    """One group of ``n`` rollouts of train task 0, asked as `rlbus rollout` asks (the
    env's args, sampling and max_turns from the config) and run as the env server runs
    them."""
    plan = plan_requests(cfg, env_id, "train", n, n, POLICY)
    env = make_env(plan.env, plan.env_args)
    (request,) = build_requests(RUN, cfg.seed, plan, size=env.size("train"))
    return request, await rollout_group(env, request, generate, renderer(cfg))


def renderer(cfg: RunConfig) -> Any:
    """The env server's renderer of the run's model (the tiny one, built once)."""
    return RoleContext(RUN, "", cfg, "test").load_renderer()


def served(backend: Any) -> Generate:
    """The inference role's backend as the harness's ``Generate`` (no bus between)."""

    async def generate(model, request_id, prompt_ids, sampling, stop_token_ids, seed, *, env=None):  # type: ignore[no-untyped-def]  # fmt: skip
        (result,) = await backend.generate([GenerateRequest(
            request_id=request_id, prompt_ids=pack_i32(prompt_ids), sampling=sampling,
            stop_token_ids=list(stop_token_ids), seed=seed, env=env)])  # fmt: skip
        return result

    return generate


def replayed(cfg: RunConfig, request: TaskRequested, traces: list[Trace]) -> Any:
    """``rlbus replay <run> rubric`` over this group, as the log would hold it."""
    log = RubricLog(cfg, {request.event_id: request}, [(request.event_id, t) for t in traces],
                    {request.event_id: len(traces)})  # fmt: skip
    return rescore(log)


def to_lake(data_dir: Path, request: TaskRequested, traces: list[Trace], seq: int) -> None:
    from replay.tables import rows_for

    rows = [rows_for(TraceCompleted(run=RUN, env=request.env, request_id=request.event_id,
                                    group_size=len(traces), step=0, trace=t), seq + i)["rollouts"][0]
            for i, t in enumerate(traces)]  # fmt: skip
    write_part(lake_dir(data_dir, RUN), "rollouts", to_frame("rollouts", rows))


def rlbus_sql(data_dir: Path, query: str) -> list[dict[str, Any]]:
    """``rlbus sql --run RUN --no-sync -f json QUERY``'s rows."""
    app = typer.Typer()
    app.command()(sql)  # the one command: invoked without its name
    result = CliRunner().invoke(app, ["--run", RUN, "--no-sync", "--data-dir", str(data_dir),
                                      "-f", "json", query])  # fmt: skip
    assert result.exit_code == 0, result.output
    return list(json.loads(result.output))


async def test_from_config_a_prompt_outgrowing_max_model_len_ends_truncated_and_trains(
    tmp_path: Path,
) -> None:
    """``inference.max_model_len`` leaves room for alphabet-sort's first prompt and a few
    tokens: the torch backend built from the config (``make_backend``) answers turn 1 and
    refuses turn 2's prompt, so every rollout of the group is ``prompt_too_long``,
    truncated and scored; grpo turns each into a sample of exactly its sampled tokens, no
    longer than the context; rubric replay MATCHes; `rlbus sql` groups by the column."""
    probe = config(tmp_path)
    env = make_env("alphabet-sort", {})
    opening = env.initial_messages(env.task("train", 0))
    first = len(renderer(probe).first_turn(opening, env.tools).prompt)
    cfg = config(tmp_path, f"inference.max_model_len={first + 4}",
                 'orchestrator.train.env=[{id="alphabet-sort"}]')  # fmt: skip
    path = RoleContext(RUN, "", cfg, "test").model_dir()
    backend = await make_backend(cfg, str(path), tmp_path / "weights")
    try:
        request, traces = await roll(cfg, "alphabet-sort", served(backend))
    finally:
        await backend.close()
    assert len(traces) == 2
    for t in traces:
        assert t.ok, t.errors
        assert (t.stop_condition, t.truncated, t.num_turns) == (PROMPT_TOO_LONG, True, 1)
        assert set(t.metrics) == {"turn_1_correct", "turn_2_correct"}  # scored, both turns
        assert t.metrics["turn_2_correct"] == 0.0 and t.messages[-1].token_ids == b""
        ids, sampled, *_ = t.branch_tokens(t.branches[0])
        assert len(ids) <= first + 4 and sampled.any()
    # Trainable: one grpo sample per rollout, training exactly its sampled tokens.
    group = [TraceCompleted(run=RUN, env=request.env, request_id=request.event_id,
                            group_size=2, step=0, trace=t)
             for t in (traces[0], msgspec.structs.replace(traces[1], reward=1.0))]  # fmt: skip
    scored = score_group("grpo", create("grpo", {}), group)
    assert scored.excluded == 0 and len(scored.samples) == 2
    for s, t in zip(scored.samples, group, strict=True):
        _, sampled, *_ = t.trace.branch_tokens(t.trace.branches[0])
        assert s.rollout_id == t.trace.rollout_id
        assert mask(s.mask).tolist() == sampled.tolist() and len(i32(s.token_ids)) <= first + 4
    replay = replayed(cfg, request, traces)
    assert replay.scored == 2 and not replay.failures and replay.diff.ok
    to_lake(tmp_path, request, traces, seq=1)
    rows = rlbus_sql(tmp_path, "SELECT stop_condition, count(*) AS n, bool_and(truncated) AS t "
                               "FROM rollouts GROUP BY stop_condition")  # fmt: skip
    assert rows == [{"stop_condition": "prompt_too_long", "n": 2, "t": True}]


def answers(n: int) -> list[tuple[str, str]]:
    return [("Ada", "stop")] * n


@pytest.mark.parametrize(
    ("entry", "turns", "stop"),
    [
        ('{id="alphabet-sort"}', 3, MAX_TURNS_REACHED),  # its own 3 turns: not asked after
        ('{id="alphabet-sort", max_turns=2}', 2, MAX_TURNS_REACHED),  # the run's bound first
        ('{id="alphabet-sort", max_turns=5, args={max_turns=2}}', 2, SCHEDULE_EXHAUSTED),
    ],
)  # fmt: skip
async def test_from_config_max_turns_or_the_env_says_done(
    tmp_path: Path, entry: str, turns: int, stop: str
) -> None:
    """``orchestrator.train.env[].max_turns`` bounds the rollout (``max_turns_reached``);
    below it the env's own end (two turns of names, then done) is ``schedule_exhausted``.
    Either way the rollout is scored, not truncated, and rubric replay MATCHes."""
    cfg = config(tmp_path, f"orchestrator.train.env=[{entry}]")
    request, traces = await roll(cfg, "alphabet-sort", FakeGenerate(*answers(10)))
    for t in traces:
        assert t.ok and (t.stop_condition, t.num_turns, t.truncated) == (stop, turns, False)
        assert len(t.metrics) == turns
    replay = replayed(cfg, request, traces)
    assert replay.scored == 2 and replay.diff.ok and not replay.failures
    to_lake(tmp_path, request, traces, seq=1)
    rows = rlbus_sql(tmp_path, "SELECT stop_condition, count(*) AS n FROM rollouts GROUP BY 1")
    assert rows == [{"stop_condition": stop, "n": 2}]


def test_an_errored_group_from_a_bad_request_is_has_error() -> None:
    """The env server's errored group (a task it could not build) says why it ended too."""
    from roles.env_server.role import failed_group

    request = TaskRequested(run=RUN, env="e", task=TaskRef(index=0, split="nope"),
                            group_id="g", group_size=2)  # fmt: skip
    traces = failed_group(request, "e", "task_error", "no split 'nope'")
    assert [t.stop_condition for t in traces] == [HAS_ERROR] * 2
    assert np.all([not t.ok for t in traces])
