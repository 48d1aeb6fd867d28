"""Unit tests for the ``tool-calc`` env: tasks, the safe evaluator, rewards, a full rollout."""

from __future__ import annotations

import builtins
import json
from typing import Any

import pytest

from roles.lib.envs.builtin.calculator import MAX_ABS, calc, evaluate
from roles.lib.envs.harness import run_rollout
from roles.lib.envs.registry import make_env
from roles.lib.model.render import Renderer
from roles.lib.model.tokenizer import build_tokenizer
from roles.teacher.role import parse_conversation
from schemas import GenerateResult, SamplingParams, TaskRef
from schemas.arrays import i32, mask, pack_f32, pack_i32

TOK = build_tokenizer()
R = Renderer(TOK)
ENV = make_env("tool-calc", {})
TASK = {"a": 12, "b": 34}


def conversation(*answers: str, task: dict[str, Any] = TASK) -> list[dict[str, Any]]:
    """The assistant says ``answers`` in turn; the env replies after each, until done."""
    msgs = ENV.initial_messages(task)
    state = ENV.init_state(task)
    for a in answers:
        msgs.append({"role": "assistant", "content": a})
        new, done = ENV.env_response(msgs, task, state)
        msgs += new
        if done:
            break
    return msgs


# -- tasks --------------------------------------------------------------------------------


def test_tasks_are_two_digit_sums_deterministic_and_split_disjoint() -> None:
    """Tasks are two-digit (a, b) pairs, the same for the same seed, different for another
    seed, and no eval task appears in train."""
    train = [ENV.task("train", i) for i in range(1000)]
    assert all(10 <= t["a"] <= 99 and 10 <= t["b"] <= 99 for t in train)
    assert train == [make_env("tool-calc", {}).task("train", i) for i in range(1000)]
    assert [make_env("tool-calc", {"seed": 1}).task("train", i) for i in range(50)] != train[:50]
    evals = {json.dumps(ENV.task("eval", i), sort_keys=True) for i in range(300)}
    assert evals and not evals & {json.dumps(t, sort_keys=True) for t in train}
    assert ENV.initial_messages(TASK) == [
        {"role": "system", "content": "Use calc."},
        {"role": "user", "content": "12+34"},
    ]
    assert ENV.max_turns == 2


# -- the evaluator ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expr", "value"),
    [("12+34", 46), (" 12 + 34\n", 46), ("2+3*4", 14), ("2*3+4", 10), ("10-2-3", 5),
     ("-5+3", -2), ("5--3", 8), ("7", 7), ("99*99", 9801), ("0*12-1", -1)],
)  # fmt: skip
def test_evaluator_computes_integer_arithmetic(expr: str, value: int) -> None:
    """Digits with + - * (left-associative, * first, a leading minus per number) evaluate right."""
    assert evaluate(expr) == value
    assert calc(expr) == str(value)


@pytest.mark.parametrize(
    "expr",
    ["", "   ", "12+", "+12", "1 2", "2**3", "6/3", "(1+2)", "1e3", "0x10", "1.5+1",
     "abc", "12+34=46", "١+٢", "9" * 33, "99999*99999", "<|end|>"],
)  # fmt: skip
def test_evaluator_rejects_everything_else(expr: str) -> None:
    """Anything but + - * over ASCII integers (or too long, or too large) is the tool's "error"."""
    assert calc(expr) == "error"


def test_evaluator_never_executes_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tool runs no Python: with eval/exec/compile poisoned it still works, and code
    in the expression is just an error with no effect."""

    def poisoned(*args: Any, **kw: Any) -> Any:
        raise AssertionError("the calculator called eval/exec/compile")

    for fn in ("eval", "exec", "compile"):
        monkeypatch.setattr(builtins, fn, poisoned)
    assert calc("12+34") == "46"
    touched: list[str] = []
    monkeypatch.setattr(builtins, "__import__", lambda *a, **k: touched.append(a[0]))
    assert calc("__import__('os').system('true')") == "error"
    assert calc("(lambda: 1)()") == "error"
    monkeypatch.undo()
    assert touched == []


def test_evaluator_bounds_results() -> None:
    """Results beyond MAX_ABS are errors, which keeps tool messages a few tokens long."""
    assert calc(str(MAX_ABS)) == str(MAX_ABS)
    assert calc(f"{MAX_ABS}+1") == "error"


# -- protocol and rewards -----------------------------------------------------------------


def test_any_first_message_gets_a_named_tool_reply_and_the_second_ends_it() -> None:
    """A good call gets its value, a bad one "error"; after the answer the episode is over."""
    assert conversation("12+34")[-1] == {"role": "tool", "name": "calc", "content": "46"}
    assert conversation("hi there")[-1] == {"role": "tool", "name": "calc", "content": "error"}
    msgs = conversation("12+34", "46")
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize(
    ("answers", "answer", "tool_ok"),
    [(("12+34", "46"), 1.0, 1.0), (("12+34", " 46\n"), 1.0, 1.0), (("46", "46"), 1.0, 1.0),
     (("12+35", "47"), 0.0, 0.0), (("oops", "46"), 1.0, 0.0), (("12+34", "45"), 0.0, 1.0),
     (("12+34",), 0.0, 1.0), ((), 0.0, 0.0)],
)  # fmt: skip
def test_rewards(answers: tuple[str, ...], answer: float, tool_ok: float) -> None:
    """answer = the second assistant message equals a+b (the only weighted reward); tool_ok =
    the tool call evaluated to a+b (a metric)."""
    score = ENV.score(conversation(*answers), TASK, {})
    assert score.rewards == {"answer": answer}
    assert score.metrics == {"tool_ok": tool_ok}
    assert score.reward == answer


def test_solve_and_reference_follow_the_protocol() -> None:
    """Turn 1: the user's expression (the call); turn 2: the tool's result (the answer)."""
    opening = ENV.initial_messages(TASK)
    assert ENV.solve(opening) == ENV.reference_answer(opening, TASK) == "12+34"
    after_tool = conversation("12+34")
    assert ENV.solve(after_tool) == ENV.reference_answer(after_tool, TASK) == "46"


def test_demonstration_shows_both_turns() -> None:
    """The opsd hint shows the call and the answer, in the tokenizer's alphabet."""
    demo = ENV.demonstration(TASK)
    assert demo == [{"role": "user", "content": "Example: 12+34 -> call 12+34, answer 46"}]
    assert TOK.unk_token_id not in R.message_tokens(demo[0])


