"""Unit tests for the ``tool-calc`` env: tasks, the safe evaluator, the structured tool-call
protocol, rewards, state columns, full rollouts through the harness."""

from __future__ import annotations

import builtins
import json
from typing import Any

import pytest

from roles.lib.envs.base import ParseError
from roles.lib.envs.builtin.calculator import MAX_ABS, calc, call_text, evaluate
from roles.lib.envs.harness import run_rollout
from roles.lib.envs.registry import make_env
from roles.lib.model.render import Renderer
from roles.lib.model.tokenizer import build_tokenizer
from schemas import GenerateResult, SamplingParams, TaskRef, derive_id
from schemas.arrays import i32, mask, pack_f32, pack_i32

TOK = build_tokenizer()
R = Renderer(TOK)
ENV = make_env("tool-calc", {})
TASK = {"a": 12, "b": 34}


CALL = call_text("12+34")  # <|tool_call|>calc:{"expr":"12+34"}


def conversation(*answers: str, task: dict[str, Any] = TASK) -> list[dict[str, Any]]:
    """The assistant says ``answers`` in turn (tool calls in their text form, as the
    scripted teacher writes them); the env replies after each, until done (a ParseError's
    feedback is its reply)."""
    msgs = ENV.initial_messages(task)
    state = ENV.init_state(task)
    for a in answers:
        msgs.append({"role": "assistant", "content": a})
        try:
            new, done = ENV.env_response(msgs, task, state)
        except ParseError as e:
            new, done = e.feedback or [], e.feedback is None
        msgs += new
        if done:
            break
    return msgs


def structured(expr: str, call_id: str = "c0", name: str = "calc") -> dict[str, Any]:
    """An assistant chat message with one structured call, as the harness hands it over."""
    arguments = json.dumps({"expr": expr}, separators=(",", ":"))
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]}  # fmt: skip


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


def test_a_structured_call_is_answered_by_id_and_counted_in_state() -> None:
    """Each call gets a tool message answering its id (the harness names it); another tool,
    bad arguments or a bad expression answer "error"; state counts calls, keeps the last."""
    msgs = ENV.initial_messages(TASK)
    state = ENV.init_state(TASK)
    assert state == {"tool_calls": 0, "last_result": None}
    reply = structured("12+34")
    reply["tool_calls"] += structured("2*", "c1")["tool_calls"] + structured("1", "c2", "web")["tool_calls"]  # fmt: skip
    new, done = ENV.env_response([*msgs, reply], TASK, state)
    assert not done
    assert new == [
        {"role": "tool", "tool_call_id": "c0", "content": "46"},
        {"role": "tool", "tool_call_id": "c1", "content": "error"},
        {"role": "tool", "tool_call_id": "c2", "content": "error"},
    ]
    assert state == {"tool_calls": 3, "last_result": "error"}
    odd = structured("1")
    odd["tool_calls"][0]["function"]["arguments"] = '{"expr": "1", "x": 2}'
    assert ENV.env_response([*msgs, odd], TASK, ENV.init_state(TASK))[0][0]["content"] == "error"


@pytest.mark.parametrize(
    ("reply", "reason"),
    [("12+34", "not a tool call"), ("<|tool_call|>calc:{oops", "not JSON"),
     ('<|tool_call|>calc:["12+34"]', "not a JSON object"), ("<|tool_call|>{}", "name:")],
)  # fmt: skip
def test_a_first_reply_that_is_no_call_is_a_parse_error_with_a_tool_reply(
    reply: str, reason: str
) -> None:
    """No call, or a call that does not parse: ParseError (the harness masks the turn) whose
    feedback is a calc tool message "error", so the episode goes on."""
    msgs = [*ENV.initial_messages(TASK), {"role": "assistant", "content": reply}]
    state = ENV.init_state(TASK)
    with pytest.raises(ParseError, match=reason) as e:
        ENV.env_response(msgs, TASK, state)
    assert e.value.feedback == [{"role": "tool", "name": "calc", "content": "error"}]
    assert state == {"tool_calls": 0, "last_result": "error"}


def test_a_call_in_text_form_gets_a_named_reply_and_the_second_message_ends_it() -> None:
    """Without the harness (no ids) a call written as text is answered with a named tool
    message; after the answer the episode is over."""
    assert CALL == '<|tool_call|>calc:{"expr":"12+34"}'
    assert conversation(CALL)[-1] == {"role": "tool", "name": "calc", "content": "46"}
    msgs = conversation(CALL, "46")
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "tool", "assistant"]


@pytest.mark.parametrize(
    ("answers", "answer", "tool_ok"),
    [((CALL, "46"), 1.0, 1.0), ((CALL, " 46\n"), 1.0, 1.0), ((call_text("46"), "46"), 1.0, 1.0),
     ((call_text("12+35"), "47"), 0.0, 0.0), (("oops", "46"), 1.0, 0.0), ((CALL, "45"), 0.0, 1.0),
     ((CALL,), 0.0, 1.0), (("12+34", "46"), 1.0, 0.0), ((), 0.0, 0.0)],
)  # fmt: skip
def test_rewards(answers: tuple[str, ...], answer: float, tool_ok: float) -> None:
    """answer = the second assistant message equals a+b (the only weighted reward); tool_ok =
    the first reply's call evaluated to a+b (a metric; a reply with no call scores 0)."""
    score = ENV.score(conversation(*answers), TASK, {})
    assert score.rewards == {"answer": answer}
    assert score.metrics == {"tool_ok": tool_ok}
    assert score.reward == answer


