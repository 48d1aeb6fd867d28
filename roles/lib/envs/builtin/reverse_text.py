"""``reverse-text``: reverse a short lowercase string (single turn).

Prompt (char tokens are precious: the tiny model has 256 positions)::

    system: Reverse the text.
    user:   <text>                  e.g. "hello"
    answer: <text reversed>         e.g. "olleh"

Texts are ``min_len``..``max_len`` (default 3..8) random lowercase letters drawn from
``seed``. Reward ``lcs``: LCS(answer, target) / max(len(answer), len(target)), in [0, 1]
and 1 iff the answer (stripped of surrounding whitespace) equals the reversed text.

``rank_weight`` > 0 adds a group rubric (``roles.lib.envs.group``), the comparative
variant: ``rank`` gives each rollout the share of the rest of its group it beats on
``lcs`` (a tie counts half; 0.5 for a lone rollout), with that weight beside ``lcs``'s 1,
so the reward is ``(lcs + rank_weight * rank) / (1 + rank_weight)``: the group's order
is ``lcs``'s, with the gaps between its rollouts widened (an advantage for the better of
two near answers even when ``lcs`` barely tells them apart).

    rlbus up -c smoke 'orchestrator.train.env=[{id="reverse-text", group_size=4, args={rank_weight=1.0}}]'

    python -c "from roles.lib.envs.registry import make_env; e = make_env('reverse-text', {}); print(e.task('train', 0))"
"""

from __future__ import annotations

import random
import string
from typing import Any

from roles.lib.envs.base import (
    Environment,
    GeneratedTaskset,
    Harness,
    Messages,
    Rubric,
    State,
    last_answer,
)

SYSTEM_PROMPT = "Reverse the text."


def lcs_len(a: str, b: str) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)), one row of memory)."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b):
            cur.append(prev[j] + 1 if ca == cb else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def lcs_ratio(answer: str, target: str) -> float:
    """LCS / max length: 1.0 iff equal, 0.0 when nothing is shared (or one side is empty)."""
    longest = max(len(answer), len(target))
    if longest == 0:
        return 1.0
    return lcs_len(answer, target) / longest


class ReverseTextTasks(GeneratedTaskset):
    def __init__(self, min_len: int = 3, max_len: int = 8, **kw: Any) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        super().__init__(**kw)
        self.min_len, self.max_len = min_len, max_len

    def generate(self, rng: random.Random) -> dict[str, Any]:
        n = rng.randint(self.min_len, self.max_len)
        return {"text": "".join(rng.choice(string.ascii_lowercase) for _ in range(n))}

    def key(self, task: dict[str, Any]) -> str:
        return str(task["text"])


class ReverseTextHarness(Harness):
    max_turns = 1

    def user_prompt(self, task: dict[str, Any]) -> str:
        return str(task["text"])

    def reference_answer(self, messages: Messages, task: dict[str, Any]) -> str:
        return str(task["text"])[::-1]

    def solve(self, messages: Messages) -> str:
        users = [m["content"] for m in messages if m.get("role") == "user"]
        return str(users[-1])[::-1]


def lcs_reward(messages: Messages, task: dict[str, Any], state: State) -> float:
    return lcs_ratio(last_answer(messages).strip(), str(task["text"])[::-1])


def exact_match(messages: Messages, task: dict[str, Any], state: State) -> float:
    return float(last_answer(messages).strip() == str(task["text"])[::-1])


def rank_reward(messages: list[Messages], task: dict[str, Any], states: list[State]) -> list[float]:
    """A group function: each rollout's share of the others in its group that it beats on
    ``lcs``, a tie counting half (0.5 for a rollout alone)."""
    quality = [lcs_reward(m, task, s) for m, s in zip(messages, states, strict=True)]
    if len(quality) == 1:
        return [0.5]
    others = len(quality) - 1
    return [
        (sum(q > o for o in quality) + 0.5 * (sum(q == o for o in quality) - 1)) / others
        for q in quality
    ]


def make_env(
    min_len: int = 3,
    max_len: int = 8,
    seed: int = 0,
    train_size: int = 100_000,
    eval_size: int = 1_000,
    rank_weight: float = 0.0,
) -> Environment:
    if rank_weight < 0:
        raise ValueError(f"rank_weight must be >= 0, got {rank_weight}")
    args: dict[str, Any] = dict(
        min_len=min_len, max_len=max_len, seed=seed, train_size=train_size, eval_size=eval_size
    )
    rubric = Rubric({"lcs": lcs_reward, "exact": exact_match}, weights={"exact": 0.0})
    if rank_weight > 0:  # the comparative variant
        args["rank_weight"] = rank_weight  # only when on: relay-reverse and debate reuse args
        rubric = Rubric(
            {"lcs": lcs_reward, "exact": exact_match},
            weights={"exact": 0.0, "rank": rank_weight},
            group_funcs={"rank": rank_reward},
        )
    return Environment(
        "reverse-text",
        ReverseTextTasks(min_len, max_len, seed=seed, train_size=train_size, eval_size=eval_size),
        ReverseTextHarness(SYSTEM_PROMPT),
        rubric,
        args,
    )
