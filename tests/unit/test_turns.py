"""Turn schedules and ``min_turns`` from config (issue 34), and the ``alphabet-sort``
two-turn preset.

Each behaviour is driven the way a run drives it: a loaded config, the env its server
builds (``server_options`` -> ``EnvServer.env_for``), a group rolled out by
``rollout_group`` with the request's ``max_turns`` from the config, over scripted
inference (no broker, no model). Refusals are read from ``load_config`` (config-only
rules) and from ``rlbus up``'s env checks (``roles.up.preflight.env_problems``: rules
that need the env built)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from bus.log import get_logger
from configs import ConfigError, RunConfig, load_config
from replay.rubric import RubricLog, rescore
from roles.env_server.role import EnvServer, rollout_group, server_options
from roles.lib.envs.base import (
    Environment,
    Harness,
    ListTaskset,
    Messages,
    Rubric,
    State,
    assistant_answers,
)
from roles.lib.envs.builtin.alphabet_sort import format_names, names_by_turn
from roles.lib.envs.registry import make_env
from roles.runtime.context import RoleContext
from roles.up.preflight import env_problems, eval_env_problems
from schemas import TaskRef, TaskRequested, Trace
from tests.unit.test_harness import SAMPLING, FakeGenerate, R

# -- test envs (import paths, as a user's envs are named in a config) -----------------------


class Cued(Harness):
    """Two members; after each turn the env names who speaks next (``self.speaker``), and
    counts its answers in the state (what rubric replay must rebuild)."""

    members = ("a", "b")
    max_turns = 8
    state_columns = ("answered",)

    def user_prompt(self, task: dict[str, Any]) -> str:
        return "go"

    def init_state(self, task: dict[str, Any]) -> State:
        return {"answered": 0}

    def env_response(self, messages: Messages, task: dict[str, Any], state: State) -> Any:
        state["answered"] += 1
        following = self.speaker(len(assistant_answers(messages)))
        return [{"role": "user", "content": f"{following}?"}], False


def answered(messages: Messages, task: dict[str, Any], state: State) -> float:
    return float(state["answered"])


def cued_env() -> Environment:
    return Environment("cued", ListTaskset([{"n": 1}], eval_tasks=[{"n": 2}]), Cued(None),
                       Rubric({"answered": answered}))  # fmt: skip


class Quits(Harness):
    """A single agent whose env says done after every turn, with a last word."""

    max_turns = 4

    def user_prompt(self, task: dict[str, Any]) -> str:
        return "hi"

    def env_response(self, messages: Messages, task: dict[str, Any], state: State) -> Any:
        return [{"role": "user", "content": "bye"}], True


def quits_env() -> Environment:
    return Environment("quits", ListTaskset([{"n": 1}], eval_tasks=[{"n": 2}]), Quits(None),
                       Rubric({"turns": lambda m, t, s: float(len(assistant_answers(m)))}))  # fmt: skip


CUED = "tests.unit.test_turns:cued_env"
QUITS = "tests.unit.test_turns:quits_env"


def entry(env_id: str, **keys: Any) -> str:
    """An override setting the run's one train env, `keys` as TOML values."""
    fields = "".join(f", {k}={v}" for k, v in keys.items())
    return f'orchestrator.train.env=[{{id="{env_id}", group_size=1{fields}}}]'


def served(cfg: RunConfig, env_id: str) -> Environment:
    """The env the run's env server builds for ``env_id``."""
    ctx = RoleContext(run="r", url="nats://unused", cfg=cfg, instance="env-test")
    bus = SimpleNamespace(run="r", log=get_logger())  # no broker: only the env it builds
    server = EnvServer(bus, "env-test", env_id, R, None, **server_options(ctx, env_id))  # type: ignore[arg-type]
    return server.env_for(server.default_args)


def request_of(cfg: RunConfig, env_id: str, split: str = "train") -> TaskRequested:
    """A request as the orchestrator dispatches it: the config's `max_turns` on it."""
    spec = cfg.orchestrator.env(env_id)
    assert spec is not None
    return TaskRequested(run="r", event_id=f"req-{split}", env=spec.key,
                         task=TaskRef(index=0, split=split), group_id="g", group_size=1,
                         sampling=SAMPLING, seed=3, max_turns=spec.max_turns)  # fmt: skip


