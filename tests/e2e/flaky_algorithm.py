"""A test algorithm that cannot score every group: GRPO, except that it raises on the
groups of every third task index (a bug in a user's algorithm, met mid-run)."""

from __future__ import annotations

from typing import Any

from roles.algorithm.builtin import GRPO
from schemas import Trace


class FailsEveryThird(GRPO):
    name = "fails_every_third"

    def advantages(self, group: list[Trace], state: Any) -> list[float]:
        if group[0].task.index % 3 == 0:
            raise ValueError(f"cannot score task {group[0].task.index}")
        return super().advantages(group, state)
