"""What a run looks like from the outside: a fold over its metrics, weights and stop events.

The launcher's live view, ``summary.json`` and ``curves.png`` all read this one object,
fed from the run's stream (metrics, weights, stop) and the headers of completed traces.
Its metric tables are ``roles.lib.curves.MetricCurves``, the same fold as ``rlbus plot``'s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from roles.lib.curves import MetricCurves
from schemas import Event, MetricsReported, RunStarted, RunStopped, WeightsPublished


@dataclass(kw_only=True)
class RunMonitor(MetricCurves):
    # The view and the summary report avg@k (``rlbus plot`` draws pass@k as well).
    eval_kinds: ClassVar[tuple[str, ...]] = ("avg@",)

    max_steps: int
    started_at: float = field(default_factory=time.monotonic)
    policy_version: int = 0
    assembled: int = 0
    phase: str = "rl"
    rollouts: int = 0
    rollout_times: list[tuple[float, int]] = field(
        default_factory=list
    )  # (t, cumulative) for rates
    stopped: RunStopped | None = None
    started: RunStarted | None = None
    final_digest: str | None = None

    def apply(self, event: Event) -> None:
        super().apply(event)  # the metric tables
        match event:
            case RunStarted():
                self.started = event
            case RunStopped():
                self.stopped = event
            case WeightsPublished():
                self.policy_version = max(self.policy_version, event.version)
                if event.version >= self.policy_version:
                    self.final_digest = event.weights.digest
            case MetricsReported(role="orchestrator"):
                self.assembled = max(self.assembled, event.step)
                self.phase = "sft" if event.values.get("sft") else "rl"

    def trace_completed(self, n: int = 1) -> None:
        self.rollouts += n
        self.rollout_times.append((time.monotonic(), self.rollouts))
        if len(self.rollout_times) > 200:
            del self.rollout_times[:100]

    # -- derived views ------------------------------------------------------------------

    def rollouts_per_s(self, window: float = 20.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in self.rollout_times if now - t <= window]
        if len(recent) < 2:
            return 0.0
        (t0, n0), (t1, n1) = recent[0], recent[-1]
        return (n1 - n0) / max(1e-6, t1 - t0)

    def last(self, table: dict[int, dict[str, float]], key: str) -> float | None:
        s = self.series(table, key)
        return s[-1][1] if s else None

    def summary(self) -> dict[str, Any]:
        warm = self.warmup_steps
        evals = {k: self.series(self.eval, k) for k in self.eval_keys()}
        out: dict[str, Any] = {
            "run": self.run,
            "stopped": None
            if self.stopped is None
            else {"reason": self.stopped.reason, "detail": self.stopped.detail},
            "steps": self.policy_version,
            "wall_s": round(time.monotonic() - self.started_at, 1),
            "rollouts": self.rollouts,
            "warmup_steps": warm,
            "final_weights_digest": self.final_digest,
            "eval": {str(v): m for v, m in sorted(self.eval.items())},
            "train_reward": dict(self.series(self.train, "reward_mean")),
            "loss": dict(self.series(self.trainer, "loss")),
        }
        for key, points in evals.items():
            at = dict(points)
            after_warm = at.get(warm) if warm else at.get(0)
            final = points[-1][1] if points else None
            out[f"{key}:after_warm_start"] = after_warm
            out[f"{key}:final"] = final
            if after_warm is not None and final is not None:
                out[f"{key}:gain"] = round(final - after_warm, 4)
        return out


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 30) -> str:
    values = values[-width:]
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = hi - lo or 1.0
    return "".join(
        SPARKS[min(len(SPARKS) - 1, int((v - lo) / span * (len(SPARKS) - 1)))] for v in values
    )
