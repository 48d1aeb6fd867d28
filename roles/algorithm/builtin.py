"""The built-in algorithms with a scalar per trace: group baselines for RL, and SFT.

Each fits in a few lines, so they share this file (the per-token and distillation
algorithms live in ``roles/algorithm/channels.py``); your own algorithm is a class in
your own module (see ``examples/my_algo.py``), loaded by import path.

Means and standard deviations use ``math.fsum`` (exactly rounded): a plain running
sum depends on the order of its terms in the last bits, and advantages must not depend
on the order in which a group's traces arrived. A group whose rewards are all equal
gets exact zeros, so "no learning signal" is an exact test downstream.
"""

from __future__ import annotations

import math
from typing import Any

from roles.algorithm.base import Algorithm
from schemas import Trace


def rewards_of(group: list[Trace]) -> list[float]:
    return [float(t.reward) for t in group]


def mean(values: list[float]) -> float:
    return math.fsum(values) / len(values)


def flat(values: list[float]) -> bool:
    """True when the group carries no relative signal (empty, or every value equal)."""
    return not values or min(values) == max(values)


class GRPO(Algorithm):
    """A_i = r_i - mean(r); with ``std_normalize``, divided by (std(r) + 1e-6).

    std is the population standard deviation of the group (ddof=0).
    """

    name = "grpo"

    def __init__(self, std_normalize: bool = False) -> None:
        super().__init__()
        self.std_normalize = bool(std_normalize)

    def advantages(self, group: list[Trace], state: Any) -> list[float]:
        r = rewards_of(group)
        if flat(r):
            return [0.0] * len(r)
        m = mean(r)
        adv = [x - m for x in r]
        if self.std_normalize:
            std = math.sqrt(math.fsum(a * a for a in adv) / len(adv))
            adv = [a / (std + 1e-6) for a in adv]
        return adv


class MaxRL(Algorithm):
    """A_i = (r_i - mean(r)) / mean(r) when mean(r) > 0, else 0."""

    name = "max_rl"

    def advantages(self, group: list[Trace], state: Any) -> list[float]:
        r = rewards_of(group)
        if flat(r):
            return [0.0] * len(r)
        m = mean(r)
        if m <= 0:
            return [0.0] * len(r)
        return [(x - m) / m for x in r]


class RLOO(Algorithm):
    """Leave-one-out baseline: A_i = r_i - mean_{j != i}(r_j); a group of one gets 0."""

    name = "rloo"

    def advantages(self, group: list[Trace], state: Any) -> list[float]:
        r = rewards_of(group)
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

    def advantages(self, group: list[Trace], state: Any) -> list[float]:
        return [1.0] * len(group)