async def rolled(cfg: RunConfig, env_id: str, *replies: str) -> tuple[Trace, TaskRequested]:
    request = request_of(cfg, env_id)
    gen = FakeGenerate(*[(r, "stop") for r in replies])
    (trace,) = await rollout_group(served(cfg, env_id), request, gen, R, env_id)
    assert not trace.errors, trace.errors
    return trace, request


def speakers(trace: Trace) -> list[str | None]:
    return [m.member for m in trace.messages if m.role == "assistant"]


def cues(trace: Trace) -> list[str]:
    """The env's messages after the opening ones (what it said between turns)."""
    return [m.content for m in trace.messages[2:] if m.role == "user"]


# -- schedules ----------------------------------------------------------------------------


async def test_a_schedule_from_config_orders_the_speakers_and_ends_the_rollout() -> None:
    """`schedule = ["a", "a", "b"]`: member a writes two turns, then b one, and the
    rollout ends after the schedule's last turn (the env's own limit is 8, no config
    max_turns), without asking the env again; the env's code sees the schedule too
    (its cues name the scheduled speaker). Unset: round robin up to `max_turns`."""
    cfg = load_config("smoke", [entry(CUED, schedule='["a", "a", "b"]')])
    trace, _ = await rolled(cfg, CUED, "x", "y", "z", "never")
    assert speakers(trace) == ["a", "a", "b"] and trace.num_turns == 3
    assert cues(trace) == ["a?", "b?"]  # asked after turns 1 and 2 only
    assert trace.state == {"answered": 2} and trace.reward == 2.0
    assert trace.stop_condition == "schedule_exhausted"
    assert [len(b.messages) for b in trace.branches] == [len(trace.messages)] * 2  # a and b

    plain = load_config("smoke", [entry(CUED, max_turns=4)])
    trace, _ = await rolled(plain, CUED, "w", "x", "y", "z")
    assert speakers(trace) == ["a", "b", "a", "b"] and cues(trace) == ["b?", "a?", "b?"]
    assert trace.stop_condition == "max_turns_reached"

    cut = load_config("smoke", [entry(CUED, schedule='["b", "a", "a", "b"]', max_turns=2)])
    trace, _ = await rolled(cut, CUED, "x", "y")
    assert speakers(trace) == ["b", "a"]  # the run's max_turns cuts the schedule short


async def test_rubric_replay_rebuilds_a_scheduled_envs_state_as_its_server_did() -> None:
    """Rubric replay builds the env with its config entry's schedule, so the state it
    rebuilds (env answers after turns 1 and 2, not 3) matches the recorded reward."""
    cfg = load_config("smoke", [entry(CUED, schedule='["a", "a", "b"]')])
    trace, request = await rolled(cfg, CUED, "x", "y", "z")
    log = RubricLog(cfg, {request.event_id: request}, [(request.event_id, trace)],
                    {request.event_id: 1})  # fmt: skip
    result = rescore(log)
    assert (result.scored, result.failures, result.diff.ok) == (1, [], True)


def test_a_schedule_is_refused_naming_the_key_when_it_cannot_order_the_env() -> None:
    """A member the env does not have, a single-agent env, an env that orders its own
    turns (debate overrides `speaker`): refused before any role starts, naming
    `orchestrator.train.env.<i>.schedule`; an empty name already at load."""
    bad = load_config("smoke", [entry(CUED, schedule='["a", "c"]')])
    (why,) = env_problems(bad)
    assert why.startswith("`orchestrator.train.env.0.schedule`: ['c'] in the schedule")
    assert "members: ['a', 'b']" in why
    (why,) = env_problems(load_config("smoke", [entry("reverse-text", schedule='["a"]')]))
    assert "`orchestrator.train.env.0.schedule`" in why and "declares no members" in why
    (why,) = env_problems(load_config("smoke", [entry("debate", schedule='["judge"]')]))
    assert "`orchestrator.train.env.0.schedule`" in why and "overrides `speaker`" in why
    with pytest.raises(ValueError, match=r"schedule: \['c'\] in the schedule of 'cued'"):
        make_env(CUED, {}, schedule=["a", "c"])  # the env server's own build refuses too
    with pytest.raises(ConfigError, match=r"orchestrator\.train\.env\.0\.schedule` holds an empty"):
        load_config("smoke", [entry(CUED, schedule='["a", ""]')])


