"""The ``debate`` env: turn order, the checking judge, zero-sum member rewards, prompt size."""

from __future__ import annotations

import pytest

from roles.lib.envs.builtin.debate import verdict
from roles.lib.envs.harness import run_rollout
from roles.lib.envs.registry import make_env
from schemas import SamplingParams, TaskRef, Trace
from tests.unit.test_calculator_env import R, TeacherGenerate

ENV = make_env("debate", {})  # rounds = 2, as the scripted teacher builds it
A, B, J = "debater_a", "debater_b", "judge"


async def debate(gen: TeacherGenerate, text: str = "hello") -> Trace:
    trace = await run_rollout(
        ENV, TaskRef(index=0, data={"text": text}), gen, R,
        SamplingParams(max_completion_tokens=12), rollout_id="r", env_id="debate",
    )  # fmt: skip
    assert trace.ok, trace.errors
    return trace


def turns(trace: Trace) -> list[tuple[str | None, str]]:
    return [(m.member, m.content) for m in trace.messages if m.role == "assistant"]


async def test_teacher_debate_is_a_tie_with_full_accuracy() -> None:
    """Both debaters answer right in every round; the checking judge calls it a tie."""
    trace = await debate(TeacherGenerate())
    assert turns(trace) == [(A, "olleh"), (B, "olleh"), (A, "olleh"), (B, "olleh"), (J, "tie")]
    assert [(m.role, m.content) for m in trace.messages if m.role != "assistant"] == [
        ("system", "Reverse the text."), ("user", "hello"), ("user", "B"), ("user", "A"),
        ("user", "B"), ("user", "Judge: A, B or tie?"),
    ]  # fmt: skip
    assert trace.member_rewards == {A: 0.0, B: 0.0, J: 0.0}
    assert trace.reward == 1.0 and trace.rewards == {"accuracy": 1.0}
    assert trace.metrics == {
        "a_wins": 0.0, "b_wins": 0.0, "tie": 1.0, "judge_invalid": 0.0,
        "a_correct": 1.0, "b_correct": 1.0,
    }  # fmt: skip
    assert [b.member for b in trace.branches] == [A, B]  # the judge never trains by default


async def test_wrong_debater_loses_to_the_right_one() -> None:
    """A wrong, B right: the teacher judge says B; zero-sum +1/-1, the judge 0."""
    trace = await debate(TeacherGenerate("xyz", "olleh", "xyz", "olleh"))
    assert turns(trace)[-1] == (J, "B")
    assert trace.member_rewards == {A: -1.0, B: 1.0, J: 0.0}
    assert sum(trace.member_rewards.values()) == 0.0
    assert trace.reward == pytest.approx(0.5)
    assert trace.metrics["b_wins"] == 1.0 and trace.metrics["a_wins"] == 0.0
    assert (trace.metrics["a_correct"], trace.metrics["b_correct"]) == (0.0, 1.0)


async def test_invalid_judge_reply_scores_nothing() -> None:
    """A verdict that is not A, B or tie counts as a tie and is flagged."""
    trace = await debate(TeacherGenerate("olleh", "xyz", "olleh", "xyz", "maybe"))
    assert trace.member_rewards == {A: 0.0, B: 0.0, J: 0.0}
    assert trace.metrics["judge_invalid"] == 1.0 and trace.metrics["tie"] == 0.0
    # A judge that never spoke (cut short) is the same.
    short = await run_rollout(
        ENV, TaskRef(index=0, data={"text": "hello"}), TeacherGenerate("olleh", "xyz"), R,
        SamplingParams(max_completion_tokens=12), rollout_id="s", env_id="debate", max_turns=2,
    )  # fmt: skip
    assert short.ok and short.member_rewards == {A: 0.0, B: 0.0, J: 0.0}
    assert short.metrics["judge_invalid"] == 1.0


def test_verdict_prefers_the_closer_answer() -> None:
    """Higher LCS ratio to the truth wins (surrounding spaces ignored); equal is a tie."""
    assert verdict("olleh", "olle", "olleh") == "A"
    assert verdict("hello", " olleh\n", "olleh") == "B"
    assert verdict("olleh", "olleh", "olleh") == "tie"
    assert verdict("xyz", "abc", "olleh") == "tie"
    assert verdict("olxeh", "oxleh", "olleh") == "tie"


async def test_members_seats_turns_and_prompt_size() -> None:
    """Debaters are the seats, the judge judges; rounds sets the turns; prompts stay short."""
    assert ENV.members == (A, B, J) and ENV.seats == (A, B) and ENV.judges == (J,)
    assert [ENV.speaker(t) for t in range(5)] == [A, B, A, B, J]
    one = make_env("debate", {"rounds": 1})
    assert one.max_turns == 3 and [one.speaker(t) for t in range(3)] == [A, B, J]
    assert one.args["rounds"] == 1 and one.args["max_len"] == 8
    assert ENV.demonstration({"text": "hello"}) == [
        {"role": "user", "content": "Example: hello -> olleh"}
    ]
    gen = TeacherGenerate()
    await debate(gen, text="abcdefgh")
    assert len(gen.prompts) == 5 and len(gen.prompts[-1]) < 200
