"""The eval figures: the unbiased pass@k estimator, avg@k's standard error over tasks, and
which share of a round the pinned version answered (roles/orchestrator/eval_stats.py)."""

from __future__ import annotations

import math

import pytest

from roles.orchestrator.eval_stats import answering_versions, eval_metrics, pass_at, pass_ks
from schemas import Branch, EvalCompleted, Message, TaskRef, Trace
from schemas.arrays import pack_mask


def trace(reward: float, versions: tuple[int, ...] = (3,), from_policy: bool = True) -> Trace:
    """A rollout whose policy turns ran on ``versions`` (one sampled message each)."""
    msgs = [
        Message(
            id=i,
            role="assistant",
            content="x",
            sampled=pack_mask([0, 1]),
            policy_version=v,
            model="policy",
        )  # fmt: skip
        for i, v in enumerate(versions)
    ]
    return Trace(
        rollout_id=f"r{id(msgs)}", env="e", task=TaskRef(index=0, split="eval"), group_id="g",
        sample_index=0, messages=msgs, branches=[Branch(messages=[m.id for m in msgs])],
        reward=reward, policy_min=min(versions), policy_max=max(versions), from_policy=from_policy,
    )  # fmt: skip


def task(env: str, index: int, rewards: list[float], traces: list[Trace] | None = None) -> EvalCompleted:  # fmt: skip
    return EvalCompleted(
        run="r", request_id=f"{env}{index}", env=env, step=0, task_index=index,
        rewards=rewards, traces=traces if traces is not None else [trace(x) for x in rewards],
    )  # fmt: skip


def test_pass_at_k_matches_hand_computations() -> None:
    """1 - C(n-c, k)/C(n, k), worked by hand, and against math.comb everywhere small."""
    assert pass_at(5, 2, 2) == pytest.approx(1 - 3 / 10)  # C(3,2)=3, C(5,2)=10
    assert pass_at(4, 1, 2) == pytest.approx(1 - 3 / 6)
    assert pass_at(4, 1, 1) == pytest.approx(0.25)  # pass@1 = c/n
    assert pass_at(4, 0, 2) == 0.0 and pass_at(4, 3, 2) == 1.0 and pass_at(4, 4, 4) == 1.0
    assert pass_at(200, 1, 100) == pytest.approx(0.5)  # C(199,100)/C(200,100) = 100/200
    for n in range(1, 12):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_pass_ks_are_powers_of_two_below_k_and_k() -> None:
    assert [pass_ks(k) for k in (1, 2, 3, 4, 6, 8)] == [
        [1], [2], [2, 3], [2, 4], [2, 4, 6], [2, 4, 8],
    ]  # fmt: skip


def test_eval_metrics_report_avg_stderr_and_unbiased_pass_at_k() -> None:
    """Three tasks of four binary rewards: avg@4 0.25 with stderr 0.25/sqrt(3) over tasks,
    pass@2 by the estimator, pass@4 the share of tasks with a correct sample."""
    results = [task("e", 0, [1, 0, 0, 0]), task("e", 1, [1, 1, 0, 0]), task("e", 2, [0, 0, 0, 0])]
    m = eval_metrics(results, 4)
    assert m["e/avg@4"] == pytest.approx(0.25)
    assert m["e/avg@4_stderr"] == pytest.approx(0.25 / math.sqrt(3))
    assert m["e/pass@2"] == pytest.approx((1 / 2 + 5 / 6 + 0) / 3)
    assert m["e/pass@4"] == pytest.approx(2 / 3)
    assert "e/pass@1" not in m and m["e/errors"] == 0.0
    assert "e/answered_by_pinned" not in m  # no round version given


def test_non_binary_rewards_have_no_pass_at_k_and_one_task_no_stderr() -> None:
    m = eval_metrics([task("e", 0, [0.5, 1.0]), task("e", 1, [0.0, 0.5])], 2)
    assert m["e/avg@2"] == pytest.approx(0.5) and "e/pass@2" not in m
    assert m["e/avg@2_stderr"] == pytest.approx(0.25)  # sd 0.3536 / sqrt(2)
    one = eval_metrics([task("f", 0, [1.0, 0.0])], 2)
    assert one["f/avg@2"] == 0.5 and one["f/pass@2"] == 1.0 and "f/avg@2_stderr" not in one


def test_answered_by_pinned_is_the_share_served_wholly_by_the_rounds_version() -> None:
    """A rollout counts when every policy turn ran on the round's version; rollouts with
    no policy turn (a frozen actor's) are left out of the share."""
    traces = [trace(1.0)] * 5 + [trace(0.0, (3, 4)), trace(0.0, (4,)), trace(0.0, (3,), False)]
    results = [task("e", 0, [t.reward for t in traces[:4]], traces[:4]),
               task("e", 1, [t.reward for t in traces[4:]], traces[4:])]  # fmt: skip
    m = eval_metrics(results, 4, version=3)
    assert m["e/answered_by_pinned"] == pytest.approx(5 / 7)
    assert answering_versions(traces) == [3, 4]
    frozen = eval_metrics([task("e", 0, [1.0], [trace(1.0, (0,), False)])], 1, version=0)
    assert "e/answered_by_pinned" not in frozen
