"""A run's metrics folded into curves: the one fold behind every plot and summary.

    curves = MetricCurves(run="demo")
    for event in events: curves.apply(event)
    curves.series(curves.eval, "reverse-text/avg@4")     # [(policy version, value), ...]

``rlbus up``'s live monitor (``roles.up.monitor.RunMonitor``, its view, ``summary.json``
and ``curves.png``) and ``rlbus plot`` (``replay.plots.RunCurves``) both extend it, so
the live view and a plot of the finished run show the same numbers. Pure: it needs
nothing but ``schemas``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from schemas import MetricsReported, RunStarted

Series = list[tuple[float, float]]
STDERR = "_stderr"  # suffix of an eval score's standard error (roles.orchestrator.eval_stats)
Table = dict[int, dict[str, float]]


@dataclass
class MetricCurves:
    """A run's ``MetricsReported`` folded into tables: orchestrator metrics per step
    (``train``), trainer metrics per step, eval metrics per policy version; and the warm
    start's length from ``run.started``. The first report of a step is kept (a copy
    stored again after the stream's duplicate window repeats it)."""

    # Eval metrics that are curves: avg@k and pass@k scores.
    eval_kinds: ClassVar[tuple[str, ...]] = ("avg@", "pass@")

    run: str
    warmup_steps: int = 0
    train: Table = field(default_factory=dict)  # orchestrator metrics per step
    trainer: Table = field(default_factory=dict)  # trainer metrics per step
    eval: Table = field(default_factory=dict)  # eval metrics per policy version

    def apply(self, event: Any) -> None:
        match event:
            case RunStarted():
                warm = event.config.get("orchestrator", {}).get("warmup", {}).get("steps", 0)
                self.warmup_steps = int(warm or 0)
            case MetricsReported(role="orchestrator"):
                self.train.setdefault(event.step, dict(event.values))
            case MetricsReported(role="trainer"):
                self.trainer.setdefault(event.step, dict(event.values))
            case MetricsReported(role="eval"):
                self.eval.setdefault(event.step, dict(event.values))

    @staticmethod
    def series(table: Table, key: str) -> Series:
        """(step or version, value) of ``key``, in order, where it was reported."""
        return [(k, v[key]) for k, v in sorted(table.items()) if key in v]

    def eval_keys(self) -> list[str]:
        """The eval scores that are curves (their ``<key>_stderr`` error bars are not)."""
        return sorted(
            {
                k
                for v in self.eval.values()
                for k in v
                if any(s in k for s in self.eval_kinds) and not k.endswith(STDERR)
            }
        )

    def stderr(self, key: str, version: int) -> float | None:
        """The standard error of eval score ``key`` at ``version`` (None: not reported)."""
        return self.eval.get(version, {}).get(key + STDERR)
