"""verifiers environments run unchanged (``vf:<module>``, ``roles.lib.envs.vf``): a
single-turn, a tool-using (verifiers' own MCP tool server) and a multi-turn env (a
scripted user) each give one trace whose branch is exactly what was sampled (the
model's recomputed logprobs match the recorded ones), with verifiers' rewards, metrics
and stop condition; a verifiers trace that claims tokens nobody sampled is refused.

The episodes run as verifiers runs them: its chat program in a subprocess, its training
client rendering prompts and calling the rollout's token-in endpoint over loopback HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from roles.lib.envs.harness import run_rollout
from roles.lib.envs.registry import make_env
from roles.lib.envs.vf import episode_trace, stop_of
from roles.lib.model.families import build_family_model
from roles.lib.model.loading import load_model, load_tokenizer
from roles.lib.model.render import make_renderer
from schemas import SamplingParams, TaskRef
from tests.unit.test_agent_env import Scripted, logprobs

CALL = '<tool_call>\n{"name": "calc_add", "arguments": {"a": 12, "b": 34}}\n</tool_call>'


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path: Path = build_family_model(tmp_path_factory.mktemp("m") / "qwen3", "qwen3")
    tok = load_tokenizer(path)
    return tok, load_model(path), make_renderer(tok)


async def rollout(qwen3: Any, env_id: str, replies: list[str]) -> tuple[Any, Any, Any]:
    tok, model, renderer = qwen3
    gen = Scripted(model, tok, renderer.end_token_id, {"policy": list(replies)})
    env = make_env(env_id, {})
    task = TaskRef(index=0, data=env.task("train", 0))
    trace = await run_rollout(env, task, gen, renderer, SamplingParams(temperature=1.0),
                              rollout_id=f"r-{env_id}")  # fmt: skip
    return trace, gen, env


def assert_exact(model: Any, trace: Any) -> list[int]:
    """The one branch's sampled logprobs are the model's own on the branch's tokens."""
    (branch,) = trace.branches
    ids, sampled, lps, _ = trace.branch_tokens(branch)
    recomputed = torch.tensor(logprobs(model, ids.tolist()), dtype=torch.float64)
    assert sampled.any()
    assert torch.allclose(recomputed[torch.from_numpy(sampled)],
                          torch.from_numpy(lps[sampled]).double(), atol=1e-5)  # fmt: skip
    return list(ids.tolist())


async def test_a_single_turn_env_gives_its_rewards_metrics_and_exact_tokens(qwen3: Any) -> None:
    trace, gen, env = await rollout(qwen3, "vf:tests.vf_envs.add", ["4"])
    assert trace.ok, trace.errors
    question = trace.task.data["prompt"]  # "What is a+b?"
    a, b = question.removeprefix("What is ").removesuffix("?").split("+")
    exact = float(int(a) + int(b) == 4)
    assert trace.rewards == pytest.approx({"exact": exact, "brief": 0.1 * (1 - 1 / 40)})
    assert trace.reward == pytest.approx(exact + 0.1 * (1 - 1 / 40))
    assert trace.metrics == {"reply_chars": 1.0}
    assert trace.state == {"stop_condition": "agent_completed"}
    assert trace.stop_condition == "schedule_exhausted"  # verifiers' name, rlbus's
    assert env.state_columns == ("stop_condition",)
    ids = assert_exact(qwen3[1], trace)
    (prompt,) = gen.prompts["policy"]
    assert ids[: len(prompt)] == prompt and trace.policy_max == 4 and trace.num_turns == 1
    assert [m.role for m in trace.messages] == ["user", "assistant"]
    assert trace.messages[1].content == "4" and trace.messages[1].policy_version == 4


async def test_a_tool_env_calls_verifiers_tool_server_and_trains_one_exact_branch(
    qwen3: Any,
) -> None:
    trace, gen, _ = await rollout(qwen3, "vf:tests.vf_envs.calc", [CALL, "46"])
    assert trace.ok, trace.errors
    assert trace.reward == 1.0 and trace.num_turns == 2
    roles = [m.role for m in trace.messages]
    assert roles == ["user", "assistant", "tool", "assistant"]
    call = trace.messages[1].tool_calls[0]
    assert call.name == "calc_add" and trace.messages[2].content == "46"  # the server's answer
    ids = assert_exact(qwen3[1], trace)
    first, second = gen.prompts["policy"]
    assert ids[: len(second)] == second and second[: len(first)] == first  # token in, extended


async def test_a_multi_turn_env_with_a_scripted_user_is_one_exact_branch(qwen3: Any) -> None:
    trace, gen, _ = await rollout(qwen3, "vf:tests.vf_envs.recall", ["apple", "apple"])
    assert trace.ok, trace.errors
    assert [m.role for m in trace.messages] == ["user", "assistant", "user", "assistant"]
    assert trace.messages[2].content == "Say it again."
    assert trace.state == {"stop_condition": "user_closed"}
    assert trace.stop_condition == "schedule_exhausted"
    assert trace.reward == float(trace.task.data["prompt"] == "Say apple.")
    ids = assert_exact(qwen3[1], trace)
    first, second = gen.prompts["policy"]
    assert second[: len(first)] == first and ids[: len(second)] == second


