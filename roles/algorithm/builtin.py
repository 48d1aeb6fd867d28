"""The built-in algorithms with a scalar per trace: group baselines for RL, and SFT.

Each fits in a few lines, so they share this file (the per-token and distillation
algorithms live in ``roles/algorithm/channels.py``); your own algorithm is a class in
your own module (see ``examples/my_algo.py``), loaded by import path.

Means and standard deviations use ``math.fsum`` (exactly rounded): a plain running
sum depends on the order of its terms in the last bits, and advantages must not depend
on the order in which a group's traces arrived. A group whose rewards are all equal
gets exact zeros, so "no learning signal" is an exact test downstream.

On a multi-agent env (traces whose branches name members) the group baselines are per
member: each member's branches are compared only with the same member's branches of the
group, by that member's reward (``docs/algorithms.md``, "Members"). A relay member
that did its job well gets a positive advantage even when its partner failed.
"""

from __future__ import annotations

import math
from typing import Any

from roles.algorithm.base import Algorithm, BranchView, Refs, Targets
from schemas import Trace


def rewards_of(group: list[Trace]) -> list[float]:
    return [float(t.reward) for t in group]


def mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def flat(values: list[float]) -> bool:
    """True when the group carries no relative signal (empty, or every value equal)."""
    return not values or min(values) == max(values)


class GroupBaseline(Algorithm):
    """An advantage per reward from the group's rewards (``from_rewards``): over the
    traces' rewards, or, on a multi-agent env, over each member's branch rewards."""

    handles_members = True

    def from_rewards(self, r: list[float]) -> list[float]:
        raise NotImplementedError

    def advantages(self, group: list[Trace], state: Any) -> list[float]:
        return self.from_rewards(rewards_of(group))

    def targets(
        self, group: list[Trace], views: list[list[BranchView]], state: Any, refs: Refs
    ) -> list[list[Targets]]:
        if not any(v.member is not None for vs in views for v in vs):
            return super().targets(group, views, state, refs)
        out = [[Targets(advantages=0.0) for _ in vs] for vs in views]
        by_member: dict[str | None, list[tuple[int, int]]] = {}
        for i, vs in enumerate(views):
            for j, v in enumerate(vs):
                by_member.setdefault(v.member, []).append((i, j))
        for places in by_member.values():
            adv = self.from_rewards([views[i][j].reward for i, j in places])
            for (i, j), a in zip(places, adv, strict=True):
                out[i][j].advantages = float(a)
        return out


class GRPO(GroupBaseline):
    """A_i = r_i - mean(r); with ``std_normalize``, divided by (std(r) + 1e-6).

    std is the population standard deviation of the group (ddof=0).
    """

    name = "grpo"

    def __init__(self, std_normalize: bool = False) -> None:
        super().__init__()
        self.std_normalize = bool(std_normalize)

    def from_rewards(self, r: list[float]) -> list[float]:
        if flat(r):
            return [0.0] * len(r)
        m = mean(r)
        adv = [x - m for x in r]
        if self.std_normalize:
            std = math.sqrt(math.fsum(a * a for a in adv) / len(adv))
            adv = [a / (std + 1e-6) for a in adv]
        return adv


class MaxRL(GroupBaseline):
    """A_i = (r_i - mean(r)) / mean(r) when mean(r) > 0, else 0."""

    name = "max_rl"

    def from_rewards(self, r: list[float]) -> list[float]:
        if flat(r):
            return [0.0] * len(r)
        m = mean(r)
        if m <= 0:
            return [0.0] * len(r)
        return [(x - m) / m for x in r]


class RLOO(GroupBaseline):
    """Leave-one-out baseline: A_i = r_i - mean_{j != i}(r_j); a group of one gets 0."""

    name = "rloo"

    def from_rewards(self, r: list[float]) -> list[float]:
        n = len(r)
        if n < 2 or flat(r):
            return [0.0] * n
        # fsum of the others, not (sum - r_i): exact rounding keeps it order-free.
        return [x - math.fsum(r[:i] + r[i + 1 :]) / (n - 1) for i, x in enumerate(r)]


class SFT(Algorithm):
    """No baseline: cross-entropy on the actor's sampled tokens (the actor may be a frozen
    teacher, as in the warm start), weight 1."""

    name = "sft"
    channel = "ce"
    channels = ("ce",)
    handles_members = True  # no baseline: every trainable branch, weight 1

    def advantages(self, group: list[Trace], state: Any) -> list[float]:
        return [1.0] * len(group)
