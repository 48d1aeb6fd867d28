"""Multi-agent seats: who plays which member, whose branches train, member-aware baselines,
partial member rewards, rae's errored updates and the start-time refusals."""

from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np
import pytest

from configs import ConfigError, load_config
from roles.algorithm import create
from roles.algorithm.checks import routing_problems
from roles.algorithm.samples import score_group
from roles.lib.envs.base import EnvCodeError, Environment, Rubric
from roles.lib.envs.harness import run_rollout
from roles.lib.envs.registry import make_env
from roles.lib.envs.seats import cast
from schemas import (
    SamplingParams,
    Seating,
    TaskRef,
    TaskRequested,
    Trace,
    TraceCompleted,
    TraceError,
    derive_id,
)
from schemas.arrays import f32
from tests.unit.test_algorithm_channels import completed, member_trace
from tests.unit.test_calculator_env import R, TeacherGenerate

RELAY = make_env("relay-reverse", {})
SELF_PLAY = Seating(learner="rotate", opponent="frozen")


class Models(TeacherGenerate):
    """The scripted teacher, noting which model each turn was asked of."""

    def __init__(self, *script: str) -> None:
        super().__init__(*script)
        self.models: list[str] = []

    async def __call__(self, model, *args, **kw):  # type: ignore[no-untyped-def]
        self.models.append(model)
        return await super().__call__(model, *args, **kw)


async def rollout(env: Environment, seating: Seating | None, index: int = 0, seed: int = 7,
                  gen: TeacherGenerate | None = None) -> Trace:  # fmt: skip
    return await run_rollout(
        env, TaskRef(index=3, data={"text": "hello"}), gen or TeacherGenerate(), R,
        SamplingParams(max_completion_tokens=16), rollout_id=f"r{index}", env_id="relay-reverse",
        group_id="g", sample_index=index, seed=seed, seating=seating,
    )  # fmt: skip


async def test_an_env_servers_group_sits_the_learner_in_each_seat_equally() -> None:
    """Through the env server's group rollout (each rollout has its own seed): 4/4."""
    from roles.env_server.role import rollout_group

    request = TaskRequested(run="r", event_id="e", env="relay-reverse", task=TaskRef(index=3),
                            group_id="g", group_size=8, seed=5, seating=SELF_PLAY)  # fmt: skip
    traces = await rollout_group(RELAY, request, TeacherGenerate(), R, "relay-reverse")
    assert all(t.ok for t in traces)
    assert Counter(t.seat for t in traces) == {"reverser": 4, "restorer": 4}


async def test_a_rollout_in_which_the_actor_never_spoke_is_errored() -> None:
    """The learner sits second but the rollout ends after one turn: nothing could train."""
    trace = await run_rollout(
        RELAY, TaskRef(index=3, data={"text": "hello"}), TeacherGenerate(), R, SamplingParams(),
        rollout_id="r", env_id="relay-reverse", max_turns=1,
        seating=Seating(learner="restorer", opponent="frozen"),
    )  # fmt: skip
    assert [e.kind for e in trace.errors] == ["no_actor_turn"]


def test_rotating_seats_are_deterministic_and_balanced() -> None:
    """A group of 8 sits the learner 4 times in each seat; the same seed, the same seats;
    the group's seed decides where it starts."""
    seats = [cast(RELAY, SELF_PLAY, "policy", 11, i).learner for i in range(8)]
    assert Counter(seats) == {"reverser": 4, "restorer": 4}
    assert seats == [cast(RELAY, SELF_PLAY, "policy", 11, i).learner for i in range(8)]
    starts = {cast(RELAY, SELF_PLAY, "policy", seed, 0).learner for seed in range(20)}
    assert starts == {"reverser", "restorer"}
    c = cast(RELAY, SELF_PLAY, "policy", 11, 0)
    other = next(m for m in RELAY.members if m != c.learner)
    assert c.models == {c.learner: "policy", other: "frozen"} and c.trains == (c.learner,)
    # no rule: every member played by the actor trains (relay-reverse as before)
    assert cast(RELAY, None, "policy", 11, 0).trains == ("reverser", "restorer")


