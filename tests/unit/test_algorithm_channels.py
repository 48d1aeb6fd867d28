"""Per-token algorithms: echo's tool-output CE, opd/opsd's ref_kl targets, rae's EMA fold."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from roles.algorithm import create
from roles.algorithm.base import ScoreSpec
from roles.algorithm.samples import (
    ToolSft,
    branch_views,
    env_token_masks,
    score_group,
)
from schemas import Branch, Message, TaskRef, ToolCall, Trace, TraceCompleted, derive_id
from schemas.arrays import f32, mask, pack_f32, pack_i32, pack_mask


def msg(mid: int, role: str, n: int, sampled: bool = False, name: str | None = None,
        span: tuple[int, int] | None = None, member: str | None = None) -> Message:  # fmt: skip
    flags = [0] + [1] * (n - 1) if sampled else [0] * n  # a sampled turn opens with scaffolding
    return Message(
        id=mid, role=role, content="", parent=mid - 1 if mid else None, name=name, member=member,
        token_ids=pack_i32(range(10 * mid, 10 * mid + n)), sampled=pack_mask(flags),
        logprobs=pack_f32([-0.5 * f for f in flags]), content_span=span,
    )  # fmt: skip


def tool_trace(rollout: str = "t0", reward: float = 1.0, index: int = 0) -> Trace:
    """user(3) assistant(3) tool calc(5, content 2..4) assistant(3) tool search(4, content 2..3)."""
    messages = [
        msg(0, "user", 3, span=(1, 2)),
        msg(1, "assistant", 3, sampled=True),
        msg(2, "tool", 5, name="calc", span=(2, 4)),
        msg(3, "assistant", 3, sampled=True),
        msg(4, "tool", 4, name="search", span=(2, 3)),
        msg(5, "user", 3, span=(1, 2)),
    ]
    return Trace(rollout_id=rollout, env="tool-calc", task=TaskRef(index=3), group_id="g",
                 sample_index=index, messages=messages, branches=[Branch(messages=list(range(6)))],
                 reward=reward)  # fmt: skip


def completed(trace: Trace, group_size: int) -> TraceCompleted:
    return TraceCompleted(run="r", env=trace.env, request_id="req", group_size=group_size, step=1,
                          trace=trace, event_id=derive_id("t", trace.rollout_id))  # fmt: skip


# Token positions of tool_trace's single branch: user 0-2, assistant 3-5, calc 6-10,
# assistant 11-13, search 14-17, user 18-20.
CALC, SEARCH, USER_FEEDBACK = [8, 9], [16], [19]


def ones(n: int, at: list[int], value: float = 1.0) -> list[float]:
    out = [0.0] * n
    for i in at:
        out[i] = value
    return out


def test_env_token_masks_mark_tool_content_after_the_first_response() -> None:
    """Content spans of tool messages only (never scaffolding, never the opening prompt)."""
    t = tool_trace()
    (every_tool,) = env_token_masks(t)
    assert np.flatnonzero(every_tool).tolist() == CALC + SEARCH
    (calc_only,) = env_token_masks(t, names=["calc"])
    assert np.flatnonzero(calc_only).tolist() == CALC
    (with_user,) = env_token_masks(t, roles=("tool", "user"))
    assert np.flatnonzero(with_user).tolist() == CALC + SEARCH + USER_FEEDBACK


def test_echo_is_grpo_on_actions_plus_alpha_ce_on_tool_outputs() -> None:
    """echo: rl = grpo advantages on sampled tokens; ce = alpha on allowed tool content."""
    group = [completed(tool_trace("a", 1.0, 0), 2), completed(tool_trace("b", 0.0, 1), 2)]
    scored = score_group("echo", create("echo", {"alpha": 0.25, "tool_names": ["calc"]}), group)
    a, b = scored.samples
    assert f32(a.advantages).tolist() == ones(21, [4, 5, 12, 13], 0.5)
    assert f32(b.advantages).tolist() == ones(21, [4, 5, 12, 13], -0.5)
    assert f32(a.ce_weights).tolist() == ones(21, CALC, 0.25)
    assert np.flatnonzero(mask(a.sft_mask)).tolist() == CALC
    assert not (mask(a.mask) & mask(a.sft_mask)).any()  # tool tokens are never rl positions
    assert a.algorithms == ["echo"] and a.ref_weights is None


def test_env_tool_sft_adds_ce_to_any_algorithm_and_the_larger_weight_wins() -> None:
    """The per-env sft rule puts alpha on tool content; with echo's own ce the max is kept."""
    group = [completed(tool_trace("a", 1.0, 0), 2), completed(tool_trace("b", 1.0, 1), 2)]
    grpo = score_group("grpo", create("grpo"), group, tool_sft=ToolSft(0.3, ("search",)))
    assert f32(grpo.samples[0].ce_weights).tolist() == ones(21, SEARCH, np.float32(0.3))
    # equal rewards: no rl signal, but the ce channel still teaches: not a zero-signal group
    assert not grpo.zero_advantage
    echo = create("echo", {"alpha": 0.5})
    both = score_group("echo", echo, group, tool_sft=ToolSft(0.3))
    assert f32(both.samples[0].ce_weights).tolist() == ones(21, CALC + SEARCH, 0.5)


def test_opd_targets_pull_toward_the_reference_logprobs() -> None:
    """opd: scored by the reference model; ref_weights = beta on trainable tokens, target = refs."""
    opd = create("opd", {"reference": "ref", "beta": 0.5})
    t = tool_trace()
    assert opd.score_spec(t) == ScoreSpec(model="ref", hint=False)
    ref = np.linspace(-3, -1, 21).astype(np.float32)
    scored = score_group("opd", opd, [completed(t, 1)], refs={("t0", 0): ref})
    (s,) = scored.samples
    assert f32(s.ref_weights).tolist() == ones(21, [4, 5, 12, 13], 0.5)
    assert np.array_equal(f32(s.ref_logprobs), ref)
    assert not mask(s.mask).any() and s.sft_mask is None  # ref_kl only
    with pytest.raises(ValueError, match="no reference logprobs"):
        score_group("opd", opd, [completed(t, 1)], refs={})


