"""``tool-calc``: add two numbers by calling a calculator tool (two turns, a real tool).

Conversation (char tokens are precious: the tiny model has 256 positions)::

    system:    Use calc.
    user:      12+34                    (a+b; a, b in [low, high], default 10..99)
    assistant: <|tool_call|>calc:{"expr":"12+34"}   turn 1: a structured tool call
    tool:      46                       answers the call (tool_call_id; the harness names
                                        it calc), rendered <|tool|>calc:46<|end|>
    assistant: 46                       turn 2: the answer; the episode ends (max_turns 2)

The call is OpenAI-style (``tool_calls`` on the assistant's chat message, one tool
message per call, ``tool_call_id`` = the call's id); ``tools`` declares the schema for
HF chat templates. The tool is ``calc``: a small safe evaluator of integer arithmetic
(digits, ``+ - *``, spaces, a leading minus per number; ``*`` binds tighter), never
``eval``; anything else, an expression longer than ``MAX_EXPR_CHARS``, a result beyond
``MAX_ABS``, another tool's name or arguments other than ``{"expr": str}`` answers
``"error"`` (which keeps tool messages short).

A first reply with no call, or a call that does not parse, is a turn error: the env
raises ``ParseError`` (the harness masks that reply) with a ``calc`` tool message
``"error"`` as feedback, so every trace still holds a named tool message, even from an
untrained policy. State columns (``Trace.state``): ``tool_calls`` (calls answered) and
``last_result`` (the last tool reply, None before one).

Rewards: ``answer`` (weight 1) = 1 iff the second assistant message, stripped, is
``str(a+b)``; metric ``tool_ok`` (weight 0) = 1 iff the first call evaluated to a+b.
``solve`` (the scripted teacher) answers from the conversation alone: turn 1 the call of
the user's expression, turn 2 the tool's result. The teacher speaks the char
tokenizer's tokens, so its call (and ``reference_answer``'s) is the char template's text
form (``roles.lib.model.tokenizer.format_tool_call``), which the renderer parses back
into the structured call; a conversation built without the harness (a test's, the
teacher's view of a prompt) carries its call in that text, and ``calls_of`` reads it.

    python -c "from roles.lib.envs.registry import make_env; e = make_env('tool-calc', {}); print(e.task('train', 0))"
"""

from __future__ import annotations

import json
import random
import re
from typing import Any

from roles.lib.envs.base import (
    ChatMessage,
    Environment,
    GeneratedTaskset,
    Harness,
    Messages,
    ParseError,
    Rubric,
    State,
    assistant_answers,
)
from roles.lib.model.tokenizer import ToolCallSyntaxError, format_tool_call, split_tool_calls

SYSTEM_PROMPT = "Use calc."
TOOL_NAME = "calc"
TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate integer arithmetic over + - * (e.g. 12+34).",
        "parameters": {
            "type": "object",
            "properties": {"expr": {"type": "string"}},
            "required": ["expr"],
        },
    },
}
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


def call_text(expr: str) -> str:
    """The call of ``calc`` on ``expr`` as the model writes it (char template)."""
    return format_tool_call(TOOL_NAME, {"expr": expr})


def calls_of(message: ChatMessage) -> list[dict[str, Any]]:
    """An assistant message's calls as ``{"id", "name", "arguments"}``: its structured
    ``tool_calls`` (the harness's), else the calls written in its content in the char
    template's text form (no ids). Raises ``ToolCallSyntaxError`` for one that does not
    parse."""
    if message.get("tool_calls"):
        return [
            {"id": c.get("id"), "name": c["function"]["name"],
             "arguments": c["function"]["arguments"]}
            for c in message["tool_calls"]
        ]  # fmt: skip
    _, parsed = split_tool_calls(str(message.get("content") or ""))
    return [{"id": None, "name": c.name, "arguments": c.arguments} for c in parsed]


def run_call(call: dict[str, Any]) -> str:
    """The tool's reply to one call: ``calc(expr)``, or ``"error"`` for another tool or
    arguments other than ``{"expr": str}``."""
    try:
        args = json.loads(call["arguments"])
    except ValueError:
        return ERROR
    if call["name"] != TOOL_NAME or not isinstance(args, dict):
        return ERROR
    expr = args.get("expr")
    return calc(expr) if isinstance(expr, str) and set(args) == {"expr"} else ERROR


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
    tools = (TOOL_SCHEMA,)
    state_columns = ("tool_calls", "last_result")

    def user_prompt(self, task: dict[str, Any]) -> str:
        return expression(task)

    def init_state(self, task: dict[str, Any]) -> State:
        return {"tool_calls": 0, "last_result": None}

    def env_response(
        self, messages: Messages, task: dict[str, Any], state: State
    ) -> tuple[Messages, bool]:
        replies = [m for m in messages if m.get("role") == "assistant"]
        if len(replies) != 1:  # the answer is in (or the episode ran past it): done
            return [], True
        error = [{"role": "tool", "name": TOOL_NAME, "content": ERROR}]
        try:
            calls = calls_of(replies[0])
        except ToolCallSyntaxError as e:
            state["last_result"] = ERROR
            raise ParseError(f"calc: {e}", feedback=error) from e
        if not calls:
            state["last_result"] = ERROR
            raise ParseError("calc: the first reply is not a tool call", feedback=error)
        out = []
        for call in calls:
            result = run_call(call)
            # Answer by id (the harness names the message after the call); a call read
            # from text has no id, so its answer names the tool itself.
            ref = {"tool_call_id": call["id"]} if call["id"] else {"name": TOOL_NAME}
            out.append({"role": "tool", **ref, "content": result})
        state["tool_calls"] += len(calls)
        state["last_result"] = out[-1]["content"]
        return out, False

    def reference_answer(self, messages: Messages, task: dict[str, Any]) -> str:
        return target(task) if assistant_answers(messages) else call_text(expression(task))

    def solve(self, messages: Messages) -> str:
        tools = [m for m in messages if m.get("role") == "tool"]
        if tools:
            return str(tools[-1]["content"])
        users = [m for m in messages if m.get("role") == "user"]
        return call_text(str(users[-1]["content"]))

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
    replies = [m for m in messages if m.get("role") == "assistant"]
    try:
        calls = calls_of(replies[0]) if replies else []
    except ToolCallSyntaxError:
        return 0.0
    return float(bool(calls) and run_call(calls[0]) == target(task))


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