def test_tool_ok_reads_structured_calls() -> None:
    """tool_ok on the harness's chat: the call is in tool_calls, the content is empty."""
    msgs = [*ENV.initial_messages(TASK), structured("12+34")]
    assert ENV.score(msgs, TASK, {}).metrics == {"tool_ok": 1.0}
    msgs = [*ENV.initial_messages(TASK), structured("12+34", name="web")]
    assert ENV.score(msgs, TASK, {}).metrics == {"tool_ok": 0.0}


def test_solve_and_reference_follow_the_protocol() -> None:
    """Turn 1: the call of the user's expression; turn 2: the tool's result (the answer)."""
    opening = ENV.initial_messages(TASK)
    assert ENV.solve(opening) == ENV.reference_answer(opening, TASK) == CALL
    after_tool = conversation(CALL)
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
            seen = R.read_conversation(list(prompt_ids))
            text = make_env(env, {}).solve(seen)
        ids = TOK.encode(text, add_special_tokens=False) + [R.end_token_id]
        return GenerateResult(request_id=request_id, completion_ids=pack_i32(ids),
                              logprobs=pack_f32([0.0] * len(ids)), finish_reason="stop",
                              policy_version=0)  # fmt: skip


async def test_scripted_rollout_makes_a_structured_call_and_gets_full_reward() -> None:
    """The teacher's text -> tokens -> the harness's parse: a structured call with a derived
    id, answered by a tool message that records the id and gets the call's name (the env
    gave none), rendered <|tool|>calc:46<|end|> with a content span; reward 1, tool_ok 1, the
    state columns recorded."""
    gen = TeacherGenerate()
    task = TaskRef(index=0, data=TASK)
    trace = await run_rollout(ENV, task, gen, R, SamplingParams(max_completion_tokens=32),
                              rollout_id="r", env_id="tool-calc")  # fmt: skip
    assert trace.ok, trace.errors
    assert not trace.turn_errors and not any(m.masked for m in trace.messages)
    assert (trace.reward, trace.rewards, trace.metrics) == (1.0, {"answer": 1.0}, {"tool_ok": 1.0})
    assert trace.state == {"tool_calls": 1, "last_result": "46"}
    assert [(m.role, m.content) for m in trace.messages] == [
        ("system", "Use calc."), ("user", "12+34"), ("assistant", ""),
        ("tool", "46"), ("assistant", "46"),
    ]  # fmt: skip
    call_msg, tool = trace.messages[2], trace.messages[3]
    (call,) = call_msg.tool_calls
    assert (call.id, call.name, call.arguments) == (
        derive_id("r", "turn", 0, "call", 0),
        "calc",
        '{"expr":"12+34"}',
    )
    assert TOK.decode(i32(call_msg.token_ids).tolist(), skip_special_tokens=False) == (
        f"<|assistant|>{CALL}<|end|>"
    )
    ids = i32(tool.token_ids).tolist()
    assert (tool.name, tool.tool_call_id) == ("calc", call.id)
    assert TOK.decode(ids, skip_special_tokens=False) == "<|tool|>calc:46<|end|>"
    start, end = tool.content_span
    assert TOK.decode(ids[start:end]) == "46"
    assert (start, end) == (6, 8)  # <|tool|> is one token, then c a l c : one token each
    assert not mask(tool.sampled).any()
    full, sampled, *_ = trace.branch_tokens(trace.branches[0])
    assert len(full) < 64 and sampled.sum() == 1 + len(CALL) - len("<|tool_call|>") + 1 + len("46") + 1  # fmt: skip
    assert trace.num_turns == 2 and len(gen.prompts) == 2


async def test_untrained_policy_still_gets_a_tool_message() -> None:
    """Garbage as the call is a masked turn (parse_error) that still gets a named tool reply
    ("error"); the answer turn trains; the trace is ok with reward 0."""
    gen = TeacherGenerate("xq!", "zz")
    trace = await run_rollout(ENV, TaskRef(index=0, data=TASK), gen, R, SamplingParams(),
                              rollout_id="r")  # fmt: skip
    assert trace.ok and trace.reward == 0.0 and trace.metrics == {"tool_ok": 0.0}
    assert [m.masked for m in trace.messages] == [False, False, True, False, False]
    assert [(e.kind, e.message_id) for e in trace.turn_errors] == [("parse_error", 2)]
    tool = next(m for m in trace.messages if m.role == "tool")
    assert tool.name == "calc" and tool.content == "error" and tool.tool_call_id is None
    start, end = tool.content_span
    assert TOK.decode(i32(tool.token_ids)[start:end].tolist()) == "error"
    assert trace.state == {"tool_calls": 0, "last_result": "error"}


async def test_malformed_call_is_masked_once_and_the_env_sees_the_raw_reply() -> None:
    """A reply that starts a call but does not parse: the harness masks it (one parse_error,
    though the env refuses it too), records the raw text as its content and no calls."""
    bad = '<|tool_call|>calc:{"expr":"12+'
    gen = TeacherGenerate(bad, "46")
    trace = await run_rollout(ENV, TaskRef(index=0, data=TASK), gen, R, SamplingParams(),
                              rollout_id="r")  # fmt: skip
    reply = trace.messages[2]
    assert reply.masked and reply.content == bad and reply.tool_calls == []
    assert [e.message_id for e in trace.turn_errors] == [2]
    assert "not JSON" in trace.turn_errors[0].message
    assert trace.messages[3].content == "error" and trace.reward == 1.0
