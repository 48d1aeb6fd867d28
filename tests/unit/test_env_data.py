"""Tasksets from data (a list, JSONL, Parquet, a dataset's rows) and async reward
functions, through the same harness as the built-in envs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from roles.lib.envs.base import Environment, Harness, ListTaskset, Rubric
from roles.lib.envs.harness import run_rollout
from roles.lib.model.render import Renderer
from roles.lib.model.tokenizer import build_tokenizer
from schemas import GenerateResult, SamplingParams, TaskRef
from schemas.arrays import pack_f32, pack_i32

TASKS = [{"question": f"{a}+{b}?", "answer": str(a + b)} for a in range(20) for b in range(5)]


def test_a_list_splits_by_a_stable_hash_and_keeps_its_order() -> None:
    ts = ListTaskset(TASKS, eval_fraction=0.2)
    train, evals = ts.size("train"), ts.size("eval")
    assert train + evals == len(TASKS) and 5 < evals < 40
    seen = [json.dumps(ts.task(s, i)) for s in ("train", "eval") for i in range(ts.size(s))]
    assert sorted(seen) == sorted(json.dumps(t) for t in TASKS)  # every task once
    assert [ts.task("train", i) for i in range(train)] == [
        t for t in TASKS if t in ts.splits["train"]
    ]
    again = ListTaskset(list(reversed(TASKS)), eval_fraction=0.2)  # a task's split is its own
    assert sorted(map(json.dumps, again.splits["eval"])) == sorted(
        map(json.dumps, ts.splits["eval"])
    )
    with pytest.raises(IndexError, match="out of range"):
        ts.task("eval", evals)
    given = ListTaskset(TASKS[:3], eval_tasks=TASKS[3:4])
    assert given.size("train") == 3 and given.task("eval", 0) == TASKS[3]
    with pytest.raises(TypeError):
        ListTaskset([{"x": object()}])


def test_jsonl_parquet_and_dataset_rows_give_the_same_tasks(tmp_path: Path) -> None:
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TASKS) + "\n")
    pl.DataFrame(TASKS).write_parquet(tmp_path / "t.parquet")
    want = ListTaskset(TASKS).splits
    assert ListTaskset.from_file(tmp_path / "t.jsonl").splits == want
    assert ListTaskset.from_file(tmp_path / "t.parquet").splits == want
    assert ListTaskset.from_dataset(iter(TASKS)).splits == want  # a Dataset iterates row dicts


class Ask(Harness):
    def user_prompt(self, task: dict[str, Any]) -> str:
        return task["question"]


async def judged(messages: list[dict[str, Any]], task: dict[str, Any], state: Any) -> float:
    await asyncio.sleep(0)  # (a judge would ask a model here)
    return float(messages[-1]["content"].strip() == task["answer"])


def length(messages: list[dict[str, Any]], task: dict[str, Any], state: Any) -> float:
    return float(len(messages[-1]["content"]))


async def test_an_async_reward_function_scores_a_rollout_and_a_replay() -> None:
    tok = build_tokenizer()
    renderer = Renderer(tok)
    env = Environment("qa", ListTaskset(TASKS), Ask(), Rubric({"judged": judged, "length": length},
                                                               weights={"length": 0.0}))  # fmt: skip
    task = env.task("train", 0)

    async def generate(model, request_id, prompt_ids, sampling, stop_token_ids, seed, *, env=None):  # type: ignore[no-untyped-def]  # fmt: skip
        ids = tok.encode(task["answer"], add_special_tokens=False) + [renderer.end_token_id]
        return GenerateResult(request_id=request_id, completion_ids=pack_i32(ids),
                              logprobs=pack_f32([-0.1] * len(ids)), finish_reason="stop",
                              policy_version=1)  # fmt: skip

    trace = await run_rollout(env, TaskRef(index=0, data=task), generate, renderer,
                              SamplingParams(), rollout_id="r0")  # fmt: skip
    assert trace.ok and trace.reward == 1.0 and trace.rewards == {"judged": 1.0}
    assert trace.metrics == {"length": float(len(task["answer"]))}
    # Outside an event loop (rubric replay), score() runs the async function too.
    chat = [*env.initial_messages(task), {"role": "assistant", "content": task["answer"]}]
    assert (await asyncio.to_thread(env.score, chat, task, {})).reward == 1.0


async def test_score_inside_a_running_loop_works_for_sync_functions_and_names_an_async_one() -> (
    None
):
    """A reward function may call another rubric's score() while the harness's loop runs
    (composing rubrics); an async function reached that way is named, not hung."""
    inner = Rubric({"length": length})
    outer = Rubric({"composed": lambda m, t, s: inner.score(m, t, s).reward})
    chat = [{"role": "assistant", "content": "46"}]
    assert (await outer.ascore(chat, TASKS[0], {})).reward == 2.0
    with pytest.raises(
        RuntimeError, match="reward function 'judged' is async: await Rubric.ascore"
    ):
        Rubric({"judged": judged}).score(chat, TASKS[0], {})
