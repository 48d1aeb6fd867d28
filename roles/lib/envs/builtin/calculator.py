"""``tool-calc``: add two numbers by calling a calculator tool (two turns, a real tool).

Conversation (char tokens are precious: the tiny model has 256 positions)::

    system:    Use calc.
    user:      12+34                    (a+b; a, b in [low, high], default 10..99)
    assistant: 12+34                    turn 1: the whole message is the tool call
    tool:      46        (name "calc")  the env evaluates it; rendered <|tool|>calc:46<|end|>
    assistant: 46                       turn 2: the answer; the episode ends (max_turns 2)

Every first assistant message gets a tool reply, so every trace holds a named tool
message, even from an untrained policy. The tool is ``calc``: a small safe evaluator of
integer arithmetic (digits, ``+ - *``, spaces, a leading minus per number; ``*`` binds
tighter), never ``eval``; anything else, an expression longer than ``MAX_EXPR_CHARS`` or
a result beyond ``MAX_ABS`` answers ``"error"`` (which keeps tool messages short).

Rewards: ``answer`` (weight 1) = 1 iff the second assistant message, stripped, is
``str(a+b)``; metric ``tool_ok`` (weight 0) = 1 iff the tool call evaluated to a+b.
``solve`` (the scripted teacher) answers from the conversation alone: turn 1 the user's
expression, turn 2 the tool's result.

    python -c "from roles.lib.envs.registry import make_env; e = make_env('tool-calc', {}); print(e.task('train', 0))"
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

SYSTEM_PROMPT = "Use calc."
TOOL_NAME = "calc"
ERROR = "error"
MAX_EXPR_CHARS = 32
MAX_ABS = 10**9

# ASCII digits only: \d and int() would also take other scripts' digits.
_TOKEN = re.compile(r"\s*(?:([0-9]+)|([-+*]))")


class CalcError(ValueError):
    """The expression is not integer arithmetic the tool accepts."""


def _tokens(expr: str) -> list[str]:
    out, pos, text = [], 0, expr.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise CalcError(f"unexpected character at {pos}: {text[pos]!r}")
        out.append(m.group(1) or m.group(2))
        pos = m.end()
    return out


def evaluate(expr: str) -> int:
    """The value of an integer expression over ``+ - *`` (recursive descent, no eval).

    Grammar: ``expr := term (("+"|"-") term)*``, ``term := factor ("*" factor)*``,
    ``factor := "-"? digits``. Raises ``CalcError`` for anything else.
    """
    if len(expr) > MAX_EXPR_CHARS:
        raise CalcError(f"expression longer than {MAX_EXPR_CHARS} characters")
    toks = _tokens(expr)
    if not toks:
        raise CalcError("empty expression")
    pos = 0

    def factor() -> int:
        nonlocal pos
        sign = 1
        if pos < len(toks) and toks[pos] == "-":
            sign, pos = -1, pos + 1
        if pos >= len(toks) or toks[pos] in "+-*":
            raise CalcError("expected a number")
        pos += 1
        return sign * int(toks[pos - 1])

    def term() -> int:
        nonlocal pos
        value = factor()
        while pos < len(toks) and toks[pos] == "*":
            pos += 1
            value *= factor()
        return value

    value = term()
    while pos < len(toks) and toks[pos] in "+-":
        op = toks[pos]
        pos += 1
        value = value + term() if op == "+" else value - term()
    if pos != len(toks):
        raise CalcError(f"unexpected {toks[pos]!r}")
    if abs(value) > MAX_ABS:
        raise CalcError(f"result beyond {MAX_ABS}")
    return value


def calc(expr: str) -> str:
    """The tool's reply: the value as text, or ``"error"``."""
    try:
        return str(evaluate(expr))
    except CalcError:
        return ERROR


def expression(task: dict[str, Any]) -> str:
    return f"{task['a']}+{task['b']}"


def target(task: dict[str, Any]) -> str:
    return str(int(task["a"]) + int(task["b"]))


class CalcTasks(GeneratedTaskset):
    def __init__(self, low: int = 10, high: int = 99, **kw: Any) -> None:
        if not 0 <= low <= high:
            raise ValueError(f"need 0 <= low <= high, got {low}, {high}")
        super().__init__(**kw)
        self.low, self.high = low, high

    def generate(self, rng: random.Random) -> dict[str, Any]:
        return {"a": rng.randint(self.low, self.high), "b": rng.randint(self.low, self.high)}

    def key(self, task: dict[str, Any]) -> str:
        return expression(task)


class CalcHarness(Harness):
    max_turns = 2

    def user_prompt(self, task: dict[str, Any]) -> str:
        return expression(task)

    def env_response(
        self, messages: Messages, task: dict[str, Any], state: State
    ) -> tuple[Messages, bool]:
        answers = assistant_answers(messages)
        if len(answers) != 1:  # the answer is in (or the episode ran past it): done
            return [], True
        # Any first message is a tool call, well formed or not: the tool always answers.
        return [{"role": "tool", "name": TOOL_NAME, "content": calc(answers[0])}], False

    def reference_answer(self, messages: Messages, task: dict[str, Any]) -> str:
        return target(task) if assistant_answers(messages) else expression(task)

    def solve(self, messages: Messages) -> str:
        tools = [m for m in messages if m.get("role") == "tool"]
        if tools:
            return str(tools[-1]["content"])
        users = [m for m in messages if m.get("role") == "user"]
        return str(users[-1]["content"])

    def demonstration(self, task: dict[str, Any]) -> Messages | None:
        # Both turns: the default (opening -> first reference answer) would show only the call.
        return [
            {
                "role": "user",
                "content": f"Example: {expression(task)} -> call {expression(task)}, "
                f"answer {target(task)}",
            }
        ]


def answer_reward(messages: Messages, task: dict[str, Any], state: State) -> float:
    answers = assistant_answers(messages)
    return float(len(answers) >= 2 and answers[1].strip() == target(task))


def tool_ok(messages: Messages, task: dict[str, Any], state: State) -> float:
    answers = assistant_answers(messages)
    return float(bool(answers) and calc(answers[0]) == target(task))


def make_env(
    seed: int = 0,
    train_size: int = 100_000,
    eval_size: int = 1_000,
    low: int = 10,
    high: int = 99,
) -> Environment:
    """Operands a and b are drawn from [low, high] (two-digit numbers by default)."""
    args = dict(seed=seed, train_size=train_size, eval_size=eval_size, low=low, high=high)
    return Environment(
        "tool-calc",
        CalcTasks(low, high, seed=seed, train_size=train_size, eval_size=eval_size),
        CalcHarness(SYSTEM_PROMPT),
        Rubric({"answer": answer_reward, "tool_ok": tool_ok}, weights={"tool_ok": 0.0}),
        args,
    )
