"""Find an environment by name: a built-in, or a user env by import path.

    make_env("reverse-text", {"min_len": 3, "max_len": 6})
    make_env("examples.word_count_env:make_env", {})   # module:callable -> Environment
    make_env("vf:my_tasks", {"num_tasks": 100})        # a verifiers taskset (``vf``)

The callable is called with the env's args as keyword arguments (as in verifiers'
``load_environment(**kwargs)``). ``state_columns`` (a run's
``orchestrator.train.env[].state_columns``) are recorded beside the env's own: its own
first, then the new ones. ``env_key`` is the env's token on the bus (subject key, durable
name): a built-in name is its own key; an import path has its dots and colon replaced by
``-``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from bus.subjects import token_for
from roles.lib.envs.base import Environment
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
    env_id: str, args: dict[str, Any] | None = None, state_columns: Sequence[str] = ()
) -> Environment:
    """The Environment called ``env_id`` built with ``args``, recording ``state_columns``
    beside its own (``merged_columns``); a clear error otherwise."""
    env = _build(env_id, args)
    if state_columns:
        env.state_columns = merged_columns(env.state_columns, state_columns)
    return env


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