def test_opsd_scores_with_the_policy_and_the_demonstration_hint() -> None:
    """opsd asks the live policy, with the env's demonstration prepended."""
    assert create("opsd").score_spec(tool_trace()) == ScoreSpec(model="policy", hint=True)


def member_trace(rollout: str, rewards: dict[str, float], index: int, task: int = 0) -> Trace:
    """Two members taking turns; one branch per member over the whole conversation."""
    messages = [
        msg(0, "user", 2),
        msg(1, "assistant", 3, sampled=True, member="alice"),
        msg(2, "assistant", 3, sampled=True, member="bob"),
    ]
    branches = [
        Branch(messages=[0, 1, 2], member="alice"),
        Branch(messages=[0, 1, 2], member="bob"),
    ]
    return Trace(rollout_id=rollout, env="duo", task=TaskRef(index=task), group_id=f"g{task}-{index // 2}",
                 sample_index=index, messages=messages, branches=branches, member_rewards=rewards)  # fmt: skip


def test_member_branches_train_only_their_members_tokens() -> None:
    """A branch with a member trains that member's sampled tokens, and gets its reward."""
    alice, bob = branch_views(member_trace("m", {"alice": 1.0, "bob": 0.0}, 0))
    assert np.flatnonzero(alice.trainable).tolist() == [3, 4]
    assert np.flatnonzero(bob.trainable).tolist() == [6, 7]
    assert (alice.reward, bob.reward) == (1.0, 0.0)


def test_rae_matches_a_hand_computed_ema_sequence_and_its_fold() -> None:
    """b <- a*b + (1-a)*r then A = r - b, per (env, task, member), in arrival order."""
    rae = create("rae", {"alpha": 0.5})
    state = rae.initial_state()
    g1 = [completed(member_trace("x0", {"alice": 1.0, "bob": 0.0}, 0), 2),
          completed(member_trace("x1", {"alice": 0.0, "bob": 1.0}, 1), 2)]  # fmt: skip
    s1 = score_group("rae", rae, g1, state)
    # alice: b=0.5 -> A=0.5; then r=0: b=0.25 -> A=-0.25.  bob: b=0 -> A=0; then r=1: b=0.5 -> A=0.5
    assert [float(f32(s.advantages).max() + f32(s.advantages).min()) for s in s1.samples] == [
        0.5, 0.0, -0.25, 0.5,
    ]  # fmt: skip
    state = rae.fold(state, s1)
    assert state == {("duo", 0, "alice"): 0.25, ("duo", 0, "bob"): 0.5}
    g2 = [completed(member_trace("y0", {"alice": 1.0, "bob": 1.0}, 2), 1)]
    s2 = score_group("rae", rae, g2, state)
    # alice: b = 0.5*0.25 + 0.5 = 0.625 -> A = 0.375; bob: b = 0.75 -> A = 0.25
    assert [float(f32(s.advantages).max()) for s in s2.samples] == [0.375, 0.25]
    # a restarted worker folds the published events and reaches the same state
    # (alice: 0.5 * 0.25 + 0.5 * 1 = 0.625; bob: 0.5 * 0.5 + 0.5 * 1 = 0.75)
    replayed = rae.fold(rae.fold(rae.initial_state(), s1), s2)
    assert replayed == {("duo", 0, "alice"): 0.625, ("duo", 0, "bob"): 0.75}
    assert rae.stateful and rae.needs_members


def test_tool_name_allow_list_leaves_user_feedback_alone() -> None:
    """tool_names filters tool messages only; include_user still adds user feedback."""
    echo = create("echo", {"alpha": 1.0, "include_user": True, "tool_names": ["calc"]})
    (s,) = score_group("echo", echo, [completed(tool_trace(), 1)]).samples
    assert np.flatnonzero(mask(s.sft_mask)).tolist() == CALC + USER_FEEDBACK


def test_per_token_example_by_import_path_puts_grpo_on_the_last_tokens() -> None:
    """examples/tail_grpo.py: per-token targets from a user class loaded by import path."""
    algo = create("examples.tail_grpo:TailGRPO", {"tail": 1})
    group = [completed(tool_trace("a", 1.0, 0), 2), completed(tool_trace("b", 0.0, 1), 2)]
    a, b = score_group("tail", algo, group).samples
    assert f32(a.advantages).tolist() == ones(21, [13], 0.5)
    assert f32(b.advantages).tolist() == ones(21, [13], -0.5)
    with pytest.raises(ValueError, match="tail must be >= 1"):
        create("examples.tail_grpo:TailGRPO", {"tail": 0})


def test_tool_names_join_a_nameless_tool_message_to_its_call() -> None:
    """A tool message without a name (a trace the harness did not name) is matched to the
    call it answers by tool_call_id, so tool_names still selects it."""
    t = tool_trace()
    calls = [ToolCall(id="k1", name="calc", arguments="{}")]
    messages = list(t.messages)
    messages[1] = msgspec.structs.replace(messages[1], tool_calls=calls)
    messages[2] = msgspec.structs.replace(messages[2], name=None, tool_call_id="k1")
    joined = msgspec.structs.replace(t, messages=messages)
    (calc_only,) = env_token_masks(joined, names=["calc"])
    assert np.flatnonzero(calc_only).tolist() == CALC
    (search_only,) = env_token_masks(joined, names=["search"])
    assert np.flatnonzero(search_only).tolist() == SEARCH
