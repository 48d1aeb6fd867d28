"""Structured tool calls end to end: the char template's call format, the renderer's
parsers, the harness's ids and name resolution, SFT on tool outputs by tool name."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from configs import load_config
from roles.algorithm import create
from roles.algorithm.core import ScoringCore
from roles.algorithm.samples import ToolSft, score_group
from roles.lib.envs.base import Environment, Harness, Rubric
from roles.lib.envs.chat import chat_message
from roles.lib.envs.harness import run_rollout
from roles.lib.envs.registry import make_env
from roles.lib.model.render import Renderer
from roles.lib.model.tokenizer import (
    ALPHABET,
    TOOL_CALL,
    ParsedToolCall,
    ToolCallSyntaxError,
    build_tokenizer,
    format_tool_call,
)
from schemas import GenerateResult, SamplingParams, TaskRef, TraceCompleted, derive_id
from schemas.arrays import f32, i32, mask, pack_f32, pack_i32

TOK = build_tokenizer()
R = Renderer(TOK)
END = R.end_token_id


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def openai_call(name: str, arguments: str, call_id: str = "c0") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# -- the char template's format -----------------------------------------------------------


def test_a_call_renders_as_the_model_writes_it() -> None:
    """An assistant message with tool_calls renders as its content, then one
    <|tool_call|>name:arguments per call (arguments verbatim), then <|end|>; a tool message
    shows its name, never its tool_call_id; <|tool_call|> is one token."""
    assert len(ids(TOOL_CALL)) == 1 and TOK.unk_token_id not in ids(TOOL_CALL)
    calls = [openai_call("calc", '{"expr":"1+2"}'), openai_call("calc", '{"expr": "3"}', "c1")]
    reply = {"role": "assistant", "content": "go", "tool_calls": calls}
    text = f'<|assistant|>go{TOOL_CALL}calc:{{"expr":"1+2"}}{TOOL_CALL}calc:{{"expr": "3"}}<|end|>'
    assert R.message_text(reply) == text
    assert format_tool_call("calc", {"expr": "1+2"}) == f'{TOOL_CALL}calc:{{"expr":"1+2"}}'
    tool = {"role": "tool", "tool_call_id": "c0", "name": "calc", "content": "3"}
    assert R.message_text(tool) == "<|tool|>calc:3<|end|>"


_name = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=6)
_args = st.dictionaries(_name, st.text(alphabet=ALPHABET.replace("<", ""), max_size=8), max_size=2)


@settings(max_examples=50, deadline=None)
@given(st.text(alphabet=ALPHABET.replace("<", ""), max_size=10), st.lists(st.tuples(_name, _args), max_size=3))  # fmt: skip
def test_text_tokens_text_round_trip(content: str, calls: list[tuple[str, dict]]) -> None:
    """What a model (or the scripted teacher) writes survives text -> tokens -> parse: the
    same content and calls, arguments as the exact JSON text written; and the template
    renders the parsed message back to the same tokens (no drift)."""
    text = content + "".join(format_tool_call(n, a) for n, a in calls)
    completion = ids(text) + [END]
    parsed_content, parsed = R.parse_tool_calls(R.parse_completion(completion))
    expected = [ParsedToolCall(n, json.dumps(a, separators=(",", ":"))) for n, a in calls]
    assert (parsed_content, parsed) == (content, expected)
    message = {"role": "assistant", "content": parsed_content,
               "tool_calls": [openai_call(c.name, c.arguments) for c in parsed]}  # fmt: skip
    assert R.message_tokens(message) == R.generation_prompt_ids + completion


@pytest.mark.parametrize(
    ("text", "reason"),
    [(f"{TOOL_CALL}calc", "expected name:"), (f"{TOOL_CALL}:{{}}", "expected name:"),
     (f"{TOOL_CALL}my tool:{{}}", "expected name:"), (f'{TOOL_CALL}calc:{{"a":', "not JSON"),
     (f"{TOOL_CALL}calc:[1]", "not a JSON object"), (f"{TOOL_CALL}calc:{{}} then", "not JSON"),
     (f"ok{TOOL_CALL}a:{{}}{TOOL_CALL}b", "tool call 1")],
)  # fmt: skip
def test_a_started_call_that_does_not_parse_is_a_syntax_error(text: str, reason: str) -> None:
    """Writing the call marker commits to a call: a missing or bad name, arguments that are
    not one JSON object (cut off, trailing text) raise ToolCallSyntaxError saying which."""
    with pytest.raises(ToolCallSyntaxError, match=reason):
        R.parse_tool_calls(text)


def test_hermes_format_and_dict_arguments_for_hf_templates() -> None:
    """A tokenizer with <tool_call> in its vocabulary parses Hermes/Qwen blocks; HF
    templates get a call's arguments as a dict (here: the char template's tojson)."""
    hermes = Renderer(TOK)
    hermes.tool_format = "hermes"
    text = 'Let me add.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "1+2"}}\n</tool_call>'
    assert hermes.parse_tool_calls(text) == (
        "Let me add.",
        [ParsedToolCall("calc", '{"expr": "1+2"}')],
    )
    assert hermes.parse_tool_calls("plain") == ("plain", [])
    for bad in ("<tool_call>{</tool_call>", "<tool_call>{}</tool_call>", "<tool_call>{",
                '<tool_call>{"name": "a", "arguments": {}}</tool_call> and more'):  # fmt: skip
        with pytest.raises(ToolCallSyntaxError):
            hermes.parse_tool_calls(bad)
    reply = {"role": "assistant", "content": "", "tool_calls": [openai_call("calc", '{"expr":"1"}')]}  # fmt: skip
    assert hermes.message_text(reply) == f'<|assistant|>{TOOL_CALL}calc:{{"expr": "1"}}<|end|>'
    plain = Renderer(TOK)
    plain.tool_format = None
    assert plain.parse_tool_calls(f"{TOOL_CALL}calc:{{") == (f"{TOOL_CALL}calc:{{", [])


# -- the harness --------------------------------------------------------------------------


class Lookup(Harness):
    """Turn 1: the model calls tools; the env answers each call by id only (no name)."""

    max_turns = 2
    tools = ({"type": "function", "function": {"name": "ab"}},
             {"type": "function", "function": {"name": "cd"}})  # fmt: skip

    def __init__(self) -> None:
        super().__init__(None)
        self.seen: list[dict[str, Any]] = []

    def user_prompt(self, task):  # type: ignore[no-untyped-def]
        return "look up"

    def env_response(self, messages, task, state):  # type: ignore[no-untyped-def]
        self.seen.append(messages[-1])
        calls = messages[-1].get("tool_calls", [])
        return [{"role": "tool", "tool_call_id": c["id"], "content": c["function"]["name"][::-1]}
                for c in calls], False  # fmt: skip


class Script:
    """Inference that replies with fixed texts (each closed with <|end|>)."""

    def __init__(self, *texts: str) -> None:
        self.texts, self.prompts = list(texts), []

    async def __call__(self, model, request_id, prompt_ids, sampling, stop_token_ids, seed, *, env=None):  # type: ignore[no-untyped-def]  # fmt: skip
        self.prompts.append(list(prompt_ids))
        out = ids(self.texts.pop(0)) + [END]
        return GenerateResult(request_id=request_id, completion_ids=pack_i32(out),
                              logprobs=pack_f32([-0.5] * len(out)), finish_reason="stop", policy_version=0)  # fmt: skip


async def test_harness_records_calls_with_derived_ids_and_names_their_answers() -> None:
    """Each call gets derive_id(rollout, "turn", t, "call", k), is recorded on the
    assistant message and handed to the env OpenAI-style; tool messages record the
    tool_call_id they answer and are named after their call, rendered with that name; the
    last prompt is the template of the recorded conversation (no drift)."""
    harness = Lookup()
    env = Environment("lookup", make_env("reverse-text", {}).taskset, harness,
                      Rubric({"r": lambda m, t, s: 1.0}))  # fmt: skip
    calls = format_tool_call("ab", {"q": "x"}) + format_tool_call("cd", {})
    gen = Script(f"hm{calls}", "done")
    trace = await run_rollout(env, TaskRef(index=0, data={}), gen, R, SamplingParams(),
                              rollout_id="r7")  # fmt: skip
    assert trace.ok and not trace.turn_errors
    ids0, ids1 = derive_id("r7", "turn", 0, "call", 0), derive_id("r7", "turn", 0, "call", 1)
    reply = trace.messages[1]
    assert reply.content == "hm"
    assert [(c.id, c.name, c.arguments) for c in reply.tool_calls] == [
        (ids0, "ab", '{"q":"x"}'), (ids1, "cd", "{}")
    ]  # fmt: skip
    assert harness.seen[0] == {"role": "assistant", "content": "hm", "tool_calls": [
        openai_call("ab", '{"q":"x"}', ids0), openai_call("cd", "{}", ids1)]}  # fmt: skip
    tools = trace.messages[2:4]
    assert [(m.name, m.tool_call_id, m.content) for m in tools] == [
        ("ab", ids0, "ba"), ("cd", ids1, "dc")
    ]  # fmt: skip
    assert TOK.decode(i32(tools[0].token_ids).tolist(), skip_special_tokens=False) == "<|tool|>ab:ba<|end|>"  # fmt: skip
    chat = [chat_message(m) for m in trace.messages]
    assert chat[2] == {"role": "tool", "content": "ba", "name": "ab", "tool_call_id": ids0}
    assert R.render_prompt(chat[:-1]) == gen.prompts[-1]


# -- SFT on tool outputs by tool name -------------------------------------------------------


class TeacherScript:
    """tool-calc's scripted teacher, without the bus: env.solve on the conversation so far."""

    def __init__(self) -> None:
        self.env = make_env("tool-calc", {})

    async def __call__(self, model, request_id, prompt_ids, sampling, stop_token_ids, seed, *, env=None):  # type: ignore[no-untyped-def]  # fmt: skip
        seen = R.read_conversation(list(prompt_ids))
        out = ids(self.env.solve(seen)) + [END]
        return GenerateResult(request_id=request_id, completion_ids=pack_i32(out),
                              logprobs=pack_f32([0.0] * len(out)), finish_reason="stop", policy_version=0)  # fmt: skip