async def test_a_verifiers_trace_claiming_unsampled_tokens_is_refused(qwen3: Any) -> None:
    """One real episode, checked against records that differ from it by one token (of
    the completion, of the prompt): the rebuilt trace errors (``render_error``) instead
    of training tokens nobody sampled; against the true record it is one branch."""
    from roles.lib.envs.agent import TokenCall
    from schemas import GenerateResult
    from schemas.arrays import pack_f32, pack_i32

    tok, model, renderer = qwen3
    gen = Scripted(model, tok, renderer.end_token_id, {"policy": ["7"]})
    env = make_env("vf:tests.vf_envs.add", {})
    episodes: list[Any] = []
    episode = env.harness.episode

    async def record(*args: Any) -> Any:
        episodes.append(await episode(*args))
        return episodes[-1]

    env.harness.episode = record  # type: ignore[attr-defined]
    task = TaskRef(index=0, data=env.task("train", 0))
    trace = await run_rollout(env, task, gen, renderer, SamplingParams(), rollout_id="r-bad")
    assert trace.ok, trace.errors
    ((prompt,), (ran,)) = gen.prompts["policy"], episodes
    ids = tok.encode("7", add_special_tokens=False) + [renderer.end_token_id]

    def call(prompt: list[int], sampled: list[int]) -> TokenCall:
        result = GenerateResult(request_id="x", completion_ids=pack_i32(sampled),
                                logprobs=pack_f32([0.0] * len(sampled)), finish_reason="stop",
                                policy_version=1)  # fmt: skip
        return TokenCall("policy", prompt, result)

    for bad in (call(prompt, [ids[0] + 1, *ids[1:]]), call([*prompt[:-1], 0], ids)):
        built = episode_trace(ran, [bad], "policy", 1.0)
        assert [e.kind for e in built.errors] == ["render_error"], built.errors
    good = episode_trace(ran, [call(prompt, ids)], "policy", 1.0)
    assert not good.errors and len(good.branches) == 1 and good.versions == [1]
    # Two trainable agents in one episode: the env breaks rlbus' contract, a bug in env
    # code (every episode would be refused), not an errored rollout to retry.
    from types import SimpleNamespace

    (agent,) = ran.traces
    twice = SimpleNamespace(ok=True, errors=[], traces=[agent, agent])
    bug = episode_trace(twice, [call(prompt, ids)], "policy", 1.0).bug
    assert bug is not None and "2 trainable agents" in bug.message


async def test_a_verifiers_style_load_environment_goes_through_the_bridge(qwen3: Any) -> None:
    """``module:load_environment`` returning a configured ``vf.Taskset`` (not an rlbus
    Environment) is played as ``vf:`` plays it, with the user's own configuration."""
    tok, model, renderer = qwen3
    env = make_env("tests.vf_envs.add:load_environment", {"num_tasks": 5})
    assert env.size("train") + env.size("eval") == 5
    gen = Scripted(model, tok, renderer.end_token_id, {"policy": ["3"]})
    task = TaskRef(index=0, data=env.task("train", 0))
    trace = await run_rollout(env, task, gen, renderer, SamplingParams(), rollout_id="r-load")
    assert trace.ok, trace.errors
    assert set(trace.rewards) == {"exact", "brief"} and trace.metrics == {"reply_chars": 1.0}
    assert_exact(model, trace)


async def test_the_loopback_endpoint_needs_the_process_key_and_a_live_rollout() -> None:
    import httpx

    from roles.lib.envs.agent import Loopback, RolloutEndpoint

    loopback = await Loopback.get()
    endpoint = RolloutEndpoint(None, None, SamplingParams(), "policy", ("policy",), "r", 0, "e")
    async with loopback.serve(endpoint) as base_url, httpx.AsyncClient() as http:
        good = {"Authorization": f"Bearer {loopback.key}"}
        models = await http.get(f"{base_url}/models", headers=good)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "policy"
        wrong = await http.get(f"{base_url}/models", headers={"Authorization": "Bearer x"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        # token-in is refused where the caller's trace does not become the rollout's
        refused = await http.post(f"{base_url.removesuffix('/v1')}/inference/v1/generate",
                                  headers=good, json={"model": "policy", "token_ids": [1]})  # fmt: skip
        assert refused.status_code == 404
    async with httpx.AsyncClient() as http:
        gone = await http.get(f"{base_url}/models", headers=good)
    assert gone.status_code == 404 and "ended" in gone.json()["error"]["message"]


async def test_a_reward_function_that_raises_is_a_bug_in_env_code(qwen3: Any) -> None:
    """verifiers records a raising reward on its trace (``TaskError``); rlbus raises it as
    a bug in env code (the task is dead-lettered, the run stops) rather than erroring
    rollouts forever."""
    from roles.lib.envs.base import EnvCodeError

    with pytest.raises(EnvCodeError) as bug:
        await rollout(qwen3, "vf:tests.vf_envs.broken", ["hi"])
    assert bug.value.error_type == "TaskError" and "division by zero" in str(bug.value)


def test_verifiers_stop_conditions_map_onto_rlbus_names() -> None:
    """verifiers' context limits are ``prompt_too_long``, its turn, output and time
    budgets ``max_turns_reached``, its errors ``has_error``; the env ending it (its agent
    completing, its user closing, a task's own ``@stop``) is ``schedule_exhausted``."""
    expected = {
        "agent_completed": "schedule_exhausted", "user_closed": "schedule_exhausted",
        "answer_found": "schedule_exhausted", None: "schedule_exhausted",
        "max_turns": "max_turns_reached", "max_output_tokens": "max_turns_reached",
        "rollout_timeout": "max_turns_reached", "max_input_tokens": "prompt_too_long",
        "max_total_tokens": "prompt_too_long", "compaction_failed": "prompt_too_long",
        "error": "has_error", "sandbox_error": "has_error",
    }  # fmt: skip
    assert {name: stop_of(name) for name in expected} == expected
