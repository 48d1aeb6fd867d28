"""``debate``: two debaters answer the same reverse-text task, a judge picks the better one.

Three members share one conversation (char tokens are precious: the env's own messages
are a letter or a short question). With ``rounds=2``::

    system:     Reverse the text.
    user:       hello                   (the task, exactly as in ``reverse-text``)
    debater_a:  olleh                   (assistant turn 0)
    user:       B
    debater_b:  olleh                   (turn 1)
    user:       A
    debater_a:  olleh                   (turn 2: keep or change, having seen B's answer)
    user:       B
    debater_b:  olleh                   (turn 3)
    user:       Judge: A, B or tie?
    judge:      tie                     (turn 2 * rounds)

Each debater's final answer is its last turn. Member rewards are zero-sum and read the
judge's actual reply (so a model judge works when bound): the winner +1, the loser -1,
a tie, an invalid verdict or no verdict at all 0; the judge 0. The trace reward
``accuracy`` is the mean LCS ratio of the two final answers to the reversed text. The
scripted teacher (``solve``) answers correctly as a debater and judges by ``verdict``:
the answer closer to the truth (LCS ratio) wins. Tasks as in ``reverse-text``.

    rlbus up -c smoke 'orchestrator.train.env=[{id="debate", args={rounds=1}}]'
"""

from __future__ import annotations

from typing import Any

from roles.lib.envs.base import (
    Environment,
    Harness,
    Messages,
    RewardFn,
    Rubric,
    State,
    assistant_answers,
)
from roles.lib.envs.builtin import reverse_text
from roles.lib.envs.builtin.reverse_text import SYSTEM_PROMPT, lcs_ratio

DEBATERS = ("debater_a", "debater_b")
JUDGE = "judge"
# What the env says before each member's turn (debater_a's first turn follows the task).
CUE = {"debater_a": "A", "debater_b": "B", JUDGE: "Judge: A, B or tie?"}
VERDICTS = ("a", "b", "tie")


def verdict(answer_a: str, answer_b: str, truth: str) -> str:
    """The checking judge: "A" or "B" for the answer with the higher LCS ratio, else "tie"."""
    ra, rb = lcs_ratio(answer_a.strip(), truth), lcs_ratio(answer_b.strip(), truth)
    return "A" if ra > rb else "B" if rb > ra else "tie"


def parse_verdict(reply: str | None) -> str | None:
    """ "a", "b" or "tie" from a judge's reply (case and spaces ignored); None if invalid."""
    v = (reply or "").strip().lower()
    return v if v in VERDICTS else None


def finals(messages: Messages, rounds: int) -> tuple[str, str]:
    """Each debater's final (last) answer, stripped ("" if it never spoke)."""
    answers = assistant_answers(messages)[: 2 * rounds]
    a, b = answers[0::2], answers[1::2]
    return (a[-1].strip() if a else "", b[-1].strip() if b else "")


def judge_reply(messages: Messages, rounds: int) -> str | None:
    """The judge's reply, or None when the conversation ended before the judge spoke."""
    answers = assistant_answers(messages)
    return answers[2 * rounds] if len(answers) > 2 * rounds else None


class DebateHarness(Harness):
    members = (*DEBATERS, JUDGE)
    judges = (JUDGE,)

    def __init__(self, system_prompt: str | None = None, rounds: int = 2) -> None:
        if rounds < 1:
            raise ValueError(f"debate needs rounds >= 1, got {rounds}")
        super().__init__(system_prompt)
        self.rounds = rounds
        self.max_turns = 2 * rounds + 1

    def speaker(self, turn: int) -> str | None:
        return DEBATERS[turn % 2] if turn < 2 * self.rounds else JUDGE

    def user_prompt(self, task: dict[str, Any]) -> str:
        return str(task["text"])

    def env_response(
        self, messages: Messages, task: dict[str, Any], state: State
    ) -> tuple[Messages, bool]:
        turn = len(assistant_answers(messages))  # the next assistant turn
        if turn >= self.max_turns:
            return [], True
        return [{"role": "user", "content": CUE[str(self.speaker(turn))]}], False

    def reference_answer(self, messages: Messages, task: dict[str, Any]) -> str:
        return self.solve(messages)

    def solve(self, messages: Messages) -> str:
        users = [m for m in messages if m.get("role") == "user"]
        truth = str(users[0]["content"])[::-1]
        if len(assistant_answers(messages)) < 2 * self.rounds:  # a debater's turn
            return truth
        return verdict(*finals(messages, self.rounds), truth)


def make_rubric(rounds: int) -> Rubric:
    def outcome(messages: Messages) -> str | None:
        return parse_verdict(judge_reply(messages, rounds))

    def debater(sign: str) -> RewardFn:
        def reward(messages: Messages, task: dict[str, Any], state: State) -> float:
            v = outcome(messages)
            return 0.0 if v in (None, "tie") else 1.0 if v == sign else -1.0

        return reward

    def judge(messages: Messages, task: dict[str, Any], state: State) -> float:
        return 0.0

    def accuracy(messages: Messages, task: dict[str, Any], state: State) -> float:
        truth = str(task["text"])[::-1]
        return sum(lcs_ratio(f, truth) for f in finals(messages, rounds)) / 2

    def metrics(messages: Messages, task: dict[str, Any], state: State) -> dict[str, float]:
        v = outcome(messages)
        a, b = finals(messages, rounds)
        truth = str(task["text"])[::-1]
        return {
            "a_wins": float(v == "a"),
            "b_wins": float(v == "b"),
            "tie": float(v == "tie"),  # an explicit tie; an invalid verdict counts below
            "judge_invalid": float(v is None),
            "a_correct": float(a == truth),
            "b_correct": float(b == truth),
        }

    return Rubric(
        {"accuracy": accuracy},
        member_funcs={"debater_a": debater("a"), "debater_b": debater("b"), JUDGE: judge},
        metric_funcs={"debate": metrics},
    )


def make_env(
    rounds: int = 2,
    min_len: int = 3,
    max_len: int = 8,
    seed: int = 0,
    train_size: int = 100_000,
    eval_size: int = 1_000,
) -> Environment:
    """The tasks (and args) of ``reverse-text``, debated for ``rounds`` rounds and judged."""
    base = reverse_text.make_env(min_len, max_len, seed, train_size, eval_size)
    return Environment(
        "debate",
        base.taskset,
        DebateHarness(SYSTEM_PROMPT, rounds),
        make_rubric(rounds),
        {"rounds": rounds, **base.args},
    )