def test_a_harness_declares_its_own_schedule_and_it_is_its_turn_plan() -> None:
    """An env may declare `schedule` on its harness: `speaker` follows it, its length is
    the env's turn limit, and a name that is no member fails the env's construction."""

    class Interview(Cued):
        schedule = ("a", "a", "b")

    env = Environment("iv", ListTaskset([{"n": 1}]), Interview(None), Rubric({"x": answered}))
    assert [env.speaker(t) for t in range(4)] == ["a", "a", "b", None]
    assert env.max_turns == 3 and env.turn_limit() == 3 and env.turn_limit(2) == 2
    assert env.turn_limit(9) == 3

    class Bad(Cued):
        schedule = ("a", "z")

    with pytest.raises(ValueError, match=r"\['z'\] in the schedule of 'bad' are not members"):
        Environment("bad", ListTaskset([{"n": 1}]), Bad(None), Rubric({"x": answered}))


def test_an_env_with_members_it_cannot_run_is_refused_when_built() -> None:
    """Env code as a user writes it: empty or twice-listed members, a judge or a rubric's
    member reward naming no member, each refused in one line naming the env and them."""

    def build(members: tuple[str, ...], judges: tuple[str, ...] = (), rewarded: str = "a") -> None:
        class Team(Cued):
            pass

        Team.members, Team.judges = members, judges
        rubric = Rubric({"x": answered}, member_funcs={rewarded: answered})
        Environment("team", ListTaskset([{"n": 1}]), Team(None), rubric)

    build(("a", "b"), judges=("b",))  # a well-formed one
    for members, judges, rewarded, says in [
        (("a", ""), (), "a", r"env 'team': a member has an empty name \(members: \['a', ''\]\)"),
        (("a", "b", "a"), (), "a", r"members \['a'\] are listed twice"),
        (("a", "b"), ("j",), "a", r"judges \['j'\] are not members"),
        (("a", "b"), (), "c", r"its rubric rewards \['c'\], which are not members"),
    ]:
        with pytest.raises(ValueError, match=says):
            build(members, judges, rewarded)


# -- min_turns ----------------------------------------------------------------------------


async def test_min_turns_from_config_overrides_an_early_done() -> None:
    """The env says done after every turn. `min_turns = 2`: its done after turn 1 is
    overridden: its message is rendered into the second prompt (the model reads it) and a
    second turn is generated; after turn 2 its done ends the rollout (a closing remark,
    no tokens). Without `min_turns` the rollout ends after turn 1."""
    cfg = load_config("smoke", [entry(QUITS, min_turns=2)])
    trace, _ = await rolled(cfg, QUITS, "one", "two", "never")
    assert trace.num_turns == 2 and assistant_answers_of(trace) == ["one", "two"]
    feedback, closing = [m for m in trace.messages if m.content == "bye"]
    assert len(feedback.token_ids) > 0 and len(closing.token_ids) == 0
    assert trace.reward == 2.0 and trace.stop_condition == "schedule_exhausted"

    plain = load_config("smoke", [entry(QUITS)])
    trace, _ = await rolled(plain, QUITS, "one", "never")
    assert trace.num_turns == 1 and assistant_answers_of(trace) == ["one"]

    capped = load_config("smoke", [entry(QUITS, min_turns=3, max_turns=3)])
    trace, _ = await rolled(capped, QUITS, "a", "b", "c")
    assert trace.num_turns == 3 and trace.stop_condition == "max_turns_reached"


def assistant_answers_of(trace: Trace) -> list[str]:
    return [m.content for m in trace.messages if m.role == "assistant"]


