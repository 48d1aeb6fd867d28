"""A custom algorithm, loaded by import path: a running baseline across groups.

    [[orchestrator.algorithms]]
    id = "running"
    name = "examples.my_algo:RunningBaseline"
    options = { prior = 0.5 }

    rlbus role algorithm --run demo --name running

A_i = r_i - b, where b is the mean reward of every non-errored trace in every group this
algorithm scored before (``prior`` before the first). The baseline is state, so the
class is ``stateful``: the worker folds ``fold`` over the ``SamplesScored`` events it
published, in log order, and a restarted worker rebuilds the same baseline from the log.
"""

from __future__ import annotations

import math

from roles.algorithm.base import Algorithm
from schemas import SamplesScored, Trace

State = tuple[float, int]  # (sum of rewards seen, how many)


class RunningBaseline(Algorithm):
    name = "running_baseline"
    stateful = True

    def __init__(self, prior: float = 0.5) -> None:
        super().__init__()
        self.prior = float(prior)

    def initial_state(self) -> State:
        return (0.0, 0)

    def fold(self, state: State, scored: SamplesScored) -> State:
        total, count = state
        return (total + math.fsum(scored.rewards), count + len(scored.rewards))

    def baseline(self, state: State) -> float:
        total, count = state
        return total / count if count else self.prior

    def advantages(self, group: list[Trace], state: State) -> list[float]:
        b = self.baseline(state)
        return [t.reward - b for t in group]
