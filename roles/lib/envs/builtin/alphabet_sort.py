"""``alphabet-sort``: sort a few names, then keep the list sorted as names arrive (multi-turn).

Conversation (answers are the names comma separated, no spaces; parsing is lenient:
commas or newlines, surrounding spaces ignored)::

    system:    Sort the names, comma separated.
    user:      Kai,Ada,Sue              (3..4 names)
    assistant: Ada,Kai,Sue
    user:      Add: Bo,Zoe              (1..2 more names per follow-up turn)
    assistant: Ada,Bo,Kai,Sue,Zoe
    ...                                 (``max_turns`` turns in all, default 3)

``min_turns`` (default: ``max_turns``) is verifiers' taskset key of the same name: each
task draws its number of turns in ``[min_turns, max_turns]``, and the env says done after
the task's last turn (prime-rl's two-turn config ``min_turns = max_turns = 2`` is ``args
= {min_turns = 2, max_turns = 2}`` here; ``rlbus up -c alphabet-sort`` trains it).
Every name of a task is distinct, drawn from a fixed pool of short capitalised names.
Reward ``correct``: the mean over the turns asked of 1 if that turn's answer is exactly
the sorted list of every name given so far, else 0 (a turn asked but never answered
counts 0). Metrics ``turn_<k>_correct`` per turn (k = 1, 2, ...).
"""

from __future__ import annotations

import random
import re
from typing import Any

from roles.lib.envs.base import (
    Environment,
    GeneratedTaskset,
    Harness,
    Messages,
    Rubric,
    State,
    assistant_answers,
)

SYSTEM_PROMPT = "Sort the names, comma separated."
FOLLOW_UP = "Add: "
NAMES = (
    "Ada Al Amy Ann Ben Bo Cal Cy Dan Dee Eli Eve Fay Gus Hal Ian Ivy Jay Jo Kai Kim "
    "Lee Liv Max Mia Ned Noa Oli Pam Ray Rex Sam Sue Ted Tia Uma Val Wes Xia Yan Zoe"
).split()
_SEP = re.compile(r"[,\n]")


def parse_names(answer: str) -> list[str]:
    """Names from an answer: split on commas/newlines, spaces stripped, empties dropped."""
    return [name.strip() for name in _SEP.split(answer) if name.strip()]


def format_names(names: list[str]) -> str:
    return ",".join(names)


def names_by_turn(task: dict[str, Any]) -> list[list[str]]:
    """The sorted list expected after each turn."""
    seen = list(task["names"])
    out = [sorted(seen)]
    for added in task["additions"]:
        seen += added
        out.append(sorted(seen))
    return out


class AlphabetSortTasks(GeneratedTaskset):
    def __init__(
        self,
        turns: int = 3,
        min_names: int = 3,
        max_names: int = 4,
        min_add: int = 1,
        max_add: int = 2,
        min_turns: int | None = None,
        **kw: Any,
    ) -> None:
        low = turns if min_turns is None else min_turns
        if not 1 <= low <= turns or not 1 <= min_names <= max_names or not 1 <= min_add <= max_add:
            raise ValueError(
                "need 1 <= min_turns <= max_turns, 1 <= min_names <= max_names, "
                "1 <= min_add <= max_add"
            )
        if max_names + (turns - 1) * max_add > len(NAMES):
            raise ValueError(f"at most {len(NAMES)} distinct names are available")
        super().__init__(**kw)
        self.turns = (low, turns)
        self.names = (min_names, max_names)
        self.add = (min_add, max_add)

    def generate(self, rng: random.Random) -> dict[str, Any]:
        low, high = self.turns  # a fixed count draws nothing: the same tasks as before
        turns = rng.randint(low, high) if low < high else high
        counts = [rng.randint(*self.names)] + [rng.randint(*self.add) for _ in range(turns - 1)]
        drawn = rng.sample(NAMES, sum(counts))
        groups, start = [], 0
        for n in counts:
            groups.append(drawn[start : start + n])
            start += n
        return {"names": groups[0], "additions": groups[1:]}

    def key(self, task: dict[str, Any]) -> str:
        return "/".join(format_names(g) for g in [task["names"], *task["additions"]])


class AlphabetSortHarness(Harness):
    def __init__(self, system_prompt: str, max_turns: int) -> None:
        super().__init__(system_prompt)
        self.max_turns = max_turns

    def user_prompt(self, task: dict[str, Any]) -> str:
        return format_names(task["names"])

    def env_response(
        self, messages: Messages, task: dict[str, Any], state: State
    ) -> tuple[Messages, bool]:
        turn = len(assistant_answers(messages))  # turns answered so far
        additions = task["additions"]
        if turn > len(additions):
            return [], True
        return [{"role": "user", "content": FOLLOW_UP + format_names(additions[turn - 1])}], False

    def reference_answer(self, messages: Messages, task: dict[str, Any]) -> str:
        asked = sum(1 for m in messages if m.get("role") == "user")
        expected = names_by_turn(task)
        return format_names(expected[min(max(asked, 1), len(expected)) - 1])

    def solve(self, messages: Messages) -> str:
        names: list[str] = []
        for m in messages:
            if m.get("role") == "user":
                names += parse_names(str(m["content"]).removeprefix(FOLLOW_UP))
        return format_names(sorted(names))


def turn_results(messages: Messages, task: dict[str, Any]) -> list[float]:
    """1.0/0.0 per turn asked (user messages seen), in order."""
    asked = sum(1 for m in messages if m.get("role") == "user")
    expected = names_by_turn(task)[:asked]
    answers = assistant_answers(messages)
    return [
        float(k < len(answers) and parse_names(answers[k]) == want)
        for k, want in enumerate(expected)
    ]


def correct(messages: Messages, task: dict[str, Any], state: State) -> float:
    results = turn_results(messages, task)
    return sum(results) / len(results) if results else 0.0


def per_turn(messages: Messages, task: dict[str, Any], state: State) -> dict[str, float]:
    return {f"turn_{k + 1}_correct": v for k, v in enumerate(turn_results(messages, task))}


def make_env(
    max_turns: int = 3,
    min_turns: int | None = None,
    min_names: int = 3,
    max_names: int = 4,
    min_add: int = 1,
    max_add: int = 2,
    seed: int = 0,
    train_size: int = 100_000,
    eval_size: int = 1_000,
) -> Environment:
    args = dict(
        max_turns=max_turns,
        min_turns=min_turns,
        min_names=min_names,
        max_names=max_names,
        min_add=min_add,
        max_add=max_add,
        seed=seed,
        train_size=train_size,
        eval_size=eval_size,
    )
    tasks = AlphabetSortTasks(
        max_turns,
        min_names,
        max_names,
        min_add,
        max_add,
        min_turns,
        seed=seed,
        train_size=train_size,
        eval_size=eval_size,
    )
    return Environment(
        "alphabet-sort",
        tasks,
        AlphabetSortHarness(SYSTEM_PROMPT, max_turns),
        Rubric({"correct": correct}, metric_funcs={"per_turn": per_turn}),
        args,
    )
