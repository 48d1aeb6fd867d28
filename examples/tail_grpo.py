"""A per-token custom algorithm, loaded by import path: GRPO on the last tokens only.

    [[orchestrator.algorithms]]
    id = "tail"
    name = "examples.tail_grpo:TailGRPO"
    options = { tail = 2 }

    rlbus algorithm attach examples.tail_grpo:TailGRPO --run demo --shadow --option tail=2

Each branch's GRPO advantage sits on its last ``tail`` trainable tokens and nowhere
else: ``targets`` returns per-token arrays (``Targets.advantages``) instead of the one
scalar per trace that ``advantages`` gives.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from roles.algorithm.base import Algorithm, BranchView, Refs, Targets
from roles.algorithm.builtin import GRPO
from schemas import Trace


class TailGRPO(Algorithm):
    name = "tail_grpo"

    def __init__(self, tail: int = 4) -> None:  # options are keyword arguments
        super().__init__()
        if tail < 1:
            raise ValueError(f"tail_grpo: tail must be >= 1, got {tail}")
        self.tail = int(tail)
        self.grpo = GRPO()

    def targets(
        self, group: list[Trace], views: list[list[BranchView]], state: Any, refs: Refs
    ) -> list[list[Targets]]:
        out = []
        for a, trace_views in zip(self.grpo.advantages(group, state), views, strict=True):
            row = []
            for v in trace_views:
                adv = np.zeros(len(v), np.float32)
                adv[np.flatnonzero(v.trainable)[-self.tail :]] = a
                row.append(Targets(advantages=adv))
            out.append(row)
        return out
