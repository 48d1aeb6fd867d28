"""Start-time checks of which algorithm runs on which env (``rlbus up`` and ``attach``).

    problems = routing_problems(cfg)      # [] or one message per problem, naming the key

Each algorithm is built with its options (a typo fails here, not mid-run), then checked
against every env it scores: ``rae`` needs an env whose traces name members, ``opd``
needs its reference model declared in ``orchestrator.models``, ``opsd`` needs an env
that can give a demonstration. Envs are built with their args (cheap, no model).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from configs import ConfigError, RunConfig
from configs.orchestrator import POLICY, EnvConfig
from roles.algorithm.base import Algorithm
from roles.algorithm.registry import create


def _env_problems(
    where: str, algorithm: Algorithm, envs: Sequence[tuple[int, EnvConfig]]
) -> list[str]:
    from roles.lib.envs.registry import make_env

    out = []
    for i, spec in envs:
        env_where = f"`orchestrator.train.env.{i}` ({spec.id!r})"
        try:
            env = make_env(spec.id, dict(spec.args))
        except Exception as e:  # noqa: BLE001 - an env that cannot be built is a problem to report
            out.append(f"{env_where} cannot be built: {type(e).__name__}: {e}")
            continue
        if env.members and not algorithm.handles_members:
            out.append(
                f"{where} ({algorithm.name}) does not handle members, but {env_where} is a "
                f"multi-agent env ({list(env.members)}): one baseline over the whole trace "
                "would mix the members' rewards; use rae or a built-in with per-member "
                "baselines (grpo, rloo, max_rl, echo), or set `handles_members = True` on "
                "an algorithm whose targets are per branch"
            )
        if algorithm.needs_members and not env.members:
            out.append(
                f"{where} ({algorithm.name}) needs multi-agent traces, but {env_where} "
                "declares no members"
            )
        if algorithm.needs_demonstration and not env.demonstration(env.task("train", 0)):
            out.append(
                f"{where} ({algorithm.name}) needs a demonstration to hint with, but "
                f"{env_where} gives none (implement Harness.demonstration)"
            )
    return out


def algorithm_problems(
    cfg: RunConfig, where: str, name: str, options: dict[str, Any], env_ids: Sequence[str]
) -> list[str]:
    """Problems of running algorithm ``name`` with ``options`` on the envs ``env_ids``
    (config ids or env keys; empty = every env)."""
    try:
        algorithm = create(name, options)
    except ValueError as e:
        return [f"{where}: {e}"]
    problems = []
    models = cfg.orchestrator.models
    for key in algorithm.models():
        if key in models and models[key].kind == "teacher":
            problems.append(
                f"{where} ({algorithm.name}) scores with model {key!r}, which is served by the "
                f'scripted teacher (kind = "teacher") and cannot score; use kind = "reference"'
            )
        if key != POLICY and key not in models:
            problems.append(
                f"{where} ({algorithm.name}) scores with model {key!r}, which is not a key of "
                f"`orchestrator.models` (declared: {sorted(models) or 'none'}); declare "
                f'`[orchestrator.models.{key}]` with kind = "reference"'
            )
    envs = [
        (i, e)
        for i, e in enumerate(cfg.orchestrator.train.env)
        if not env_ids or e.id in env_ids or e.key in env_ids
    ]
    return problems + _env_problems(where, algorithm, envs)


def seat_problems(cfg: RunConfig) -> list[str]:
    """Each train env's member bindings and learner seat against the env's members, and
    ``orchestrator.eval.learner_seat`` against every env it evaluates."""
    from roles.lib.envs.registry import make_env
    from roles.lib.envs.seats import ROTATE, seating_of, seating_problems

    o, out = cfg.orchestrator, []
    pin = o.eval.learner_seat
    evaluated = {t.id for t in o.eval_targets()}
    for i, spec in enumerate(o.train.env):
        seating = seating_of(spec)
        pinned = pin is not None and spec.id in evaluated
        if seating is None and not pinned:
            continue
        try:
            env = make_env(spec.id, dict(spec.args))
        except Exception:  # noqa: BLE001 - reported by the algorithm checks
            continue
        if seating is not None:
            out += seating_problems(f"orchestrator.train.env.{i}", env, seating)
        if not pinned:
            continue
        if not env.members:
            out.append(
                f"`orchestrator.eval.learner_seat` = {pin!r} is set, but evaluated env "
                f"{spec.id!r} declares no members (list only multi-agent envs in "
                "`orchestrator.eval.env`, or remove the key)"
            )
        elif pin != ROTATE and (pin not in env.seats or pin in spec.members):
            out.append(
                f"`orchestrator.eval.learner_seat` = {pin!r} must be {ROTATE!r} or a seat of "
                f"{spec.id!r} the learner can play: "
                f"{[m for m in env.seats if m not in spec.members]}"
            )
    return out


def routing_problems(cfg: RunConfig) -> list[str]:
    """Every algorithm of the config checked against the envs it scores, and every
    env's seating against its members."""
    o = cfg.orchestrator
    problems = seat_problems(cfg)
    shadows = {a.id for a in o.algorithms if a.shadow}
    for i, env in enumerate(o.train.env):
        if env.algorithms and set(env.algorithms) <= shadows:
            problems.append(
                f"`orchestrator.train.env.{i}.algorithms` names only shadow algorithms "
                f"{env.algorithms}: nothing would train on {env.id!r}"
            )
    for i, a in enumerate(o.algorithms):
        routed = [] if a.shadow else [e.id for e in o.train.env if a.id in (e.algorithms or [a.id])]
        if not a.shadow and not routed:
            continue  # declared but no env trains on it: nothing runs it on an env
        where = f"`orchestrator.algorithms.{i}`"
        problems += algorithm_problems(cfg, where, a.name or a.id, dict(a.options), routed)
    if o.warmup.steps > 0:
        for name in o.warmup.algorithms:
            if name in {a.id for a in o.algorithms}:
                continue  # checked above
            problems += algorithm_problems(cfg, "`orchestrator.warmup.algorithms`", name, {}, [])
    return problems


def check_routing(cfg: RunConfig) -> None:
    """Raise ``ConfigError`` listing every routing problem."""
    problems = routing_problems(cfg)
    if len(problems) == 1:
        raise ConfigError(f"invalid algorithm routing: {problems[0]}")
    if problems:
        raise ConfigError("invalid algorithm routing:\n  - " + "\n  - ".join(problems))
