"""Models of real families built here (BPE tokenizer, chat template, random weights) and
their renderers (the ``renderers`` package): token for token what the template writes,
multi-turn prompts that extend the last one through tool calls and reasoning, and
logprobs that a trainer recomputes from the recorded tokens exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from roles.lib.envs.base import Environment, Harness, Messages, Rubric, State
from roles.lib.envs.builtin.calculator import TOOL_SCHEMA
from roles.lib.envs.harness import run_rollout
from roles.lib.envs.registry import make_env
from roles.lib.model.families import build_family_model
from roles.lib.model.loading import load_model, load_tokenizer
from roles.lib.model.render import FamilyRenderer, Renderer, check_template, make_renderer
from schemas import GenerateResult, SamplingParams, TaskRef
from schemas.arrays import f32, i32, mask, pack_f32, pack_i32

ARCHS = ["qwen3", "llama"]
TOOLS = [TOOL_SCHEMA]


@pytest.fixture(scope="module", params=ARCHS)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_family_model(tmp_path_factory.mktemp("m") / request.param, request.param)


def test_same_arch_size_and_seed_give_the_same_bytes(tmp_path: Path) -> None:
    a = build_family_model(tmp_path / "a", "qwen3", seed=3)
    b = build_family_model(tmp_path / "b", "qwen3", seed=3)
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name
    c = build_family_model(tmp_path / "c", "qwen3", seed=4)
    assert (c / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()


def conversations(arch: str) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]]:
    call = {"id": "c0", "type": "function",
            "function": {"name": "calc", "arguments": '{"expr": "12+34"}'}}  # fmt: skip
    reasoning = {"reasoning_content": "add them"} if arch == "qwen3" else {}
    return [
        ([{"role": "user", "content": "Reverse: hello"}], None),
        ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None),
        (
            [
                {"role": "system", "content": "Use calc."},
                {"role": "user", "content": "12+34?"},
                {"role": "assistant", "content": "", "tool_calls": [call], **reasoning},
                {"role": "tool", "tool_call_id": "c0", "content": "46"},
                {"role": "assistant", "content": "46", **reasoning},
                {"role": "user", "content": "and 1+1?"},
            ],
            TOOLS,
        ),
    ]


def test_the_template_and_the_renderer_agree_token_for_token(family: Path) -> None:
    """What `apply_chat_template` writes (then tokenised whole) is what the family's
    renderer emits piece by piece: the BPE's pre-tokenizer splits where the pieces do."""
    tok = load_tokenizer(family)
    renderer = make_renderer(tok)
    assert isinstance(renderer, FamilyRenderer)
    assert renderer.name == {"qwen3": "qwen3", "llama": "llama-3"}[family.name]
    for messages, tools in conversations(renderer.name.split("-")[0]):
        text = tok.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True
        )
        want = tok.encode(text, add_special_tokens=False)
        assert renderer.impl.render_ids(messages, tools=tools, add_generation_prompt=True) == want
        assert renderer.render_prompt(messages, tools) == want
    assert check_template(renderer) is None


def test_a_renderer_that_would_drift_is_refused_naming_the_probe(family: Path) -> None:
    """rlbus' own per-message renderer misses the newline Qwen3's template writes after
    <|im_end|>: caught on the first probe, before any rollout. Llama 3's turns are
    independent, so there it is exact (and its tool format unknown: not probed)."""
    why = check_template(Renderer(load_tokenizer(family)))
    if family.name == "llama":
        assert why is None
    else:
        assert why == (
            "a user turn: the next prompt differs from the template's at token 20 "
            "('<|im_start|>user\\nAnd a' vs '\\n<|im_start|>user\\nAnd')"
        )


class Agent(Harness):
    """Calls calc, reads its result, answers; then the user asks again."""

    max_turns = 3
    tools = (TOOL_SCHEMA,)

    def initial_messages(self, task: dict[str, Any]) -> Messages:
        return [{"role": "system", "content": "Use calc."}, {"role": "user", "content": "12+34?"}]

    def env_response(
        self, messages: Messages, task: dict[str, Any], state: State
    ) -> tuple[Messages, bool]:
        replies = [m for m in messages if m["role"] == "assistant"]
        if len(replies) == 1:
            (call,) = replies[0]["tool_calls"]
            assert json.loads(call["function"]["arguments"]) == {"expr": "12+34"}
            return [{"role": "tool", "tool_call_id": call["id"], "content": "46"}], False
        return [{"role": "user", "content": "And 1+1?"}], False


def script(arch: str) -> list[str]:
    if arch == "qwen3":
        return [
            '<think>\nI should use calc.\n</think>\n\n<tool_call>\n{"name": "calc", '
            '"arguments": {"expr": "12+34"}}\n</tool_call>',
            "<think>\nThe tool said 46.\n</think>\n\n46",
            "<think>\nEasy.\n</think>\n\n2",
        ]
    return ['{"name": "calc", "parameters": {"expr": "12+34"}}', "46", "2"]


class ModelGenerate:
    """Scripted replies whose logprobs the model computes on the prompt it is given."""

    def __init__(self, model: Any, tok: Any, renderer: Any, replies: list[str]) -> None:
        self.model, self.tok, self.renderer, self.replies = model, tok, renderer, list(replies)
        self.prompts: list[list[int]] = []
        self.completions: list[list[int]] = []

    async def __call__(self, model, request_id, prompt_ids, sampling, stop_token_ids, seed, *, env=None):  # type: ignore[no-untyped-def]  # fmt: skip
        ids = self.tok.encode(self.replies.pop(0), add_special_tokens=False)
        ids.append(self.renderer.end_token_id)
        self.prompts.append(list(prompt_ids))
        self.completions.append(ids)
        lps = token_logprobs(self.model, [*prompt_ids, *ids])[len(prompt_ids) :]
        return GenerateResult(request_id=request_id, completion_ids=pack_i32(ids),
                              logprobs=pack_f32(lps), finish_reason="stop", policy_version=0)  # fmt: skip


