"""Agent envs: env code drives the conversation through the official OpenAI client; the
policy's calls become one trace branch with exactly the sampled tokens, a judge's call
is recorded beside it and never trains, a call that rewrites history is refused; an
agent cut short at a limit (prompt too long, calls spent) is scored as far as it got."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from roles.lib.envs.agent import AgentHarness
from roles.lib.envs.base import Environment, ListTaskset, Rubric
from roles.lib.envs.builtin.calculator import TOOL_SCHEMA
from roles.lib.envs.harness import run_rollout
from roles.lib.model.families import build_family_model
from roles.lib.model.loading import load_model, load_tokenizer
from roles.lib.model.render import make_renderer
from schemas import GenerateResult, InferenceFailed, SamplingParams, TaskRef
from schemas.arrays import f32, pack_f32, pack_i32

CALL = '<tool_call>\n{"name": "calc", "arguments": {"expr": "12+34"}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_family_model(tmp_path_factory.mktemp("m") / "qwen3", "qwen3")


def logprobs(model: Any, ids: list[int]) -> list[float]:
    with torch.no_grad():
        out = model(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return [0.0, *out[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()]


class Scripted:
    """Replies by model: scripted texts, with the model's own logprobs on the prompt (an
    ``InferenceFailed`` reply: inference refuses that call)."""

    def __init__(self, model: Any, tok: Any, end: int, replies: dict[str, list[Any]]) -> None:
        self.model, self.tok, self.end, self.replies = model, tok, end, replies
        self.prompts: dict[str, list[list[int]]] = {k: [] for k in replies}

    async def __call__(self, model, request_id, prompt_ids, sampling, stop_token_ids, seed, *, env=None):  # type: ignore[no-untyped-def]  # fmt: skip
        reply = self.replies[model].pop(0)
        self.prompts[model].append(list(prompt_ids))
        if isinstance(reply, InferenceFailed):  # inference refused the call
            return reply
        ids = self.tok.encode(reply, add_special_tokens=False) + [self.end]
        lps = logprobs(self.model, [*prompt_ids, *ids])[len(prompt_ids) :]
        return GenerateResult(request_id=request_id, completion_ids=pack_i32(ids),
                              logprobs=pack_f32(lps), finish_reason="stop", policy_version=4)  # fmt: skip


class Solver(AgentHarness):
    """Asks the policy, runs the tool it calls, asks again, has a judge grade it."""

    rewrite = False

    async def run(self, client: Any, model: str, task: dict[str, Any], state: Any) -> Any:
        messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
        r = await client.chat.completions.create(
            model=model, messages=messages, tools=[TOOL_SCHEMA]
        )
        said = r.choices[0].message
        messages.append(said.model_dump(exclude_none=True))
        (call,) = said.tool_calls
        expr = json.loads(call.function.arguments)["expr"]
        messages.append({"role": "tool", "tool_call_id": call.id, "content": str(eval(expr))})  # noqa: S307
        if self.rewrite:
            messages[1] = {"role": "assistant", "content": "I will compute it."}
        r = await client.chat.completions.create(model=model, messages=messages)
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        verdict = await client.chat.completions.create(
            model="judge",
            messages=[{"role": "user", "content": f"Is {messages[-1]['content']} right?"}],
        )
        state["verdict"] = verdict.choices[0].message.content
        return messages


def right(messages: list[dict[str, Any]], task: dict[str, Any], state: Any) -> float:
    return float(messages[-1]["content"] == task["answer"])


def env_of(harness: AgentHarness) -> Environment:
    tasks = ListTaskset([{"question": "What is 12+34?", "answer": "46"}], eval_fraction=0.0)
    return Environment(
        "solver", tasks, harness, Rubric({"right": right}), state_columns=("verdict",)
    )


async def test_an_agents_policy_calls_are_one_exact_branch_and_a_judge_never_trains(
    qwen3: Path,
) -> None:
    tok, model = load_tokenizer(qwen3), load_model(qwen3)
    renderer = make_renderer(tok)
    gen = Scripted(model, tok, renderer.end_token_id, {"policy": [CALL, "46"], "judge": ["yes"]})
    env = env_of(Solver())
    task = TaskRef(index=0, data=env.task("train", 0))
    trace = await run_rollout(env, task, gen, renderer, SamplingParams(temperature=1.0),
                              rollout_id="r1", agent_models=("policy", "judge"))  # fmt: skip
    assert trace.ok, trace.errors
    assert trace.reward == 1.0 and trace.num_turns == 2 and trace.policy_max == 4
    assert trace.state == {"verdict": "yes"} and trace.stop_condition == "schedule_exhausted"

    first, second = gen.prompts["policy"]
    completions = [tok.encode(CALL, add_special_tokens=False) + [renderer.end_token_id],
                   tok.encode("46", add_special_tokens=False) + [renderer.end_token_id]]  # fmt: skip
    assert second[: len(first) + len(completions[0])] == first + completions[0]  # extends
    (branch,) = trace.branches
    ids, sampled, lps, _ = trace.branch_tokens(branch)
    assert ids.tolist() == second + completions[1]
    recomputed = torch.tensor(logprobs(model, ids.tolist()), dtype=torch.float64)
    assert torch.allclose(
        recomputed[torch.from_numpy(sampled)], torch.from_numpy(lps[sampled]).double(), atol=1e-5
    )

    judge = [m for m in trace.messages if m.model == "judge"]
    assert len(judge) == 1 and judge[0].content == "yes" and judge[0].id not in branch.messages
    assert not f32(judge[0].logprobs).any()
    calls = [m for m in trace.messages if m.tool_calls]
    assert [(c.name, json.loads(c.arguments)) for c in calls[0].tool_calls] == [
        ("calc", {"expr": "12+34"})
    ]
    tool = next(m for m in trace.messages if m.role == "tool")
    assert tool.content == "46" and tool.tool_call_id == calls[0].tool_calls[0].id


async def test_a_call_that_rewrites_history_errors_the_rollout(qwen3: Path) -> None:
    tok, model = load_tokenizer(qwen3), load_model(qwen3)
    renderer = make_renderer(tok)
    gen = Scripted(model, tok, renderer.end_token_id, {"policy": [CALL, "46"], "judge": ["yes"]})
    harness = Solver()
    harness.rewrite = True
    env = env_of(harness)
    trace = await run_rollout(env, TaskRef(index=0, data=env.task("train", 0)), gen, renderer,
                              SamplingParams(), rollout_id="r2", agent_models=("policy", "judge"))  # fmt: skip
    assert [e.kind for e in trace.errors] == ["render_error"] and trace.reward == 0.0
    assert "does not extend the conversation" in trace.errors[0].message


class Chatter(AgentHarness):
    """Asks the policy, says "more", asks again (five times); ``catch``: returns the
    conversation when a call is refused, else lets the refusal propagate."""

    max_turns = 3
    catch = False

    async def run(self, client: Any, model: str, task: dict[str, Any], state: Any) -> Any:
        import openai

        messages: list[dict[str, Any]] = [{"role": "user", "content": task["question"]}]
        for _ in range(5):
            try:
                r = await client.chat.completions.create(model=model, messages=messages)
            except openai.BadRequestError:
                if self.catch:
                    return messages
                raise
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": "more"})
        return messages


def replies(messages: list[dict[str, Any]], task: dict[str, Any], state: Any) -> float:
    return float(sum(m["role"] == "assistant" for m in messages))


TOO_LONG = InferenceFailed(request_id="x", kind="context_too_long", message="300 > 256 tokens")


@pytest.mark.parametrize(
    ("script", "catch", "max_turns", "stop", "turns", "reward"),
    [
        (["a", TOO_LONG], False, None, "prompt_too_long", 1, 1.0),
        (["a", "b", "c"], False, 2, "max_turns_reached", 2, 2.0),
        (["a", TOO_LONG], True, None, "schedule_exhausted", 1, 1.0),
    ],
)  # fmt: skip
async def test_an_agent_cut_short_at_a_limit_is_scored_as_far_as_it_got(
    qwen3: Path, script: list[Any], catch: bool, max_turns: int | None, stop: str, turns: int,
    reward: float,
) -> None:  # fmt: skip
    """A policy call refused at a limit after the policy spoke (its prompt too long for
    the model; the rollout's calls spent, here ``max_turns`` = 2 from the request), that
    the agent lets propagate, ends the rollout there as the harness's loop would:
    scored on the conversation so far, its calls one exact branch that trains, truncated
    only for a prompt too long. An agent that catches the refusal and returns ends it
    itself (``schedule_exhausted``)."""
    tok, model = load_tokenizer(qwen3), load_model(qwen3)
    renderer = make_renderer(tok)
    gen = Scripted(model, tok, renderer.end_token_id, {"policy": list(script)})
    harness = Chatter()
    harness.catch = catch
    env = Environment("chat", env_of(harness).taskset, harness, Rubric({"replies": replies}))
    trace = await run_rollout(env, TaskRef(index=0, data=env.task("train", 0)), gen, renderer,
                              SamplingParams(), rollout_id="c", max_turns=max_turns)  # fmt: skip
    assert trace.ok, trace.errors
    assert (trace.stop_condition, trace.num_turns, trace.reward) == (stop, turns, reward)
    assert trace.truncated == (stop == "prompt_too_long")
    (branch,) = trace.branches
    ids, sampled, *_ = trace.branch_tokens(branch)
    last = gen.prompts["policy"][turns - 1]
    assert ids.tolist()[: len(last)] == last and int(sampled.sum()) > 0


async def test_an_agent_refused_at_its_first_call_is_errored(qwen3: Path) -> None:
    """Nothing was generated: ``context_too_long``, as before (``has_error``)."""
    tok, model = load_tokenizer(qwen3), load_model(qwen3)
    renderer = make_renderer(tok)
    gen = Scripted(model, tok, renderer.end_token_id, {"policy": [TOO_LONG]})
    harness = Chatter()
    env = Environment("chat", env_of(harness).taskset, harness, Rubric({"replies": replies}))
    trace = await run_rollout(env, TaskRef(index=0, data=env.task("train", 0)), gen, renderer,
                              SamplingParams(), rollout_id="c")  # fmt: skip
    assert [e.kind for e in trace.errors] == ["context_too_long"]
    assert trace.stop_condition == "has_error" and trace.reward == 0.0 and not trace.truncated