# -- a full rollout -----------------------------------------------------------------------


class TeacherGenerate:
    """Inference that does what the scripted teacher does: read the conversation back from the
    prompt tokens and answer ``env.solve`` (or a fixed script of texts)."""

    def __init__(self, *script: str) -> None:
        self.script = list(script)
        self.prompts: list[list[int]] = []

    async def __call__(self, model, request_id, prompt_ids, sampling, stop_token_ids, seed, *, env=None):  # type: ignore[no-untyped-def]  # fmt: skip
        self.prompts.append(list(prompt_ids))
        if self.script:
            text = self.script.pop(0)
        else:
            seen = parse_conversation(TOK.decode(list(prompt_ids), skip_special_tokens=False))
            text = make_env(env, {}).solve(seen)
        ids = TOK.encode(text, add_special_tokens=False) + [R.end_token_id]
        return GenerateResult(request_id=request_id, completion_ids=pack_i32(ids),
                              logprobs=pack_f32([0.0] * len(ids)), finish_reason="stop",
                              policy_version=0)  # fmt: skip


async def test_scripted_rollout_gets_full_reward_with_a_tool_message_span() -> None:
    """The teacher's answers through the real harness and renderer: reward 1, tool_ok 1, a tool
    message named calc whose content_span decodes to the tool's result."""
    gen = TeacherGenerate()
    task = TaskRef(index=0, data=TASK)
    trace = await run_rollout(ENV, task, gen, R, SamplingParams(max_completion_tokens=16),
                              rollout_id="r", env_id="tool-calc")  # fmt: skip
    assert trace.ok, trace.errors
    assert (trace.reward, trace.rewards, trace.metrics) == (1.0, {"answer": 1.0}, {"tool_ok": 1.0})
    assert [(m.role, m.content) for m in trace.messages] == [
        ("system", "Use calc."), ("user", "12+34"), ("assistant", "12+34"),
        ("tool", "46"), ("assistant", "46"),
    ]  # fmt: skip
    tool = trace.messages[3]
    ids = i32(tool.token_ids).tolist()
    assert (
        tool.name == "calc"
        and TOK.decode(ids, skip_special_tokens=False) == "<|tool|>calc:46<|end|>"
    )
    start, end = tool.content_span
    assert TOK.decode(ids[start:end]) == "46"
    assert (start, end) == (6, 8)  # <|tool|> is one token, then c a l c : one token each
    assert not mask(tool.sampled).any()
    full, sampled, *_ = trace.branch_tokens(trace.branches[0])
    assert len(full) < 64 and sampled.sum() == len("12+34") + 1 + len("46") + 1
    assert trace.num_turns == 2 and len(gen.prompts) == 2


async def test_untrained_policy_still_gets_a_tool_message() -> None:
    """Garbage as the tool call still gets a named tool reply ("error") and reward 0."""
    gen = TeacherGenerate("xq!", "zz")
    trace = await run_rollout(ENV, TaskRef(index=0, data=TASK), gen, R, SamplingParams(),
                              rollout_id="r")  # fmt: skip
    assert trace.ok and trace.reward == 0.0 and trace.metrics == {"tool_ok": 0.0}
    tool = next(m for m in trace.messages if m.role == "tool")
    assert tool.name == "calc" and tool.content == "error"
    start, end = tool.content_span
    assert TOK.decode(i32(tool.token_ids)[start:end].tolist()) == "error"