def token_logprobs(model: Any, ids: list[int]) -> list[float]:
    """log p(ids[t] | ids[:t]) for every t (0 for the first)."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    out = logits[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    return [0.0, *out.tolist()]


async def test_a_tool_and_reasoning_conversation_is_token_exact(family: Path) -> None:
    """Three turns (a reasoned tool call, the answer to its result, a new user question):
    every prompt extends the last one token for token, the trace's branch is the last
    prompt + completion, what a trainer recomputes from it is what was sampled, and
    within a tool cycle the prompt is exactly the template's rendering (reasoning kept:
    the template keeps it there too)."""
    tok = load_tokenizer(family)
    renderer = make_renderer(tok)
    arch = renderer.name.split("-")[0]
    model = load_model(family)
    generate = ModelGenerate(model, tok, renderer, script(arch))
    env = Environment(
        "agent", make_env("reverse-text", {}).taskset, Agent(), Rubric({"one": lambda m, t, s: 1.0})
    )
    trace = await run_rollout(env, TaskRef(index=0, split="train", data={}), generate, renderer,
                              SamplingParams(), rollout_id="r0")  # fmt: skip
    assert trace.ok and trace.num_turns == 3 and not trace.turn_errors, trace.errors

    prompts, completions = generate.prompts, generate.completions
    for k in (1, 2):
        assert (
            prompts[k][: len(prompts[k - 1]) + len(completions[k - 1])]
            == prompts[k - 1] + completions[k - 1]
        )
    (branch,) = trace.branches
    ids, sampled, lps, _ = trace.branch_tokens(branch)
    assert ids.tolist() == prompts[2] + completions[2]
    recomputed = torch.tensor(token_logprobs(model, ids.tolist()), dtype=torch.float64)
    assert int(sampled.sum()) == sum(len(c) for c in completions)
    assert torch.allclose(
        recomputed[torch.from_numpy(sampled)], torch.from_numpy(lps[sampled]).double(), atol=1e-5
    )

    first, tool = trace.messages[2], trace.messages[3]
    assert first.role == "assistant" and [
        (c.name, json.loads(c.arguments)) for c in first.tool_calls
    ] == [("calc", {"expr": "12+34"})]
    assert tool.role == "tool" and tool.content == "46" and tool.content_span is not None
    span = i32(tool.token_ids)[slice(*tool.content_span)].tolist()
    assert json.loads(tok.decode(span)) if arch == "llama" else tok.decode(span) == "46"
    assert not mask(tool.sampled).any() and not f32(tool.logprobs).any()
    chat = [{"role": "system", "content": "Use calc."}, {"role": "user", "content": "12+34?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": first.tool_calls[0].id, "type": "function",
             "function": {"name": "calc", "arguments": first.tool_calls[0].arguments}}]},
            {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "46"}]  # fmt: skip
    if arch == "qwen3":
        assert first.reasoning == "I should use calc." and first.content == ""
        assert (
            trace.messages[4].reasoning == "The tool said 46." and trace.messages[4].content == "46"
        )
        chat[2]["reasoning_content"] = first.reasoning
    template = tok.apply_chat_template(
        chat, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert prompts[1] == tok.encode(template, add_special_tokens=False)
    if (
        arch == "qwen3"
    ):  # after a new user query the template would drop old reasoning; rlbus keeps it
        assert "The tool said 46." in tok.decode(prompts[2])


def test_the_scripted_teacher_reads_a_family_prompt_back(family: Path) -> None:
    """The teacher answers from the prompt tokens alone: the family renderer reads the
    turns back (system, user, tool results), for the built-in tasks."""
    renderer = make_renderer(load_tokenizer(family))
    for env_id in ("reverse-text", "alphabet-sort"):
        env = make_env(env_id, {})
        for index in range(5):
            task = env.task("eval", index)
            messages = env.initial_messages(task)
            seen = renderer.read_conversation(renderer.render_prompt(messages))
            strip = str.strip if renderer.name == "llama-3" else (lambda s: s)
            assert [(m["role"], m["content"]) for m in seen][-len(messages) :] == [
                (m["role"], strip(m["content"])) for m in messages
            ]
            assert env.solve(seen) == env.reference_answer(messages, task)


def test_the_teachers_tool_call_is_written_in_the_familys_format(family: Path) -> None:
    """tool-calc's scripted answer (a call, in the char template's form) becomes the
    family's own call tokens, which its parser reads back as the same call; the
    answer after the tool result is plain text."""
    renderer = make_renderer(load_tokenizer(family))
    env = make_env("tool-calc", {})
    task = env.task("eval", 0)
    messages = env.initial_messages(task)
    prompt = renderer.render_prompt(messages, env.tools)
    ids = renderer.reply_ids(env.solve(renderer.read_conversation(prompt)))
    assert ids[-1] in renderer.stop_token_ids and ids.count(ids[-1]) == 1
    reply = renderer.parse_reply(ids, prompt, True)
    assert reply.error is None and [c.name for c in reply.calls] == ["calc"]
    expr = json.loads(reply.calls[0].arguments)["expr"]
    assert expr == messages[-1]["content"]
    answer = renderer.reply_ids("46")
    assert renderer.parse_reply(answer, prompt, True).content == "46"
