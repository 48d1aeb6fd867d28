"""An env whose rubric has a bug on some tasks: the error taxonomy's e2e (a bug in env
code dead-letters the task and, repeated, stops the run naming the env and the error)."""

from __future__ import annotations

from typing import Any

from roles.lib.envs.base import Environment, Rubric
from roles.lib.envs.registry import make_env


def make(**args: Any) -> Environment:
    """reverse-text whose score divides by zero on every third task."""
    env = make_env("reverse-text", args)
    rubric = env.rubric

    def buggy(messages: Any, task: dict[str, Any], state: Any) -> float:
        if len(str(task)) % 3 == 0:
            return 1 / 0
        return rubric.score(messages, task, state).reward

    env.rubric = Rubric(funcs={"buggy": buggy})
    return env
