"""Group rubrics (issue 34): a rubric function that scores a group's finished rollouts
together, run by the env server before the traces are published, re-scored exactly by
rubric replay; and a run's per-env ``state_columns`` merged with the env's own.

No server: ``rollout_group`` over scripted inference, ``rescore`` over hand-built logs,
``server_options`` over loaded configs."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from bus.errors import RequestTimeout
from bus.log import get_logger
from configs import ConfigError, load_config
from replay.rubric import RubricLog, rescore
from roles.env_server.role import EnvServer, rollout_group, rollout_id, server_options
from roles.lib.envs.base import (
    EnvCodeError,
    Environment,
    Harness,
    ListTaskset,
    Rubric,
    Score,
    last_answer,
)
from roles.lib.envs.builtin.reverse_text import rank_reward
from roles.lib.envs.group import members, score_group
from roles.lib.envs.harness import run_rollout
from roles.lib.envs.registry import make_env, merged_columns
from roles.runtime.context import RoleContext
from schemas import TaskRef, TaskRequested, Trace, TraceError, derive_id
from tests.unit.test_harness import SAMPLING, FakeGenerate, R

RANKED = 'orchestrator.train.env=[{id="reverse-text", group_size=4, args={rank_weight=1.0}}]'


def length(messages: Any, task: Any, state: Any) -> float:
    return float(len(last_answer(messages)))


# -- the combination rule (Rubric.score_group) ---------------------------------------------


def test_group_values_join_rewards_or_metrics_and_the_reward_is_the_weighted_mean() -> None:
    """Weight > 0: the group function's value is a named reward and the reward is the
    weighted mean over both kinds; weight 0: a metric, out of the reward."""
    rubric = Rubric(
        {"len": length},
        weights={"len": 1.0, "best": 3.0, "spread": 0.0},
        group_funcs={
            "best": lambda ms, task, states: [float(len(last_answer(m)) == 3) for m in ms],
            "spread": lambda ms, task, states: [1.5] * len(ms),
        },
    )
    chats = [[{"role": "assistant", "content": c}] for c in ("abc", "a")]
    alone = [rubric.score(c, {}, {}) for c in chats]
    assert [s.reward for s in alone] == [3.0, 1.0]  # per rollout: its own functions only
    grouped = rubric.score_group(chats, {}, [{}, {}], alone)
    assert [s.rewards for s in grouped] == [{"len": 3.0, "best": 1.0}, {"len": 1.0, "best": 0.0}]
    assert list(grouped[0].rewards) == ["len", "best"]  # per-rollout first, then the group's
    assert [s.metrics for s in grouped] == [{"spread": 1.5}, {"spread": 1.5}]
    assert [s.reward for s in grouped] == [(3.0 + 3 * 1.0) / 4, (1.0 + 0.0) / 4]


def test_a_rubric_of_group_functions_only_and_its_refusals() -> None:
    """A rubric may hold group functions only (reward 0 until grouped); a name used by
    both kinds, or a weight for no function, is refused."""
    only = Rubric({}, group_funcs={"g": lambda ms, t, ss: [0.25] * len(ms)})
    alone = only.score([{"role": "assistant", "content": "x"}], {}, {})
    assert alone.reward == 0.0 and alone.rewards == {}
    assert only.score_group([[]], {}, [{}], [alone])[0].reward == 0.25
    with pytest.raises(ValueError, match="both a reward and a group function"):
        Rubric({"g": length}, group_funcs={"g": lambda ms, t, ss: [0.0] * len(ms)})
    with pytest.raises(ValueError, match="unknown reward functions"):
        Rubric({"len": length}, weights={"nope": 1.0})
    with pytest.raises(ValueError, match="weight > 0"):
        Rubric({}, weights={"g": 0.0}, group_funcs={"g": lambda ms, t, ss: [0.0] * len(ms)})


@pytest.mark.parametrize(
    ("result", "error", "match"),
    [
        ([1.0], ValueError, "returned 1 values for 2 rollouts"),
        (0.5, TypeError, "not a list of numbers"),
        (["a", "b"], TypeError, "not a list of numbers"),
    ],
)
def test_a_group_function_must_return_one_number_per_rollout(
    result: Any, error: type[Exception], match: str
) -> None:
    rubric = Rubric({"len": length}, group_funcs={"g": lambda ms, t, ss: result})
    scores = [Score(0.0, {"len": 0.0}, {})] * 2
    with pytest.raises(error, match=match):
        rubric.score_group([[], []], {}, [{}, {}], scores)


def test_an_async_group_function_runs_in_replay_and_is_awaited_live() -> None:
    """As per-rollout functions: ``score_group`` runs an async group function to completion
    where no loop runs (replay), ``ascore_group`` awaits it; inside a loop the sync call
    refuses, naming ``ascore_group``."""

    async def judge(ms: Any, task: Any, states: Any) -> list[float]:
        await asyncio.sleep(0)
        return [float(i) for i in range(len(ms))]

    rubric = Rubric({"len": length}, weights={"j": 1.0}, group_funcs={"j": judge})
    scores = [Score(2.0, {"len": 2.0}, {})] * 2
    assert [s.reward for s in rubric.score_group([[], []], {}, [{}, {}], scores)] == [1.0, 1.5]
    assert [s.reward for s in asyncio.run(rubric.ascore_group([[], []], {}, [{}, {}], scores))] == [1.0, 1.5]  # fmt: skip

    async def inside() -> None:
        rubric.score_group([[], []], {}, [{}, {}], scores)

    with pytest.raises(RuntimeError, match="await Rubric.ascore_group"):
        asyncio.run(inside())


def test_rank_reward_counts_wins_and_half_ties() -> None:
    """reverse-text's group function: each rollout's share of the others it beats on lcs,
    a tie half; a lone rollout gets 0.5; the shares of a group sum to n / 2."""
    task = {"text": "abcd"}  # target "dcba"
    chats = [[{"role": "assistant", "content": a}] for a in ("dcba", "xxxx", "dcbx", "dcba")]
    ranks = rank_reward(chats, task, [{}] * 4)
    assert ranks == [2.5 / 3, 0.0, 1 / 3, 2.5 / 3]
    assert sum(ranks) == 2.0
    assert rank_reward(chats[:1], task, [{}]) == [0.5]


# -- the env server: rollout_group -------------------------------------------------------


class ScriptedByRollout:
    """Inference answering each rollout by its sample index (from the request id), after a
    delay, so rollouts finish in an order unlike their sample order; a reply that is an
    exception is raised (an errored rollout)."""

    def __init__(self, request: TaskRequested, replies: dict[int, Any], delays: dict[int, float]):
        self.by_request = {
            derive_id(rollout_id(request, i), "turn", 0): i for i in range(request.group_size)
        }
        self.replies, self.delays = replies, delays
        self.finished: list[int] = []
        self.fake = FakeGenerate()

    async def __call__(self, model: str, request_id: str, *args: Any, **kw: Any) -> Any:
        i = self.by_request[request_id]
        await asyncio.sleep(self.delays.get(i, 0.0))
        self.finished.append(i)
        self.fake.replies = [self.replies[i]]
        return await self.fake(model, request_id, *args, **kw)


def group_request(group_size: int = 4, split: str = "train", **args: Any) -> TaskRequested:
    return TaskRequested(run="r", event_id=f"req-{split}", env="reverse-text",
                         task=TaskRef(index=3, split=split), group_id="g1",
                         group_size=group_size, sampling=SAMPLING, seed=7, step=2,
                         args=args or None)  # fmt: skip


def ranked_env_from_config() -> tuple[Environment, dict[str, Any]]:
    """The env an env server builds for the ranked reverse-text entry of a loaded config."""
    cfg = load_config("smoke", [RANKED])
    ctx = RoleContext(run="r", url="nats://unused", cfg=cfg, instance="env-test")
    options = server_options(ctx, "reverse-text")
    bus = SimpleNamespace(run="r", log=get_logger())  # no broker: only the env it builds
    server = EnvServer(bus, "env-test", "reverse-text", R, None, **options)  # type: ignore[arg-type]
    return server.env_for(server.default_args), options["default_args"]


async def test_a_group_is_scored_together_in_sample_order_before_it_is_published() -> None:
    """From config (`args = {rank_weight = 1.0}`): the env server's env has a group rubric;
    rollout_group returns traces whose reward already holds it. The group function sees
    the finished rollouts in sample order though they finished in reverse; an errored
    rollout is left out of its lists and keeps reward 0 and no named rewards."""
    env, args = ranked_env_from_config()
    assert args == {"rank_weight": 1.0} and env.group_scored
    request = group_request(**args)
    target = env.task("train", 3)["text"][::-1]
    replies = {0: (target, "stop"), 1: RequestTimeout("slow"), 2: ("zz", "stop"),
               3: (target[:-1], "stop")}  # fmt: skip
    gen = ScriptedByRollout(request, replies, delays={0: 0.03, 2: 0.02, 3: 0.01})
    seen: list[list[str]] = []

    def spy(ms: Any, task: Any, states: Any) -> list[float]:
        seen.append([last_answer(m) for m in ms])
        return rank_reward(ms, task, states)

    env.rubric.group_funcs = {"rank": spy}  # the same env, its group function watched
    traces = await rollout_group(env, request, gen, R)
    assert gen.finished == [1, 3, 2, 0]  # finish order, unlike sample order
    assert seen == [[target, "zz", target[:-1]]]  # rollouts 0, 2, 3: sample order, no 1
    assert [t.sample_index for t in traces] == [0, 1, 2, 3]
    errored = traces[1]
    assert errored.errors and errored.reward == 0.0 and errored.rewards == {}
    ok = [traces[0], traces[2], traces[3]]
    assert [t.rewards["rank"] for t in ok] == [1.0, 0.0, 0.5]
    for t in ok:
        assert list(t.rewards) == ["lcs", "rank"] and t.metrics.keys() == {"exact"}
        assert t.reward == (t.rewards["lcs"] + t.rewards["rank"]) / 2


async def test_groups_without_a_group_rubric_or_a_finished_rollout_are_left_alone() -> None:
    """An env without group functions records its per-rollout rewards unchanged; a group
    whose rollouts all errored never calls the group function."""
    plain = make_env("reverse-text", {})
    request = group_request(group_size=2)
    traces = await rollout_group(plain, request, FakeGenerate(("abc", "stop"), ("cba", "stop")), R)
    assert all(list(t.rewards) == ["lcs"] for t in traces)

    calls: list[int] = []
    ranked = make_env("reverse-text", {"rank_weight": 1.0})
    ranked.rubric.group_funcs = {"rank": lambda ms, t, ss: calls.append(len(ms)) or [0.0] * len(ms)}  # fmt: skip
    errored = await rollout_group(ranked, request, FakeGenerate(RequestTimeout("a"), RequestTimeout("b")), R)  # fmt: skip
    assert calls == [] and all(t.errors and t.reward == 0.0 for t in errored)


async def test_a_group_function_that_fails_is_an_env_bug() -> None:
    """A group function that raises, or returns a wrong count or a non-finite value, is a
    bug in env code: EnvCodeError out of rollout_group (the task is dead-lettered)."""
    request = group_request(group_size=2)
    bad = {
        "raises": (lambda ms, t, ss: 1 / 0, "ZeroDivisionError"),
        "short": (lambda ms, t, ss: [1.0], "returned 1 values for 2 rollouts"),
        "nan": (lambda ms, t, ss: [float("nan")] * len(ms), "not a finite number"),
    }
    for fn, match in bad.values():
        env = make_env("reverse-text", {"rank_weight": 1.0})
        env.rubric.group_funcs = {"rank": fn}
        gen = FakeGenerate(("abc", "stop"), ("cba", "stop"))
        with pytest.raises(EnvCodeError, match=match):
            await rollout_group(env, request, gen, R)


async def test_score_group_needs_what_each_finished_rollout_scored() -> None:
    """A finished trace whose rubric input never reached score_group (a rollout scored
    outside the harness) cannot be grouped: EnvCodeError, not a silent partial group."""
    env = make_env("reverse-text", {"rank_weight": 1.0})
    trace = await run_rollout(env, TaskRef(index=0, data=env.task("train", 0)),
                              FakeGenerate(("abc", "stop")), R, SAMPLING, rollout_id="x")  # fmt: skip
    with pytest.raises(EnvCodeError, match="drop the group functions"):
        await score_group(env, env.task("train", 0), [trace], {}, "reverse-text")


def test_members_are_the_finished_rollouts_by_sample_index() -> None:
    def trace(i: int, errored: bool = False) -> Trace:
        errors = [TraceError(kind="inference_timeout", message="")] if errored else []
        return Trace(rollout_id=f"r{i}", env="e", task=TaskRef(index=0), group_id="g",
                     sample_index=i, messages=[], branches=[], errors=errors)  # fmt: skip

    assert [t.sample_index for t in members([trace(3), trace(0, True), trace(1), trace(2)])] == [1, 2, 3]  # fmt: skip


# -- rubric replay -----------------------------------------------------------------------


async def recorded_group(split: str = "train") -> tuple[TaskRequested, list[Trace]]:
    env = make_env("reverse-text", {"rank_weight": 1.0})
    request = group_request(split=split, rank_weight=1.0)
    target = env.task(split, 3)["text"][::-1]
    replies = {0: (target, "stop"), 1: ("q", "stop"), 2: RequestTimeout("t"),
               3: (target[1:], "stop")}  # fmt: skip
    gen = ScriptedByRollout(request, replies, delays={0: 0.02, 1: 0.01})
    return request, await rollout_group(env, request, gen, R)


def replay_log(request: TaskRequested, traces: list[Trace], size: int | None = None) -> RubricLog:
    cfg = load_config("smoke", [RANKED])
    return RubricLog(cfg, {request.event_id: request}, [(request.event_id, t) for t in traces],
                     {request.event_id: size or request.group_size})  # fmt: skip


async def test_rubric_replay_rescores_groups_exactly_in_any_log_order() -> None:
    """Traces of a group recorded in any order (they are published as rollouts finish)
    re-score to the recorded rewards bit for bit, the group's rank included; the errored
    rollout is skipped; a changed recorded rank is found."""
    for split in ("train", "eval"):
        request, traces = await recorded_group(split)
        result = rescore(replay_log(request, traces[::-1]))
        assert (result.scored, result.errored, result.groups) == (3, 1, 1)
        assert result.failures == [] and result.diff.ok and result.diff.compared == 9

    changed = list(traces)
    changed[3] = msgspec.structs.replace(traces[3], rewards={**traces[3].rewards, "rank": 0.25})
    result = rescore(replay_log(request, changed))
    assert result.changed_traces == [traces[3].rollout_id]
    assert [k for k, _, _ in result.diff.changed] == [f"{traces[3].rollout_id}/rank"]


async def test_rubric_replay_without_a_group_rubric_fails_only_the_trace_that_raises() -> None:
    """An env without group functions is re-scored trace by trace as before: a trace whose
    rubric raises is a failure of its own, its group's other traces still compared. With a
    group rubric the same trace takes its whole group with it (it cannot be scored
    together without it)."""
    plain = make_env("reverse-text", {})
    request = group_request(group_size=3)
    traces = await rollout_group(plain, request, FakeGenerate(*[("abc", "stop")] * 3), R)
    broken = msgspec.structs.replace(traces[1].task, data={"wrong": 1})  # lcs reads task["text"]
    traces[1] = msgspec.structs.replace(traces[1], task=broken)
    log = RubricLog(load_config("smoke"), {request.event_id: request},
                    [(request.event_id, t) for t in traces], {request.event_id: 3})  # fmt: skip
    result = rescore(log)
    assert (result.scored, result.groups, result.diff.ok) == (2, 0, True)
    assert result.failures == [f"{traces[1].rollout_id}: KeyError: 'text'"]

    request, ranked = await recorded_group()
    ranked[0] = msgspec.structs.replace(ranked[0], task=broken)
    result = rescore(replay_log(request, ranked))
    assert result.scored == 0 and len(result.failures) == 3
    assert all("its group could not be scored: KeyError" in f for f in result.failures)


async def test_rubric_replay_reports_a_group_the_log_holds_part_of() -> None:
    """A group must be whole to be scored together: with a rollout missing from the log,
    every trace of it is a failure naming why, never a guess."""
    request, traces = await recorded_group()
    result = rescore(replay_log(request, [traces[0], traces[1], traces[2]]))
    assert result.scored == 0 and len(result.failures) == 2
    assert all("the log holds 3 of its group's 4 rollouts" in f for f in result.failures)


# -- state_columns from config -----------------------------------------------------------


class Counting(Harness):
    """Two turns; its state counts them; it declares one state column of its own."""

    max_turns = 2
    state_columns = ("turns",)

    def user_prompt(self, task: dict[str, Any]) -> str:
        return "go"

    def init_state(self, task: dict[str, Any]) -> dict[str, Any]:
        return {"turns": 0, "seen": ["go"]}

    def env_response(self, messages: Any, task: Any, state: Any) -> tuple[list[Any], bool]:
        state["turns"] += 1
        return [{"role": "user", "content": "again"}], False


def counting_env() -> Environment:
    tasks = ListTaskset([{"n": 1}], eval_tasks=[{"n": 2}])
    return Environment("counting", tasks, Counting(None), Rubric({"len": length}))


COUNTING = "tests.unit.test_group_rubric:counting_env"


async def test_state_columns_from_config_are_merged_after_the_envs_own() -> None:
    """`state_columns` on an env's config entry reach the env its server builds: the env's
    own first, then the config's new ones, no duplicates; a key the state lacks is null."""
    entry = f'orchestrator.train.env=[{{id="{COUNTING}", state_columns=["seen", "turns", "absent", "seen"]}}]'  # fmt: skip
    cfg = load_config("smoke", [entry])
    ctx = RoleContext(run="r", url="nats://unused", cfg=cfg, instance="env-test")
    options = server_options(ctx, COUNTING)
    bus = SimpleNamespace(run="r", log=get_logger())
    server = EnvServer(bus, "env-test", COUNTING, R, None, **options)  # type: ignore[arg-type]
    env = server.env_for({})
    assert env.state_columns == ("turns", "seen", "absent")
    trace = await run_rollout(env, TaskRef(index=0, data={"n": 1}),
                              FakeGenerate(("a", "stop"), ("b", "stop")), R, SAMPLING,
                              rollout_id="x")  # fmt: skip
    assert list(trace.state.items()) == [("turns", 1), ("seen", ["go"]), ("absent", None)]
    assert make_env(COUNTING, {}).state_columns == ("turns",)  # no config: the env's own
    assert merged_columns(("a", "b"), ("b", "c", "a", "d")) == ("a", "b", "c", "d")


def test_eval_only_envs_take_state_columns_and_train_envs_refuse_them_on_eval() -> None:
    """An eval-only env's entry adds state columns for its own servers; on a train env's
    eval entry they are refused (its train pool serves its evals, with the train entry's)."""
    evals = f'orchestrator.eval.env=[{{id="reverse-text"}}, {{id="{COUNTING}", state_columns=["seen"]}}]'  # fmt: skip
    ctx = RoleContext(run="r", url="nats://unused", cfg=load_config("smoke", [evals]),
                      instance="env-test")  # fmt: skip
    assert server_options(ctx, COUNTING)["state_columns"] == ["seen"]
    assert server_options(ctx, "reverse-text")["state_columns"] == []
    with pytest.raises(ConfigError, match=r"orchestrator\.eval\.env\.0\.state_columns"):
        load_config("smoke", ['orchestrator.eval.env=[{id="reverse-text", state_columns=["x"]}]'])