async def test_sft_on_tool_outputs_filters_by_the_name_resolved_from_the_call() -> None:
    """tool-calc answers by tool_call_id only; the harness names the answer after its call,
    so the env's `sft.tool_names` (and echo's) select its content tokens by tool name."""
    env = make_env("tool-calc", {})
    traces = [
        await run_rollout(
            env,
            TaskRef(index=0, data={"a": 12, "b": 34}),
            TeacherScript(),
            R,
            SamplingParams(max_completion_tokens=32),
            rollout_id=f"r{i}",
            group_id="g",
            sample_index=i,
        )
        for i in range(2)
    ]
    (call,), tool = traces[0].messages[2].tool_calls, traces[0].messages[3]
    assert (tool.role, tool.name, tool.tool_call_id) == ("tool", "calc", call.id)
    start = sum(len(m.token_ids) // 4 for m in traces[0].messages[:3])
    span = [start + k for k in range(*tool.content_span)]  # "46" in the branch
    group = [TraceCompleted(run="x", env="tool-calc", request_id="q", group_size=2, step=0,
                            trace=t) for t in traces]  # fmt: skip
    grpo = create("grpo")
    (s, _) = score_group("grpo", grpo, group, tool_sft=ToolSft(0.5, ("calc",))).samples
    assert np.flatnonzero(mask(s.sft_mask)).tolist() == span
    assert f32(s.ce_weights)[span].tolist() == [0.5, 0.5]
    (s, _) = score_group("grpo", grpo, group, tool_sft=ToolSft(0.5, ("web",))).samples
    assert s.sft_mask is None
    echo = create("echo", {"alpha": 1.0, "tool_names": ["calc"]})
    (s, _) = score_group("echo", echo, group).samples
    assert np.flatnonzero(mask(s.sft_mask)).tolist() == span

    # The same rule from a run's config: `[orchestrator.train.env.sft]` reaches the worker's core.
    for names, expected in ((["calc"], span), (["web"], None)):
        cfg = load_config("smoke", [
            'orchestrator.train.env=[{id="tool-calc", group_size=2, sft={on_tool_outputs=true, '
            f'alpha=0.5, tool_names={json.dumps(names)}}}}}]',
        ])  # fmt: skip
        core = ScoringCore.for_run(cfg, "grpo")
        assert await core.step(group[0]) is None
        scored = await core.step(group[1])
        assert scored is not None
        s = scored.samples[0]
        if expected is None:
            assert s.sft_mask is None
        else:
            assert np.flatnonzero(mask(s.sft_mask)).tolist() == expected
            assert f32(s.ce_weights)[expected].tolist() == [0.5, 0.5]


async def test_an_env_without_tools_reads_a_call_marker_as_text() -> None:
    """Only an env that declares tools gets replies parsed into calls: elsewhere a stray
    marker in a reply is content (no turn error, nothing masked)."""
    harness = Lookup()
    harness.tools = ()
    env = Environment("plain", make_env("reverse-text", {}).taskset, harness,
                      Rubric({"one": lambda m, t, s: 1.0}))  # fmt: skip
    gen = Script('hm<|tool_call|>ab:{"q":"x"}', "done")
    trace = await run_rollout(env, TaskRef(index=0, data={}), gen, R, SamplingParams(),
                              rollout_id="p")  # fmt: skip
    reply = trace.messages[1]
    assert reply.content == 'hm<|tool_call|>ab:{"q":"x"}' and reply.tool_calls == []
    assert not reply.masked and trace.turn_errors == []