async def test_a_frozen_opponents_branch_never_becomes_a_sample() -> None:
    """The learner's seat is the only branch; the opponent's turn went to its model and
    its version is not the trace's policy version."""
    gen = Models()
    trace = await rollout(RELAY, Seating(learner="reverser", opponent="frozen"), gen=gen)
    assert trace.ok, trace.errors
    assert gen.models == ["policy", "frozen"]
    assert trace.seat == "reverser"
    assert trace.member_models == {"reverser": "policy", "restorer": "frozen"}
    assert [b.member for b in trace.branches] == ["reverser"]
    assert [m.model for m in trace.messages if m.role == "assistant"] == ["policy", "frozen"]
    grpo = create("grpo")
    event = TraceCompleted(run="r", env=trace.env, request_id="q", group_size=1, step=1,
                           trace=trace, event_id=derive_id("t", 0))  # fmt: skip
    assert [s.member for s in score_group("grpo", grpo, [event]).samples] == ["reverser"]


async def test_a_judge_never_trains_unless_drop_judge_is_off() -> None:
    """A judge member played by the actor: no branch by default, a branch with train_judges."""
    judged = Environment("relay-reverse", RELAY.taskset, RELAY.harness, RELAY.rubric,
                         judges=("restorer",))  # fmt: skip
    assert judged.seats == ("reverser",)
    assert [b.member for b in (await rollout(judged, None)).branches] == ["reverser"]
    kept = await rollout(judged, Seating(train_judges=True))
    assert [b.member for b in kept.branches] == ["reverser", "restorer"]
    beside = await rollout(judged, Seating(learner="reverser", train_judges=True))
    assert [b.member for b in beside.branches] == ["reverser", "restorer"]
    # a judge bound to another model never trains, even with train_judges
    bound = await rollout(judged, Seating(bindings={"restorer": "teacher"}, train_judges=True))
    assert [b.member for b in bound.branches] == ["reverser"]


@pytest.mark.parametrize(
    ("name", "alice", "bob"),
    [("grpo", [0.5, -0.5], [0.0, 0.0]), ("rloo", [1.0, -1.0], [0.0, 0.0]),
     ("max_rl", [1.0, -1.0], [0.0, 0.0])],
)  # fmt: skip
def test_group_baselines_are_per_member(name: str, alice: list[float], bob: list[float]) -> None:
    """alice 1 then 0, bob 1 both times: alice's branches are compared with alice's only,
    bob's get 0 (with the trace reward, bob's would have followed alice's)."""
    group = [completed(member_trace("x0", {"alice": 1.0, "bob": 1.0}, 0), 2),
             completed(member_trace("x1", {"alice": 0.0, "bob": 1.0}, 1), 2)]  # fmt: skip
    scored = score_group(name, create(name), group)
    adv = {(s.rollout_id, s.member): float(f32(s.advantages).sum() / 2) for s in scored.samples}
    assert [adv[("x0", "alice")], adv[("x1", "alice")]] == alice
    assert [adv[("x0", "bob")], adv[("x1", "bob")]] == bob


async def test_partial_member_rewards_are_a_bug_in_env_code() -> None:
    """A rubric that rewards one member of two breaks the env contract: an EnvCodeError
    (the env server dead-letters the task) naming the missing member."""
    funcs = dict(RELAY.rubric.member_funcs)
    partial = Environment("relay-reverse", RELAY.taskset, RELAY.harness,
                          Rubric(RELAY.rubric.funcs, member_funcs={"reverser": funcs["reverser"]}))  # fmt: skip
    with pytest.raises(EnvCodeError, match="restorer"):
        await rollout(partial, None)


def test_rae_folds_an_errored_rollout_at_reward_zero() -> None:
    """An errored rollout updates its members' baselines with 0 (errored_reward), after the
    group's own updates; errored_reward = None leaves it out."""
    ok = completed(member_trace("x0", {"alice": 1.0, "bob": 1.0}, 0), 2)
    errors = [TraceError(kind="inference_timeout", message="x")]
    bad = completed(msgspec.structs.replace(member_trace("x1", {}, 1), errors=errors), 2)
    for options, alice in [({"alpha": 0.5}, 0.25), ({"alpha": 0.5, "errored_reward": None}, 0.5)]:
        rae = create("rae", options)
        scored = score_group("rae", rae, [ok, bad], rae.initial_state())
        assert scored.excluded == 1 and scored.excluded_members == ["alice", "bob"]
        state = rae.fold(rae.initial_state(), scored)
        assert state[("duo", 0, "alice")] == alice and np.isclose(state[("duo", 0, "bob")], alice)