def test_min_turns_above_max_turns_is_refused_naming_the_keys() -> None:
    """At load: `min_turns` > `max_turns` of one entry, or > the turns of its schedule, or
    a train env's `min_turns` above the `max_turns` its eval entry gives, or turn keys on
    a train env's eval entry; before start: above the env's own max_turns (reverse-text:
    1) when the config sets none."""
    with pytest.raises(ConfigError) as e:
        load_config("smoke", [entry(QUITS, min_turns=3, max_turns=2)])
    assert "`orchestrator.train.env.0.min_turns` = 3 exceeds `orchestrator.train.env.0.max_turns` = 2" in str(e.value)  # fmt: skip
    with pytest.raises(ConfigError, match=r"min_turns` = 3 exceeds the 2 turns of `orchestrator\.train\.env\.0\.schedule`"):  # fmt: skip
        load_config("smoke", [entry(CUED, min_turns=3, schedule='["a", "b"]')])
    evals = 'orchestrator.eval.env=[{id="tests.unit.test_turns:quits_env", max_turns=1}]'
    with pytest.raises(ConfigError, match=r"`orchestrator\.train\.env\.0\.min_turns` = 2 exceeds `orchestrator\.eval\.env\.0\.max_turns` = 1"):  # fmt: skip
        load_config("smoke", [entry(QUITS, min_turns=2), evals])
    evals = 'orchestrator.eval.env=[{id="tests.unit.test_turns:quits_env", min_turns=2}]'
    with pytest.raises(ConfigError, match=r"`orchestrator\.eval\.env\.0\.min_turns`: .* is a train env"):  # fmt: skip
        load_config("smoke", [entry(QUITS), evals])
    (why,) = env_problems(load_config("smoke", [entry("reverse-text", min_turns=2)]))
    assert why.startswith("`orchestrator.train.env.0.min_turns`: 2 exceeds env 'reverse-text'")


def test_an_eval_only_env_takes_its_own_turn_settings() -> None:
    """An eval-only env's entry sets `schedule` / `min_turns` for its own servers, and
    they are checked against the env like a train entry's."""
    evals = f'orchestrator.eval.env=[{{id="reverse-text"}}, {{id="{CUED}", schedule=["b", "a"]}}]'
    cfg = load_config("smoke", [evals])
    assert served(cfg, CUED).schedule == ("b", "a")
    bad = load_config("smoke", [f'orchestrator.eval.env=[{{id="{CUED}", schedule=["x"]}}]'])
    (why,) = eval_env_problems(bad)
    assert why.startswith("`orchestrator.eval.env.0.schedule`: ['x']")


def test_agent_envs_take_no_turn_settings() -> None:
    """An env whose own code drives the conversation (an `AgentHarness`) is refused a
    schedule or min_turns: rlbus does not take its turns."""
    (why,) = env_problems(load_config("smoke", [entry("examples.agent_env:make_env", min_turns=2)]))
    assert why.startswith("`orchestrator.train.env.0.min_turns`: env ") and "in its own code" in why


# -- alphabet-sort: verifiers' taskset keys and the two-turn preset --------------------------


def test_alphabet_sort_draws_each_tasks_turns_between_min_and_max() -> None:
    """`args = {min_turns, max_turns}` (verifiers' alphabet-sort taskset keys): each task
    has between min_turns and max_turns turns; equal bounds (or no min_turns) give the same
    tasks as before the key existed."""
    spread = make_env("alphabet-sort", {"min_turns": 1, "max_turns": 3})
    turns = {1 + len(spread.task("train", i)["additions"]) for i in range(64)}
    assert turns == {1, 2, 3}
    fixed = make_env("alphabet-sort", {"min_turns": 3, "max_turns": 3})
    default = make_env("alphabet-sort", {})
    assert [fixed.task("eval", i) for i in range(8)] == [default.task("eval", i) for i in range(8)]
    with pytest.raises(ValueError, match="min_turns <= max_turns"):
        make_env("alphabet-sort", {"min_turns": 3, "max_turns": 2})


async def test_the_alphabet_sort_preset_is_a_two_turn_env() -> None:
    """`-c alphabet-sort` loads and resolves: min_turns = max_turns = 2 on the env entry
    and in its args; the env its server builds passes `rlbus up`'s env checks, has two
    turns in every task, and a perfect answerer scores 1 in exactly two turns."""
    cfg = load_config("alphabet-sort")
    (spec,) = cfg.orchestrator.train.env
    assert (spec.id, spec.min_turns, spec.max_turns) == ("alphabet-sort", 2, 2)
    assert spec.args["min_turns"] == spec.args["max_turns"] == 2
    assert cfg.model.tiny.arch == "qwen3" and cfg.orchestrator.warmup.actor == "teacher"
    assert env_problems(cfg) == []
    env = served(cfg, "alphabet-sort")
    assert env.min_turns == 2
    assert all(len(env.task("train", i)["additions"]) == 1 for i in range(32))
    task = env.task("train", 0)
    sorted_lists = [format_names(names) for names in names_by_turn(task)]
    trace, _ = await rolled(cfg, "alphabet-sort", *sorted_lists)
    assert trace.num_turns == 2 and trace.reward == 1.0
    assert trace.metrics == {"turn_1_correct": 1.0, "turn_2_correct": 1.0}
