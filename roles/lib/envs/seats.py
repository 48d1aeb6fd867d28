"""Casting a multi-agent rollout: which model plays each member, and whose turns train.

    c = cast(env, request.seating, actor="policy", seed=request.seed, sample_index=i)
    c.models     # {"debater_a": "policy", "debater_b": "opponent", "judge": "teacher"}
    c.learner    # "debater_a": the learner's seat this rollout (recorded as Trace.seat)
    c.trains     # ("debater_a",): the members whose branches become samples

The rules (``docs/algorithms.md``, "Members"):

- a member listed in ``seating.bindings`` is played by that model key, always;
- with no learner rule every other member is played by the actor (the request's model:
  the policy, or the warm start's teacher) and every such member trains, judges aside;
- with a learner rule (a member, or ``"rotate"``) the learner's seat is played by the
  actor and is the only one that trains; the other seats are played by
  ``seating.opponent`` (default: the actor, i.e. self-play where one side learns);
- ``"rotate"`` gives rollout ``i`` of a group seat ``(stable_seed(seed, "seat") + i) mod
  len(seats)``: deterministic from the group's seed, balanced within the group, and
  different groups start on different seats;
- judges train only with ``seating.train_judges`` (``drop_judge = false``), and only
  when played by the actor (beside the learner's seat, if there is a rule); a member
  played by another model never trains.
"""

from __future__ import annotations

from dataclasses import dataclass

from configs.orchestrator import EnvConfig
from roles.lib.envs.base import Environment
from schemas import Seating, stable_seed

ROTATE = "rotate"


@dataclass(frozen=True)
class Cast:
    models: dict[str, str]  # member -> model key
    learner: str | None  # the learner's seat (None: no seat rule)
    trains: tuple[str, ...]  # members whose branches train, in the env's member order


def seating_of(env: EnvConfig, pin: str | None = None) -> Seating | None:
    """The ``Seating`` of a train env's config (None when it sets nothing: every member
    played by the actor, every non-judge member trains); ``pin`` overrides the learner
    rule (``orchestrator.eval.learner_seat``)."""
    learner = pin or env.learner_seat
    if not env.members and learner is None and env.opponent is None and env.drop_judge:
        return None
    return Seating(dict(env.members), learner, env.opponent, not env.drop_judge)


def seat_of(env: Environment, rule: str | None, seed: int, sample_index: int) -> str | None:
    """The learner's member under ``rule`` for rollout ``sample_index`` of a group."""
    if rule is None:
        return None
    if rule != ROTATE:
        return rule
    seats = env.seats
    return seats[(stable_seed(seed, "seat") + sample_index) % len(seats)]


def cast(
    env: Environment, seating: Seating | None, actor: str, seed: int, sample_index: int
) -> Cast:
    if not env.members:
        return Cast({}, None, ())
    s = seating or Seating()
    learner = seat_of(env, s.learner, seed, sample_index)
    models: dict[str, str] = {}
    for m in env.members:
        if m in s.bindings:
            models[m] = s.bindings[m]
        elif learner is None or m == learner or m in env.judges:
            models[m] = actor
        else:
            models[m] = s.opponent or actor

    def trains(m: str) -> bool:
        if models[m] != actor:
            return False
        if m in env.judges:
            return s.train_judges
        return learner is None or m == learner

    return Cast(models, learner, tuple(m for m in env.members if trains(m)))


def seating_problems(where: str, env: Environment, seating: Seating) -> list[str]:
    """Why ``seating`` cannot work on ``env`` (each naming the key under ``where``)."""
    out = []
    if not env.members and (seating.bindings or seating.learner is not None):
        what = "members" if seating.bindings else "learner_seat"
        out.append(
            f"`{where}.{what}` is set, but env {env.name!r} declares no members: its traces "
            "carry no member or seat (remove the key, or use a multi-agent env)"
        )
        return out
    for m in seating.bindings:
        if m not in env.members:
            out.append(
                f"`{where}.members` binds {m!r}, which is not a member of {env.name!r} "
                f"(members: {list(env.members)})"
            )
    rule = seating.learner
    if seating.opponent is not None and rule is None:
        out.append(
            f"`{where}.opponent` = {seating.opponent!r} needs `{where}.learner_seat`: without "
            "a learner seat every seat is played by the actor (set learner_seat, or bind "
            f"members in `{where}.members`)"
        )
    if rule == ROTATE and not env.seats:
        out.append(
            f"`{where}.learner_seat` = 'rotate', but every member of {env.name!r} is a judge"
        )
    if rule is not None and rule != ROTATE and rule not in env.seats:
        out.append(
            f"`{where}.learner_seat` = {rule!r} must be {ROTATE!r} or one of the seats of "
            f"{env.name!r}: {list(env.seats)}"
        )
    held = [m for m in (env.seats if rule == ROTATE else [rule]) if m in seating.bindings]
    if rule is not None and held:
        out.append(
            f"`{where}.learner_seat` = {rule!r} but `{where}.members` binds {held} to another "
            "model: the learner would not play there (unbind it or pick another seat)"
        )
    return out
