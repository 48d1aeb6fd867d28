"""Multi-agent rollouts: relay-reverse's member turns, branches and rewards, scored by rae."""

from __future__ import annotations

import numpy as np

from roles.algorithm import create
from roles.algorithm.checks import routing_problems
from roles.algorithm.samples import branch_views, score_group
from roles.lib.envs.harness import run_rollout
from roles.lib.envs.registry import make_env
from schemas import SamplingParams, TaskRef, TraceCompleted, derive_id
from schemas.arrays import f32
from tests.unit.test_calculator_env import TOK, R, TeacherGenerate

ENV = make_env("relay-reverse", {})


async def relay(*script: str, index: int = 0) -> TraceCompleted:
    data = {"text": "hello"}
    trace = await run_rollout(
        ENV, TaskRef(index=3, data=data), TeacherGenerate(*script), R,
        SamplingParams(max_completion_tokens=16), rollout_id=f"r{index}", env_id="relay-reverse",
        group_id="g", sample_index=index,
    )  # fmt: skip
    return TraceCompleted(run="r", env=trace.env, request_id="q", group_size=2, step=1,
                          trace=trace, event_id=derive_id("t", index))  # fmt: skip


async def test_members_take_turns_and_each_branch_trains_its_own_turn() -> None:
    """reverser speaks first, restorer second; one branch per member, own tokens only."""
    event = await relay()
    trace = event.trace
    assert trace.ok, trace.errors
    turns = [(m.member, m.content) for m in trace.messages if m.role == "assistant"]
    assert turns == [("reverser", "olleh"), ("restorer", "hello")]
    assert trace.member_rewards == {"reverser": 1.0, "restorer": 1.0} and trace.reward == 1.0
    rev, res = branch_views(trace)
    assert (rev.member, res.member) == ("reverser", "restorer")
    assert TOK.decode(rev.token_ids[rev.trainable]) == "olleh<|end|>"
    assert TOK.decode(res.token_ids[res.trainable]) == "hello<|end|>"
    assert not (rev.trainable & res.trainable).any()


async def test_member_rewards_judge_each_member_on_what_it_saw() -> None:
    """A wrong reverser does not cost the restorer that faithfully undid it."""
    trace = (await relay("abcde", "edcba")).trace
    assert trace.member_rewards["restorer"] == 1.0
    assert trace.member_rewards["reverser"] < 0.5


async def test_rae_keeps_one_baseline_per_member() -> None:
    """rae on a relay group: each member's advantage against its own EMA baseline."""
    group = [await relay(index=0), await relay("abcde", "edcba", index=1)]
    rae = create("rae", {"alpha": 0.5})
    scored = score_group("rae", rae, group, rae.initial_state())
    adv = [float(f32(s.advantages)[f32(s.advantages) != 0][0]) for s in scored.samples]
    r_bad = group[1].trace.member_rewards["reverser"]
    # reverser: b = 0.5 -> A = 0.5; then b = 0.25 + 0.5 r_bad -> A = r_bad - b.
    # restorer: 1.0 both times: b = 0.5 -> A = 0.5; b = 0.75 -> A = 0.25.
    expected = [0.5, 0.5, r_bad - (0.25 + 0.5 * r_bad), 0.25]
    assert np.allclose(adv, expected)
    assert [s.member for s in scored.samples] == ["reverser", "restorer"] * 2
    state = rae.fold(rae.initial_state(), scored)
    assert state[("relay-reverse", 3, "restorer")] == 0.75


def test_rae_is_accepted_on_a_multi_agent_env() -> None:
    """The start-time check passes rae on relay-reverse (it rejects it on reverse-text)."""
    from configs import load_config

    cfg = load_config(
        "smoke",
        ['orchestrator.train.env=[{id="relay-reverse"}]', 'orchestrator.algorithms=[{id="rae"}]'],
    )
    assert routing_problems(cfg) == []
    assert ENV.members == ("reverser", "restorer")
