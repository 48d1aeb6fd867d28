"""What a run looks like from the outside: a fold over its metrics, weights and stop events.

The launcher's live view, ``summary.json`` and ``curves.png`` all read this one object,
fed from the run's stream (metrics, weights, stop) and the headers of completed traces
and evals; the launcher's inference pool reads its replicas' busy shares here. Its metric tables are ``roles.lib.curves.MetricCurves``, the same fold as
``rlbus plot``'s.

Counts: ``rollouts`` are train rollouts, one per ``trace.completed`` message (the rate
and throughput count these alone); ``eval_rollouts`` are the rollouts of eval tasks, k
per ``eval.completed`` message (``orchestrator.eval.k``), counted apart.

The fold takes only what can be true of the run, since anyone who can publish to the
run's subjects could otherwise set its reported steps or final digest (a forged
``weights.published`` at version 10**9 once did): a batch step (the orchestrator's
report of a batch) in 1..max_steps; a weights version in 1..the newest batch step (a
version ahead of it waits for its batch, since the two travel on different connections);
an eval result for a version up to the newest accepted weights. Anything else is
skipped with one log line and counted in the summary's ``rejected``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from bus.log import get_logger
from roles.lib.curves import MetricCurves
from schemas import (
    Event,
    MetricsReported,
    RunStarted,
    RunStopped,
    WeightsPublished,
    run_stopped_id,
)


@dataclass(kw_only=True)
class RunMonitor(MetricCurves):
    # The view and the summary report avg@k (``rlbus plot`` draws pass@k as well).
    eval_kinds: ClassVar[tuple[str, ...]] = ("avg@",)

    max_steps: int
    eval_k: int = 1  # rollouts per eval task (orchestrator.eval.k)
    started_at: float = field(default_factory=time.monotonic)
    policy_version: int = 0
    assembled: int = 0
    phase: str | None = None  # of the newest assembled batch: "sft" or "rl"
    rollouts: int = 0  # train rollouts: trace.completed messages
    eval_tasks: int = 0  # eval.completed messages, k rollouts each
    rollout_times: list[tuple[float, int]] = field(
        default_factory=list
    )  # (t, cumulative) for rates
    first_rollout_at: float | None = None
    stopped: RunStopped | None = None
    started: RunStarted | None = None
    final_digest: str | None = None
    rejected: int = 0  # events that cannot be true of the run (``why_rejected``), skipped
    undecodable: int = 0  # messages that are no readable event, skipped
    waiting: list[WeightsPublished] = field(default_factory=list)  # ahead of their batch
    # Each inference replica's last busy share: producer -> (ts_ns, busy_frac). The
    # launcher's inference pool reads it (roles.up.pools); nothing else does.
    busy: dict[str, tuple[int, float]] = field(default_factory=dict)

    def apply(self, event: Event) -> None:
        """Fold ``event`` if it can be true of the run (see the module docstring)."""
        if isinstance(event, WeightsPublished) and self.assembled < event.version <= self.max_steps:
            self.waiting.append(event)  # its batch report is on its way
            return
        if why := self.why_rejected(event):
            self.reject(event, why)
            return
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
            case MetricsReported(role="inference") if "busy_frac" in event.values:
                self.busy[event.producer] = (event.ts_ns, event.values["busy_frac"])
            case MetricsReported(role="orchestrator") if event.step >= self.assembled:
                self.assembled = event.step
                self.phase = "sft" if event.values.get("sft") else "rl"
                for weights in [w for w in self.waiting if w.version <= self.assembled]:
                    self.waiting.remove(weights)
                    self.apply(weights)

    def why_rejected(self, event: Event) -> str | None:
        """Why ``event`` cannot be true of this run, given what was folded so far."""
        match event:
            case RunStarted() if self.started is not None:
                return "a second run.started"
            case RunStopped() if event.event_id != run_stopped_id(event.run):
                return "a run.stopped that is not the orchestrator's"
            case WeightsPublished(version=v) if not 1 <= v <= min(self.assembled, self.max_steps):
                return f"weights version {v}, newest batch step {self.assembled}"
            case MetricsReported(role="orchestrator", step=s) if not 1 <= s <= self.max_steps:
                return f"batch step {s}, max_steps {self.max_steps}"
            case MetricsReported(role="eval", step=v) if not 0 <= v <= self.policy_version:
                return f"eval of version {v}, newest weights version {self.policy_version}"
        return None

    def reject(self, event: Event, why: str) -> None:
        self.rejected += 1
        get_logger(run=self.run, role="launcher").warning(
            "monitor.rejected", type=type(event).__name__, event_id=event.event_id,
            producer=event.producer, why=why,
        )  # fmt: skip

    def unreadable(self, seq: int, subject: str, error: Exception) -> None:
        """A message that is no readable event: skipped (its durable owner dead-letters
        it; the launcher only watches)."""
        self.undecodable += 1
        get_logger(run=self.run, role="launcher").warning(
            "monitor.undecodable", seq=seq, subject=subject, error=repr(error)
        )

    def finish(self) -> None:
        """The run is over: weights still waiting for their batch never had one."""
        waiting, self.waiting = self.waiting, []
        for weights in waiting:
            self.reject(weights, f"weights version {weights.version}, no batch step reported")

    def trace_completed(self, n: int = 1) -> None:
        """Count ``n`` train rollouts (``trace.completed`` messages)."""
        now = time.monotonic()
        if self.first_rollout_at is None:
            self.first_rollout_at = now
        self.rollouts += n
        self.rollout_times.append((now, self.rollouts))
        if len(self.rollout_times) > 200:
            del self.rollout_times[:100]

    def eval_completed(self, n: int = 1) -> None:
        """Count ``n`` finished eval tasks (``eval.completed`` messages, k rollouts each)."""
        self.eval_tasks += n

    # -- derived views ------------------------------------------------------------------

    @property
    def eval_rollouts(self) -> int:
        return self.eval_tasks * self.eval_k

    def phase_label(self) -> str:
        """What the run is doing: starting (roles loading, no ``run.started`` yet), the
        warm start, RL, or stopped."""
        if self.stopped is not None:
            return f"stopped ({self.stopped.reason})"
        if self.started is None:
            return "starting"
        phase = self.phase or ("sft" if self.warmup_steps > 0 else "rl")
        return "warm start (sft)" if phase == "sft" else "rl"

    def mean_rollouts_per_s(self) -> float:
        """Train rollouts per second from the first one to the last one."""
        if self.first_rollout_at is None or not self.rollout_times:
            return 0.0
        span = self.rollout_times[-1][0] - self.first_rollout_at
        return self.rollouts / span if span > 0 else 0.0

    def mean_tokens_per_s(self) -> float | None:
        """The trainer's tokens/s, averaged over its steps."""
        values = [v for _, v in self.series(self.trainer, "tokens_per_s")]
        return sum(values) / len(values) if values else None

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
            "eval_rollouts": self.eval_rollouts,
            "rollouts_per_s": round(self.mean_rollouts_per_s(), 2),
            "trainer_tokens_per_s": _rounded(self.mean_tokens_per_s(), 1),
            "warmup_steps": warm,
            "final_weights_digest": self.final_digest,
            "rejected": self.rejected + len(self.waiting),
            "undecodable": self.undecodable,
            "eval": {str(v): m for v, m in sorted(self.eval.items())},
            "train_reward": dict(self.series(self.train, "reward_mean")),
            "loss": dict(self.series(self.trainer, "loss")),
        }
        for key, points in evals.items():
            at = dict(points)
            after_warm = at.get(warm) if warm else at.get(0)
            final = points[-1][1] if points else None
            out[f"{key}:start"] = at.get(0)
            out[f"{key}:after_warm_start"] = after_warm
            out[f"{key}:final"] = final
            if after_warm is not None and final is not None:
                out[f"{key}:gain"] = round(final - after_warm, 4)
        return out


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


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
