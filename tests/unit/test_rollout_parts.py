"""The env server's and the rollout command's pure parts: groups, eval, adapters, planning."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from bus.errors import NoResponders, RequestTimeout
from roles.env_server.role import (
    client_generate,
    failed_group,
    outputs_for,
    rollout_group,
    rollout_id,
)
from roles.lib.envs.harness import run_rollout
from roles.lib.envs.registry import make_env
from schemas import (
    EvalCompleted,
    TaskRef,
    TaskRequested,
    Trace,
    TraceCompleted,
    derive_id,
    stable_seed,
)
from tests.unit.test_harness import SAMPLING, FakeGenerate, R, task_ref

# -- the env server's pure parts -----------------------------------------------------------


def request(split: str = "train", index: int = 3, group_size: int = 3, **kw: Any) -> TaskRequested:
    return TaskRequested(run="r", event_id="req1", env="reverse-text", task=TaskRef(index=index, split=split),
                         group_id="g1", group_size=group_size, sampling=SAMPLING, seed=42, step=5, **kw)  # fmt: skip


async def test_rollout_group_seeds_and_outputs_derive_from_the_request() -> None:
    """Rollout i samples with stable_seed(seed, i); outputs' ids derive from the request so a
    redelivery republishes the same ids."""
    env = make_env("reverse-text", {})
    req = request()
    gen = FakeGenerate(*[("abc", "stop")] * 3)
    traces = await rollout_group(env, req, gen, R)
    assert [t.sample_index for t in traces] == [0, 1, 2]
    assert sorted(c["seed"] for c in gen.calls) == sorted(stable_seed(stable_seed(42, i), "turn", 0) for i in range(3))  # fmt: skip
    assert all(t.task.data == env.task("train", 3) and t.task.index == 3 for t in traces)
    out = outputs_for(req, traces)
    assert all(isinstance(e, TraceCompleted) for e in out)
    assert [e.event_id for e in out] == [derive_id("req1", "trace", i) for i in range(3)]
    assert [e.trace.rollout_id for e in out] == [rollout_id(req, i) for i in range(3)]
    assert {(e.causation_id, e.request_id, e.group_size, e.step, e.env) for e in out} == {("req1", "req1", 3, 5, "reverse-text")}  # fmt: skip
    again = outputs_for(req, await rollout_group(env, req, FakeGenerate(*[("abc", "stop")] * 3), R))
    assert [e.event_id for e in again] == [e.event_id for e in out]


async def test_eval_request_gives_one_eval_completed() -> None:
    """An eval-split request yields one EvalCompleted with every trace and its reward."""
    env = make_env("reverse-text", {})
    req = request(split="eval", index=0, group_size=2)
    text = env.task("eval", 0)["text"]
    traces = await rollout_group(
        env, req, FakeGenerate((text[::-1], "stop"), RequestTimeout("t")), R
    )
    (out,) = outputs_for(req, traces)
    assert isinstance(out, EvalCompleted)
    assert out.event_id == derive_id("req1", "eval") and out.request_id == "req1"
    assert sorted(out.rewards) == [0.0, 1.0] and out.errors == 1 and len(out.traces) == 2
    assert out.task_index == 0 and out.step == 5


async def test_task_index_wraps_into_the_split() -> None:
    """The orchestrator draws indices from a large space; the env reduces them modulo the split."""
    env = make_env("reverse-text", {"train_size": 10})
    traces = await rollout_group(env, request(index=99), FakeGenerate(*[("abc", "stop")] * 3), R)
    assert all(t.task.index == 9 and t.task.data == env.task("train", 9) for t in traces)


async def test_bad_split_gives_errored_group() -> None:
    """A request the env cannot serve still answers: group_size errored traces."""
    env = make_env("reverse-text", {"train_size": 10})
    traces = await rollout_group(env, request(split="test"), FakeGenerate(), R)
    assert len(traces) == 3 and all(t.errors[0].kind == "task_error" for t in traces)
    assert len({t.rollout_id for t in traces}) == 3


async def test_client_generate_adapter() -> None:
    """env= and pin_version reach the client, once: retrying (no replica yet, a replica
    lost) is the client's alone (tests/unit/test_client_retry.py), so a wait is bounded
    by inference.request_timeout_s, not a multiple of it."""

    class Client:
        def __init__(self) -> None:
            self.calls: list[dict] = []

        async def generate(
            self, model, request_id, prompt_ids, sampling, stop_token_ids=(), seed=0, **kw
        ):  # type: ignore[no-untyped-def]
            self.calls.append(kw)
            if kw.get("env") == "gone":
                raise NoResponders("no reply on rl.r.infer.m within 60 s (5 attempt(s))")
            return kw.get("env")

    client = Client()
    assert await client_generate(client)("m", "r", [1], SAMPLING, [], 0, env="e") == "e"
    await client_generate(client)("m", "r", [1], SAMPLING, [], 0, pin_version=3)
    assert client.calls == [{"env": "e"}, {"env": None, "pin_version": 3}]
    with pytest.raises(NoResponders):
        await client_generate(client)("m", "r", [1], SAMPLING, [], 0, env="gone")
    assert len(client.calls) == 3  # not retried on top of the client's own retries


async def test_rollout_is_deterministic_given_replies() -> None:
    """Same env, task and replies: identical traces apart from wall-clock timings."""

    async def once() -> Trace:
        env = make_env("alphabet-sort", {})
        gen = FakeGenerate(("Ada", "stop"), ("Bo", "length"), ("Cy", "stop"))
        return await run_rollout(env, task_ref(env, 4), gen, R, SAMPLING, rollout_id="x", seed=3)

    a, b = await once(), await once()
    assert a.messages == b.messages and a.reward == b.reward and a.metrics == b.metrics
    assert np.array_equal(a.branch_tokens(a.branches[0])[0], b.branch_tokens(b.branches[0])[0])


# -- the rollout command's pure parts ------------------------------------------------------


def test_rollout_cli_plans_requests_from_config() -> None:
    """`rlbus rollout` rounds n up to whole groups, takes sampling from the config (eval
    sampling for --split eval), asks for tasks 0.. with fresh ids and stable seeds."""
    from configs import load_config
    from roles.up.rollout import build_requests, plan_requests, summarize

    cfg = load_config("smoke")
    plan = plan_requests(cfg, "reverse-text", "train", 9, 4, "policy")
    assert plan.groups == 3 and plan.key == "reverse-text"
    assert (
        plan.sampling.max_completion_tokens == cfg.orchestrator.train.sampling.max_completion_tokens
    )
    assert plan_requests(cfg, "reverse-text", "eval", 1, 1, "policy").sampling.temperature == 0.0
    custom = plan_requests(cfg, "examples.word_count_env:make_env", "train", 2, 2, "teacher")
    assert custom.key == "examples-word_count_env-make_env" and custom.env_args == {}
    reqs = build_requests("r", 0, plan, size=2)
    again = build_requests("r", 0, plan, size=2)
    assert [r.task.index for r in reqs] == [0, 1, 0]
    assert [r.seed for r in reqs] == [r.seed for r in again] and len({r.seed for r in reqs}) == 3
    assert not {r.event_id for r in reqs} & {
        r.event_id for r in again
    }  # reruns are not deduped away
    assert all(r.group_size == 4 and r.env == "reverse-text" for r in reqs)

    ok = Trace(rollout_id="a", env="e", task=TaskRef(index=0), group_id="g", sample_index=0,
               messages=[], branches=[], reward=1.0)  # fmt: skip
    bad = failed_group(request(group_size=2), "e", "inference_timeout", "t")
    s = summarize([ok, *bad])
    assert s["rollouts"] == 3 and s["reward_mean"] == pytest.approx(1 / 3)
    assert s["errors"] == {"inference_timeout": 2}
    assert s["stopped"] == {"has_error": 2}  # ``ok`` has none: built before it was recorded