def refused(*overrides: str) -> str:
    return "\n".join(routing_problems(load_config("smoke", list(overrides))))


def test_start_time_refusals_name_the_key_and_the_fix() -> None:
    relay = 'orchestrator.train.env=[{id="relay-reverse", learner_seat="nobody"}]'
    msg = refused(relay, 'orchestrator.algorithms=[{id="rae"}]')
    assert "`orchestrator.train.env.0.learner_seat` = 'nobody'" in msg and "reverser" in msg
    msg = refused('orchestrator.train.env=[{id="reverse-text", learner_seat="rotate"}]')
    assert "`orchestrator.train.env.0.learner_seat` is set" in msg and "no members" in msg
    msg = refused('orchestrator.train.env=[{id="relay-reverse"}]',
                  'orchestrator.algorithms=[{id="tail", name="examples.tail_grpo:TailGRPO"}]')  # fmt: skip
    assert "does not handle members" in msg and "use rae" in msg
    assert refused('orchestrator.train.env=[{id="relay-reverse", learner_seat="rotate"}]',
                   'orchestrator.algorithms=[{id="grpo"}]') == ""  # fmt: skip
    msg = refused('orchestrator.train.env=[{id="relay-reverse", opponent="policy"}]')
    assert "`orchestrator.train.env.0.opponent` = 'policy' needs" in msg
    # eval may pin "rotate" or a seat of a multi-agent env, never a single-agent one
    assert (
        refused(relay.replace("nobody", "rotate"), 'orchestrator.eval.learner_seat="rotate"') == ""
    )
    msg = refused('orchestrator.eval.learner_seat="reverser"')
    assert "`orchestrator.eval.learner_seat` = 'reverser' is set" in msg and "no members" in msg
    with pytest.raises(ConfigError, match=r"orchestrator\.train\.env\.0\.opponent"):
        load_config("smoke", ['orchestrator.train.env=[{id="relay-reverse", opponent="ghost"}]'])


def test_eval_reports_the_learners_win_rate_per_seat() -> None:
    """win = the learner's member reward > 0; per seat and overall; none without seats."""
    from roles.orchestrator.eval_stats import win_rates

    def seated(seat: str | None, a: float) -> Trace:
        rewards = {"alice": a, "bob": -a}
        return msgspec.structs.replace(member_trace("x", rewards, 0), seat=seat)

    traces = [seated("alice", 1.0), seated("alice", 0.0), seated("bob", 1.0), seated("bob", -1.0)]
    # alice wins 1 of 2; as bob the learner's reward is -a: 1 -> loss, -1 -> win
    assert win_rates("duo", traces) == {
        "duo/win_rate@alice": 0.5, "duo/win_rate@bob": 0.5, "duo/win_rate": 0.5,
    }  # fmt: skip
    assert win_rates("duo", [seated(None, 1.0)]) == {}


def test_rae_per_task_false_keeps_one_baseline_per_member_across_tasks() -> None:
    """per_task = false: tasks 0 and 1 share alice's baseline (0.5 after task 0, so task
    1's reward 1 gets A = 1 - 0.75); per task, task 1 starts from 0 again (A = 0.5)."""
    t0 = completed(member_trace("x0", {"alice": 1.0, "bob": 0.0}, 0, task=0), 1)
    t1 = completed(member_trace("y0", {"alice": 1.0, "bob": 0.0}, 0, task=1), 1)
    for per_task, expected in [(False, 0.25), (True, 0.5)]:
        rae = create("rae", {"alpha": 0.5, "per_task": per_task})
        state = rae.fold(rae.initial_state(), score_group("rae", rae, [t0], rae.initial_state()))
        (alice, _bob) = score_group("rae", rae, [t1], state).samples
        assert float(f32(alice.advantages).max()) == expected
