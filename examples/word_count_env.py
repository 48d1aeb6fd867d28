"""A custom environment outside the built-ins: count the words of a short phrase.

Load it by import path wherever an env id is expected::

    rlbus rollout --env examples.word_count_env:make_env -n 8 --group-size 4
    make_env("examples.word_count_env:make_env", {"max_words": 4})   # roles.lib.envs.registry

Conversation::

    system: Count the words.
    user:   red cat sat
    answer: 3

Reward ``exact`` is 1 when the answer's first integer equals the word count; the metric
``abs_error`` is how far off it was (the count itself when no number was given).
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
    last_answer,
)

WORDS = "red cat sat on a mat big dog ran up hill sun sky blue sea fox".split()
_INT = re.compile(r"-?\d+")


class WordCountTasks(GeneratedTaskset):
    def __init__(self, max_words: int = 6, **kw: Any) -> None:
        super().__init__(**kw)
        self.max_words = max_words

    def generate(self, rng: random.Random) -> dict[str, Any]:
        words = [rng.choice(WORDS) for _ in range(rng.randint(1, self.max_words))]
        return {"text": " ".join(words), "count": len(words)}

    def key(self, task: dict[str, Any]) -> str:
        return str(task["text"])


class WordCountHarness(Harness):
    def user_prompt(self, task: dict[str, Any]) -> str:
        return str(task["text"])

    def reference_answer(self, messages: Messages, task: dict[str, Any]) -> str:
        return str(task["count"])


def answered_count(messages: Messages) -> int | None:
    m = _INT.search(last_answer(messages))
    return int(m.group()) if m else None


def exact(messages: Messages, task: dict[str, Any], state: State) -> float:
    return float(answered_count(messages) == task["count"])


def abs_error(messages: Messages, task: dict[str, Any], state: State) -> float:
    got = answered_count(messages)
    return float(abs((got if got is not None else 0) - task["count"]))


def make_env(max_words: int = 6, seed: int = 0, eval_size: int = 200) -> Environment:
    return Environment(
        "word-count",
        WordCountTasks(max_words, seed=seed, eval_size=eval_size),
        WordCountHarness("Count the words."),
        Rubric({"exact": exact, "abs_error": abs_error}, weights={"abs_error": 0.0}),
        {"max_words": max_words, "seed": seed, "eval_size": eval_size},
    )
