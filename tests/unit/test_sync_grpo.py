"""The synchronous baseline (``benchmarks.sync_grpo``) does a run's work: the env harness's
prompts, the rubric's rewards, grpo's advantages, a loss with a gradient exactly when a
group's rewards differ, and steps that move the weights. Tiny model, batch 16 (2 x 8)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.sync_grpo import SyncGrpo, run_sync_grpo, summarize
from configs import RunConfig, load_config
from roles.algorithm.builtin import GroupBaseline
from roles.algorithm.registry import create
from roles.lib.envs.registry import make_env
from roles.lib.model.loading import load_tokenizer
from roles.lib.model.render import Renderer
from roles.lib.model.tiny import init_model
from schemas import GenerateResult, SamplingParams, ScoreRequest, ScoreResult, derive_id
from schemas.arrays import f32, mask, pack_f32, pack_i32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sync-grpo") / "tiny"
    init_model(path, seed=0)
    return path


def config(model_dir: Path) -> RunConfig:
    return load_config("default", [f"model.path={model_dir}", "orchestrator.batch_size=16"])


class Scripted:
    """Hand-made completions: for each prompt, the k-th request gets ``answers(text)[k]``
    (``text`` read back from the prompt), with the engine's own logprobs of those tokens,
    so importance ratios are 1 and the trust region keeps every token."""

    def __init__(self, loop: SyncGrpo, answers: Any) -> None:
        self.loop, self.answers = loop, answers
        self.tok = loop.renderer.tokenizer
        self.seen: dict[tuple[int, ...], int] = {}
        self.prompts: dict[str, list[int]] = {}

    async def __call__(
        self, model: str, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams,
        stop_token_ids: Sequence[int], seed: int, *, env: str | None = None,
        pin_version: int | None = None,
    ) -> GenerateResult:  # fmt: skip
        prompt = list(prompt_ids)
        self.prompts[request_id] = prompt
        k = self.seen[tuple(prompt)] = self.seen.get(tuple(prompt), -1) + 1
        text = self.tok.decode(prompt).split("<|user|>")[1].split("<|end|>")[0]
        ids = self.tok.encode(self.answers(text)[k], add_special_tokens=False)
        ids.append(self.loop.renderer.end_token_id)
        (scored,) = self.loop.engine.score(
            [ScoreRequest(request_id=request_id, token_ids=pack_i32(prompt + ids), start=len(prompt))]
        )  # fmt: skip
        assert isinstance(scored, ScoreResult)
        return GenerateResult(
            request_id=request_id, completion_ids=pack_i32(ids),
            logprobs=pack_f32(f32(scored.logprobs)), finish_reason="stop", policy_version=0,
        )  # fmt: skip


def mixed(text: str) -> list[str]:
    """Eight answers of different quality: exact, partly right, wrong, empty."""
    r = text[::-1]
    return [r, text, r[:-1], "", r + "q", "zz", r[1:], r]


async def test_prompts_are_the_harness_prompts_of_train_tasks(model_dir: Path) -> None:
    loop = SyncGrpo(config(model_dir))
    real = loop.generate
    asked: dict[str, dict[str, Any]] = {}

    async def spy(model, request_id, prompt_ids, sampling, stop, seed, **kw):  # type: ignore[no-untyped-def]
        asked[request_id] = {"prompt": list(prompt_ids), "seed": seed, "sampling": sampling}
        return await real(model, request_id, prompt_ids, sampling, stop, seed, **kw)

    loop.generate = spy  # type: ignore[method-assign,assignment]
    try:
        r = await loop.rollouts()
    finally:
        await loop.close()
    env = make_env("reverse-text", {})
    renderer = Renderer(load_tokenizer(model_dir))
    assert len(r.traces) == 16 and len(r.requests) == 2
    assert all(q.group_size == 8 and q.task.split == "train" for q in r.requests)
    assert r.requests[0].task.index != r.requests[1].task.index
    for t in r.traces:
        assert t.task.split == "train" and env.task("train", t.task.index) == t.task.data
        call = asked[derive_id(t.rollout_id, "turn", 0)]
        assert call["prompt"] == renderer.render_prompt(env.initial_messages(t.task.data))
        assert call["sampling"] == SamplingParams(temperature=1.0, max_completion_tokens=12)
    assert len({c["seed"] for c in asked.values()}) == 16  # every row its own seed
    assert len(r.batch.samples) == 16 and r.batch.step == 1


async def test_rewards_advantages_and_a_step_that_learns(model_dir: Path) -> None:
    loop = SyncGrpo(config(model_dir))
    try:
        # All-equal rewards in every group: zero advantage, no gradient, weights unmoved.
        loop.generate = Scripted(loop, lambda text: [text[::-1]] * 8)  # type: ignore[method-assign,assignment]
        flat = await loop.rollouts()
        before = loop.core.weights_digest()
        metrics = loop.train(flat.batch)
        assert metrics["grad_norm"] == 0.0
        assert loop.core.weights_digest() == before
        # Hand-made answers of mixed quality: the rubric's rewards, grpo's advantages.
        loop.generate = Scripted(loop, mixed)  # type: ignore[method-assign,assignment]
        r = await loop.rollouts()
    finally:
        await loop.close()
    env = make_env("reverse-text", {})
    grpo = create("grpo", {"std_normalize": True})  # the registered grpo
    assert isinstance(grpo, GroupBaseline)
    for request in r.requests:
        group = sorted(
            (t for t in r.traces if t.group_id == request.group_id), key=lambda t: t.sample_index
        )
        data = group[0].task.data
        answers = [next(m.content for m in t.messages if m.role == "assistant") for t in group]
        assert answers == mixed(data["text"])
        for t, answer in zip(group, answers, strict=True):
            chat = [*env.initial_messages(data), {"role": "assistant", "content": answer}]
            assert t.reward == env.score(chat, data, env.init_state(data)).reward
        rewards = [t.reward for t in group]
        assert len(set(rewards)) > 1
        expected = grpo.from_rewards(rewards)
        samples = {s.rollout_id: s for s in r.batch.samples}
        for t, a in zip(group, expected, strict=True):
            s = samples[t.rollout_id]
            adv = f32(s.advantages)[mask(s.mask)]
            assert adv.size and np.allclose(adv, a, atol=1e-6)
    before = loop.core.weights_digest()
    metrics = loop.train(r.batch)
    assert metrics["grad_norm"] > 0.0
    assert loop.core.weights_digest() != before


async def test_real_steps_move_the_weights_and_report(model_dir: Path) -> None:
    loop = SyncGrpo(config(model_dir), threads=1)
    try:
        before = loop.core.weights_digest()
        records = [await loop.step(), await loop.step()]
    finally:
        await loop.close()
    assert loop.core.weights_digest() != before
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["completions"] == r["trained"] == 16 and r["completion_tokens"] > 0
        assert r["gen_s"] > 0 and r["train_s"] > 0 and r["score_s"] >= 0
        assert r["step_s"] == pytest.approx(r["gen_s"] + r["score_s"] + r["train_s"])
    s = summarize(records)
    assert s["completions_per_s"] == pytest.approx(32 / s["wall_s"])
    assert sum(s["split"].values()) == pytest.approx(1.0)


def test_run_sync_grpo_api(model_dir: Path) -> None:
    out = run_sync_grpo(config(model_dir), None, steps=2, threads=1, progress=False)
    assert [r["step"] for r in out["steps"]] == [1, 2]
    assert out["summary"]["steps"] == 1 and out["summary_with_first_step"]["steps"] == 2
    assert out["setup"]["start_step"] == 0 and out["setup"]["algorithms"] == ["grpo"]
    assert out["evals"] == []
