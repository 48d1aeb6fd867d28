"""Find an environment by name: a built-in, or a user env by import path.

    make_env("reverse-text", {"min_len": 3, "max_len": 6})
    make_env("examples.word_count_env:make_env", {})   # module:callable -> Environment
    make_env("vf:my_tasks", {"num_tasks": 100})        # a verifiers taskset (``vf``)

The callable is called with the env's args as keyword arguments (as in verifiers'
``load_environment(**kwargs)``). ``state_columns`` (a run's
``orchestrator.train.env[].state_columns``) are recorded beside the env's own: its own
first, then the new ones. A run's ``schedule`` and ``min_turns`` for the env replace the
harness's own (``turn_problems`` says why they cannot: a schedule naming no member, a
``min_turns`` above ``max_turns``, an env whose own code takes the turns). ``env_key`` is
the env's token on the bus (subject key, durable name): a built-in name is its own key;
an import path has its dots and colon replaced by ``-``.

    make_env("my_envs.interview:make_env", {}, schedule=["asker", "asker", "answerer"])
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from bus.subjects import token_for
from configs.orchestrator import EnvConfig, EvalEnvConfig
from roles.lib.envs.base import Environment, Harness, schedule_problem
from roles.lib.envs.builtin import BUILTINS
from roles.lib.plugins import load_named


class UnknownEnv(ValueError):
    pass


def builtin_names() -> list[str]:
    return sorted(BUILTINS)


def env_key(env_id: str) -> str:
    """The env's subject/consumer token (``bus.subjects.token_for``)."""
    return token_for(env_id)


def _resolve(env_id: str) -> Any:
    factory = load_named(env_id, BUILTINS, "env", "my_pkg.envs:make_env", UnknownEnv)
    if not callable(factory):
        raise UnknownEnv(f"env {env_id!r}: {factory!r} is not callable")
    return factory


def make_env(
    env_id: str,
    args: dict[str, Any] | None = None,
    state_columns: Sequence[str] = (),
    *,
    schedule: Sequence[str] = (),
    min_turns: int | None = None,
    max_turns: int | None = None,
) -> Environment:
    """The Environment called ``env_id`` built with ``args``, recording ``state_columns``
    beside its own (``merged_columns``), its turns ordered by ``schedule`` and never fewer
    than ``min_turns`` (empty / None: the harness's own). ``max_turns`` is the run's turn
    limit for the env (requests carry it; None: the env's own), only checked against
    them. A clear error otherwise (``ValueError`` naming the key, ``turn_problems``)."""
    env = _build(env_id, args)
    if state_columns:
        env.state_columns = merged_columns(env.state_columns, state_columns)
    problems = turn_problems(env, schedule, min_turns, max_turns)
    if problems:
        raise ValueError("; ".join(f"{key}: {why}" for key, why in problems))
    if schedule:
        env.harness.schedule = tuple(schedule)
    if min_turns is not None:
        env.harness.min_turns = min_turns
    return env


def turn_options(entry: EnvConfig | EvalEnvConfig | None) -> dict[str, Any]:
    """``make_env``'s turn keywords from an env's config entry (its ``schedule`` and
    ``min_turns``, and the ``max_turns`` they are checked against); {} when it sets none."""
    if entry is None or not (entry.schedule or entry.min_turns):
        return {}
    return {"schedule": list(entry.schedule), "min_turns": entry.min_turns,
            "max_turns": entry.max_turns}  # fmt: skip


def turn_problems(
    env: Environment,
    schedule: Sequence[str] = (),
    min_turns: int | None = None,
    max_turns: int | None = None,
) -> list[tuple[str, str]]:
    """Why a run's ``schedule`` / ``min_turns`` cannot apply to ``env`` (with the run's
    ``max_turns``, None: the env's own): ``(key, reason)`` pairs, [] when they can."""
    given = [(key, v) for key, v in (("schedule", schedule), ("min_turns", min_turns)) if v]
    if not given:
        return []
    from roles.lib.envs.agent import AgentHarness

    if isinstance(env.harness, AgentHarness):  # verifiers envs too
        own = f"env {env.name!r} runs the conversation in its own code: rlbus takes no turns"
        return [(key, own) for key, _ in given]
    out = []
    if schedule and type(env.harness).speaker is not Harness.speaker:
        out.append(("schedule", f"env {env.name!r} orders its turns itself (its harness "
                                "overrides `speaker`)"))  # fmt: skip
    elif why := schedule_problem(env.name, env.members, schedule):
        out.append(("schedule", why))
    # Against a run's own `max_turns` and `schedule`: configs' rule, at load
    # (`configs.orchestrator._turn_problems`); here only what the env itself allows (its
    # `max_turns` is its own schedule's length when it has one).
    if min_turns is not None and not max_turns and not schedule and min_turns > env.max_turns:
        out.append(("min_turns", f"{min_turns} exceeds env {env.name!r}'s own max_turns, "
                                 f"{env.max_turns} (set `max_turns` too)"))  # fmt: skip
    return out


def merged_columns(own: Sequence[str], extra: Sequence[str]) -> tuple[str, ...]:
    """An env's state columns, then those of ``extra`` it does not have (no duplicates)."""
    return tuple(dict.fromkeys((*own, *extra)))


def _build(env_id: str, args: dict[str, Any] | None) -> Environment:
    if env_id.startswith("vf:"):
        from roles.lib.envs import vf

        return vf.load(env_id.removeprefix("vf:"), dict(args or {}))
    factory = _resolve(env_id)
    args = dict(args or {})
    try:
        inspect.signature(factory).bind(**args)
    except TypeError as e:
        raise ValueError(f"env {env_id!r} does not take args {sorted(args)}: {e}") from None
    except ValueError:  # no signature (a builtin callable): let the call decide
        pass
    env = factory(**args)
    if not isinstance(env, Environment):  # a verifiers env or taskset: through the bridge
        from roles.lib.envs import vf

        env = vf.from_object(env, env_id, args) or env
    if not isinstance(env, Environment):
        raise TypeError(
            f"env {env_id!r}: {factory!r} returned {type(env).__name__}, not Environment"
        )
    return env
