"""``relay-reverse``: a two-member relay (multi-agent), for role-conditioned algorithms.

One policy plays both members; the conversation tells it which one it is::

    system:    Reverse the text.
    user:      hello
    reverser:  olleh                 (assistant turn 0, member "reverser")
    user:      Undo it.
    restorer:  hello                 (assistant turn 1, member "restorer")

Each trace has one branch per member (each trains only its member's turn). Member
rewards: ``reverser`` = LCS ratio of its answer to the reversed text; ``restorer`` =
LCS ratio of its answer to the reverser's answer reversed (its job given what it saw).
The trace reward is their mean. Tasks as in ``reverse-text``.

    rlbus up -c smoke 'orchestrator.train.env=[{id="relay-reverse"}]' 'orchestrator.algorithms=[{id="rae"}]'
"""

from __future__ import annotations

from typing import Any

from roles.lib.envs.base import Environment, Harness, Messages, Rubric, State, assistant_answers
from roles.lib.envs.builtin import reverse_text
from roles.lib.envs.builtin.reverse_text import SYSTEM_PROMPT, lcs_ratio

MEMBERS = ("reverser", "restorer")
UNDO = "Undo it."


def _answer(messages: Messages, turn: int) -> str:
    answers = assistant_answers(messages)
    return answers[turn].strip() if len(answers) > turn else ""


class RelayHarness(Harness):
    max_turns = 2
    members = MEMBERS

    def user_prompt(self, task: dict[str, Any]) -> str:
        return str(task["text"])

    def env_response(
        self, messages: Messages, task: dict[str, Any], state: State
    ) -> tuple[Messages, bool]:
        if len(assistant_answers(messages)) == 1:
            return [{"role": "user", "content": UNDO}], False
        return [], True

    def reference_answer(self, messages: Messages, task: dict[str, Any]) -> str:
        return self.solve(messages)

    def solve(self, messages: Messages) -> str:
        if not assistant_answers(messages):  # the reverser's turn
            users = [m["content"] for m in messages if m.get("role") == "user"]
            return str(users[-1])[::-1]
        return _answer(messages, -1)[::-1]  # the restorer undoes what it was given


def reverser(messages: Messages, task: dict[str, Any], state: State) -> float:
    return lcs_ratio(_answer(messages, 0), str(task["text"])[::-1])


def restorer(messages: Messages, task: dict[str, Any], state: State) -> float:
    return lcs_ratio(_answer(messages, 1), _answer(messages, 0)[::-1])


def make_env(
    min_len: int = 3,
    max_len: int = 8,
    seed: int = 0,
    train_size: int = 100_000,
    eval_size: int = 1_000,
) -> Environment:
    """The tasks (and args) of ``reverse-text``, played as a relay of two members."""
    base = reverse_text.make_env(min_len, max_len, seed, train_size, eval_size)
    return Environment(
        "relay-reverse",
        base.taskset,
        RelayHarness(SYSTEM_PROMPT),
        Rubric(
            {"reverser": reverser, "restorer": restorer},
            member_funcs={"reverser": reverser, "restorer": restorer},
        ),
        base.args,
    )
