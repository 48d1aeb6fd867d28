"""Unit tests for the rollout harness: token attribution (every token the model saw in
exactly one message), truncation, closing remarks, content spans, cancellation; the
failure kinds are in ``test_env_errors.py``."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from roles.lib.envs.base import Environment, Harness, Rubric
from roles.lib.envs.harness import completion_tokens, run_rollout
from roles.lib.envs.registry import make_env
from roles.lib.model.render import Renderer
from roles.lib.model.tokenizer import build_tokenizer
from schemas import (
    GenerateResult,
    InferenceFailed,
    SamplingParams,
    TaskRef,
    Trace,
    derive_id,
    stable_seed,
)
from schemas.arrays import f32, i32, mask, pack_f32, pack_i32

TOK = build_tokenizer()
R = Renderer(TOK)
END = R.end_token_id
SAMPLING = SamplingParams(temperature=0.7, max_completion_tokens=32)


class FakeGenerate:
    """Scripted inference: each call pops a reply — (text, finish_reason[, version]), an
    ``InferenceFailed``, or an exception to raise. Records every call (``pin_version``:
    the env server's eval pinning, ``InferenceClient.generate``'s keyword)."""

    def __init__(self, *replies: Any) -> None:
        self.replies = list(replies)
        self.calls: list[dict[str, Any]] = []
        self.completions: list[list[int]] = []
        self.logprobs: list[list[float]] = []

    async def __call__(
        self, model, request_id, prompt_ids, sampling, stop_token_ids, seed, *, env=None,
        pin_version=None,
    ):  # type: ignore[no-untyped-def]  # fmt: skip
        self.calls.append(dict(model=model, request_id=request_id, prompt=list(prompt_ids), sampling=sampling,
                               stop=list(stop_token_ids), seed=seed, env=env, pin_version=pin_version))  # fmt: skip
        reply = self.replies.pop(0)
        if isinstance(reply, BaseException):
            raise reply
        if isinstance(reply, InferenceFailed):
            return reply
        text, finish, *version = reply
        ids = TOK.encode(text, add_special_tokens=False) + ([END] if finish == "stop" else [])
        lps = [-0.25 * (k + 1) for k in range(len(ids))]
        self.completions.append(ids)
        self.logprobs.append(lps)
        return GenerateResult(
            request_id=request_id, completion_ids=pack_i32(ids), logprobs=pack_f32(lps),
            finish_reason=finish, policy_version=version[0] if version else 0, queue_s=0.5, compute_s=0.25,
        )  # fmt: skip


def task_ref(
    env: Environment, index: int = 0, split: str = "train", data: dict | None = None
) -> TaskRef:
    return TaskRef(
        index=index, split=split, data=data if data is not None else env.task(split, index)
    )


def check_invariants(trace: Trace, final_seen: list[int]) -> None:
    """Per-message arrays align; every branch concatenates to what the model saw last."""
    for m in trace.messages:
        n = len(i32(m.token_ids))
        assert len(mask(m.sampled)) == n and len(f32(m.logprobs)) == n, m.role
        assert not f32(m.logprobs)[~mask(m.sampled)].any()  # logprob 0 where not sampled
    for branch in trace.branches:
        ids, sampled, lps, temps = trace.branch_tokens(branch)
        assert ids.tolist() == final_seen
        assert len(sampled) == len(lps) == len(temps) == len(ids)


def sampled_tokens(trace: Trace) -> tuple[list[int], list[float]]:
    ids, sampled, lps, _ = trace.branch_tokens(trace.branches[0])
    return ids[sampled].tolist(), lps[sampled].tolist()


async def test_single_turn_rollout_records_exactly_what_the_model_saw() -> None:
    """reverse-text: prompt tokens per message, gen prompt + completion on the assistant,
    sampled mask and logprobs on the completion only, reward from the rubric."""
    env = make_env("reverse-text", {})
    task = task_ref(env, data={"text": "hello"})
    gen = FakeGenerate(("olleh", "stop", 7))
    trace = await run_rollout(env, task, gen, R, SAMPLING, rollout_id="r1", model="policy",
                              group_id="g", sample_index=2, seed=11)  # fmt: skip
    assert trace.ok and trace.reward == 1.0 and trace.rewards == {"lcs": 1.0}
    assert trace.metrics == {"exact": 1.0}
    final = gen.calls[0]["prompt"] + gen.completions[0]
    check_invariants(trace, final)
    assert [m.role for m in trace.messages] == ["system", "user", "assistant"]
    system, user, assistant = trace.messages
    assert TOK.decode(i32(system.token_ids)) == "<|system|>Reverse the text.<|end|>"
    assert TOK.decode(i32(user.token_ids)) == "<|user|>hello<|end|>"
    assert TOK.decode(i32(assistant.token_ids)) == "<|assistant|>olleh<|end|>"
    assert mask(assistant.sampled).tolist() == [False] + [True] * 6
    assert sampled_tokens(trace) == (gen.completions[0], pytest.approx(gen.logprobs[0]))
    assert assistant.content == "olleh" and assistant.finish_reason == "stop"
    assert (
        assistant.temperature == 0.7
        and assistant.policy_version == 7
        and assistant.model == "policy"
    )
    assert (trace.policy_min, trace.policy_max, trace.num_turns, trace.truncated) == (
        7,
        7,
        1,
        False,
    )
    assert trace.branches[0].messages == [0, 1, 2]
    assert [m.parent for m in trace.messages] == [None, 0, 1]
    assert (trace.rollout_id, trace.group_id, trace.sample_index, trace.env) == ("r1", "g", 2, "reverse-text")  # fmt: skip
    assert trace.task == task
    assert set(trace.timings) >= {"generate_s", "env_s", "total_s", "queue_s"}
    assert trace.timings["queue_s"] == 0.5
    assert completion_tokens(trace) == 6
    call = gen.calls[0]
    assert call["request_id"] == derive_id("r1", "turn", 0)
    assert call["seed"] == stable_seed(11, "turn", 0)
    assert call["env"] == "reverse-text" and call["model"] == "policy"
    assert call["stop"] == R.stop_token_ids and call["sampling"] == SAMPLING


async def test_multi_turn_rollout_with_truncated_turn_keeps_token_invariant() -> None:
    """alphabet-sort over 3 turns, the middle one cut off: every prompt extends the last, the
    closing <|end|> is unsampled context on that assistant message, rewards are per turn."""
    env = make_env("alphabet-sort", {"max_turns": 3})
    data = {"names": ["Kai", "Ada", "Sue"], "additions": [["Bo", "Zoe"], ["Cy"]]}
    task = task_ref(env, data=data)
    gen = FakeGenerate(("Ada,Kai,Sue", "stop", 3), ("Ada,Bo,Ka", "length", 5), ("Ada,Bo,Cy,Kai,Sue,Zoe", "stop", 4))  # fmt: skip
    trace = await run_rollout(env, task, gen, R, SAMPLING, rollout_id="r", seed=1)
    assert trace.ok, trace.errors
    assert [m.role for m in trace.messages] == ["system", "user", "assistant", "user", "assistant", "user", "assistant"]  # fmt: skip
    check_invariants(trace, gen.calls[-1]["prompt"] + gen.completions[-1])
    for k in range(1, 3):  # each prompt extends the previous prompt + its completion
        prev = gen.calls[k - 1]["prompt"] + gen.completions[k - 1]
        assert gen.calls[k]["prompt"][: len(prev)] == prev
    cut = trace.messages[4]
    assert TOK.decode(i32(cut.token_ids)) == "<|assistant|>Ada,Bo,Ka<|end|>"
    assert mask(cut.sampled).tolist() == [False] + [True] * 9 + [False]
    ids, lps = sampled_tokens(trace)
    assert ids == sum(gen.completions, [])
    assert lps == pytest.approx(sum(gen.logprobs, []))
    assert trace.messages[3].content == "Add: Bo,Zoe"
    assert (trace.policy_min, trace.policy_max, trace.num_turns, trace.truncated) == (3, 5, 3, True)
    assert trace.reward == pytest.approx(2 / 3)
    assert trace.metrics == {"turn_1_correct": 1.0, "turn_2_correct": 0.0, "turn_3_correct": 1.0}
    assert [c["request_id"] for c in gen.calls] == [derive_id("r", "turn", k) for k in range(3)]
    assert len({c["seed"] for c in gen.calls}) == 3


async def test_final_truncated_completion_is_not_closed() -> None:
    """A completion cut off on the last turn gets no <|end|>: the model never saw one."""
    env = make_env("reverse-text", {})
    gen = FakeGenerate(("ollehollehol", "length"))
    trace = await run_rollout(env, task_ref(env, data={"text": "hello"}), gen, R, SAMPLING, rollout_id="r")  # fmt: skip
    check_invariants(trace, gen.calls[0]["prompt"] + gen.completions[0])
    assert trace.truncated and trace.messages[-1].finish_reason == "length"
    assert i32(trace.messages[-1].token_ids)[-1] != END


async def test_max_turns_override_stops_early() -> None:
    """max_turns from the request caps the conversation; only the turns asked are scored."""
    env = make_env("alphabet-sort", {"max_turns": 3})
    data = {"names": ["Kai", "Ada", "Sue"], "additions": [["Bo"], ["Cy"]]}
    gen = FakeGenerate(("Ada,Kai,Sue", "stop"))
    trace = await run_rollout(env, task_ref(env, data=data), gen, R, SAMPLING, rollout_id="r", max_turns=1)  # fmt: skip
    assert trace.num_turns == 1 and len(gen.calls) == 1
    assert trace.reward == 1.0 and trace.metrics == {"turn_1_correct": 1.0}


class Chatty(Harness):
    """Two turns; after the second the env has a closing remark the model never sees."""

    max_turns = 5

    def user_prompt(self, task):  # type: ignore[no-untyped-def]
        return "hi"

    def env_response(self, messages, task, state):  # type: ignore[no-untyped-def]
        n = sum(m["role"] == "assistant" for m in messages)
        if n == 1:
            return [{"role": "tool", "name": "calc", "content": "42"}], False
        if n == 2:
            return [{"role": "user", "content": "Thanks."}], True
        raise AssertionError("called after done")


async def test_env_closing_messages_carry_no_tokens() -> None:
    """Messages after the last generation are recorded with empty token arrays; tool messages
    are rendered with their name."""
    env = Environment("chatty", make_env("reverse-text", {}).taskset, Chatty(None),
                      Rubric({"n": lambda m, t, s: float(len(m))}))  # fmt: skip
    gen = FakeGenerate(("a", "stop"), ("b", "stop"))
    trace = await run_rollout(env, TaskRef(index=0, data={}), gen, R, SAMPLING, rollout_id="r")
    assert [m.role for m in trace.messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert TOK.decode(i32(trace.messages[2].token_ids)) == "<|tool|>calc:42<|end|>"
    assert trace.messages[2].name == "calc"
    assert trace.messages[-1].token_ids == b"" and trace.messages[-1].content == "Thanks."
    check_invariants(trace, gen.calls[-1]["prompt"] + gen.completions[-1])
    assert trace.reward == 5.0  # the rubric saw the closing remark


class Spanned(Harness):
    """A named tool reply (and an empty one), user feedback, then a closing remark ending it."""

    max_turns = 5

    def user_prompt(self, task):  # type: ignore[no-untyped-def]
        return "add 2 and 3"

    def env_response(self, messages, task, state):  # type: ignore[no-untyped-def]
        n = sum(m["role"] == "assistant" for m in messages)
        if n == 1:
            return [{"role": "tool", "name": "calc", "content": "5"},
                    {"role": "tool", "name": "calc", "content": ""}], False  # fmt: skip
        if n == 2:
            return [{"role": "user", "content": "Say it: 5"}], False
        return [{"role": "user", "content": "Bye."}], True


def content_of(message) -> str:  # type: ignore[no-untyped-def]
    start, end = message.content_span
    return TOK.decode(i32(message.token_ids)[start:end].tolist(), skip_special_tokens=False)


async def test_env_messages_record_their_content_span() -> None:
    """Opening and feedback messages record [start, end) of their content tokens: decoding it
    gives the content, and for a named tool message it excludes role, name, colon and <|end|>;
    assistant messages and closing remarks (no tokens) record none."""
    env = Environment("spanned", make_env("reverse-text", {}).taskset, Spanned("Be brief."),
                      Rubric({"n": lambda m, t, s: 1.0}))  # fmt: skip
    gen = FakeGenerate(("calc 2+3", "stop"), ("5", "stop"), ("5", "stop"))
    trace = await run_rollout(env, TaskRef(index=0, data={}), gen, R, SAMPLING, rollout_id="r")
    assert trace.ok, trace.errors
    check_invariants(trace, gen.calls[-1]["prompt"] + gen.completions[-1])
    roles = ["system", "user", "assistant", "tool", "tool", "assistant", "user", "assistant", "user"]  # fmt: skip
    assert [m.role for m in trace.messages] == roles
    for m in trace.messages:
        if m.role == "assistant" or not m.token_ids:
            assert m.content_span is None, m
        else:
            assert content_of(m) == m.content, m
    tool, empty = trace.messages[3], trace.messages[4]
    start, end = tool.content_span
    ids = i32(tool.token_ids).tolist()
    assert TOK.decode(ids[:start], skip_special_tokens=False) == "<|tool|>calc:"
    assert TOK.decode(ids[end:], skip_special_tokens=False) == "<|end|>"
    assert end - start == 1 and empty.content_span == (start, start)
    assert trace.messages[0].content_span == (1, 1 + len("Be brief."))


async def test_opening_span_skipped_when_the_template_adds_tokens() -> None:
    """An opening message whose tokens include template extras (a bos) gets no span; the
    others keep an exact one."""

    class BosRenderer(Renderer):
        def render_prompt(self, messages, tools=None):  # type: ignore[no-untyped-def]
            return [TOK.bos_token_id, *super().render_prompt(messages, tools)]

    env = make_env("reverse-text", {})
    gen = FakeGenerate(("olleh", "stop"))
    trace = await run_rollout(env, task_ref(env, data={"text": "hello"}), gen, BosRenderer(TOK),
                              SAMPLING, rollout_id="r")  # fmt: skip
    check_invariants(trace, gen.calls[0]["prompt"] + gen.completions[0])
    system, user, _ = trace.messages
    assert i32(system.token_ids)[0] == TOK.bos_token_id and system.content_span is None
    assert content_of(user) == "hello"


async def test_cancellation_propagates() -> None:
    """A cancelled rollout (role draining) raises CancelledError instead of faking a trace."""

    async def hang(*args: Any, **kw: Any) -> GenerateResult:
        await asyncio.sleep(3600)
        raise AssertionError

    env = make_env("reverse-text", {})
    task = asyncio.ensure_future(run_rollout(env, task_ref(env), hang, R, SAMPLING, rollout_id="r"))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_split_initial_prompt_with_template_extras() -> None:
    """Tokens a template adds before the messages go to the first message; pieces always
    concatenate to the prompt."""

    class FakeRenderer:
        generation_prompt_ids = [9]

        def message_tokens(self, m):  # type: ignore[no-untyped-def]
            return [len(m["content"])] * 2

    msgs = [{"role": "system", "content": "a"}, {"role": "user", "content": "bbb"}]
    assert Renderer.split_initial_prompt(FakeRenderer(), msgs, [1, 1, 3, 3, 9]) == (
        [[1, 1], [3, 3]],
        [9],
    )
    assert Renderer.split_initial_prompt(FakeRenderer(), msgs, [7, 1, 1, 3, 3, 9]) == (
        [[7, 1, 1], [3, 3]],
        [9],
    )
    pieces, gen = Renderer.split_initial_prompt(FakeRenderer(), msgs, [5, 5, 5])
    assert sum(pieces, []) + gen == [5, 5, 5]
