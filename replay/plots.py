"""A run's curves in one PNG, read from its log alone.

    rlbus plot <run> [--out curves.png]

Six panels: train reward per step (orchestrator metrics of each batch), eval reward per
policy version, trainer loss per step, staleness per step (mean and max policy lag of a
batch's samples), rollouts/s over time (from the traces' own timestamps: an event's
``ts_ns`` is the producer's clock, fine for a rate) and trainer tokens/s per step.
Nothing here imports a role: ``RunCurves`` is a fold over events, ``plot_run`` draws it
(matplotlib, Agg backend, so it works without a display).

``MetricCurves`` (``roles.lib.curves``) is the fold of a run's metrics alone, shared
with ``rlbus up``'s live monitor and ``curves.png``; ``RunCurves`` adds the rollout times.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bus.subjects import Topic
from roles.lib.curves import MetricCurves, Series
from schemas import EvalCompleted, MetricsReported, RunStarted, TraceCompleted

if TYPE_CHECKING:
    from bus.runtime import Bus


@dataclass
class RunCurves(MetricCurves):
    trace_ns: list[int] = field(default_factory=list)  # completion time of every rollout

    def apply(self, event: Any) -> None:
        super().apply(event)
        match event:
            case TraceCompleted():
                self.trace_ns.append(event.ts_ns)
            case EvalCompleted():
                self.trace_ns.extend([event.ts_ns] * len(event.traces))

    def rollout_rate(self, max_buckets: int = 30) -> Series:
        """(seconds since the first rollout, rollouts/s) over equal windows (about ten
        rollouts per window, at most ``max_buckets``)."""
        if len(self.trace_ns) < 2:
            return []
        buckets = max(2, min(max_buckets, len(self.trace_ns) // 10))
        ts = sorted(self.trace_ns)
        t0, span = ts[0], max(1, ts[-1] - ts[0])
        width = span / buckets
        counts = [0] * buckets
        for t in ts:
            counts[min(buckets - 1, int((t - t0) / width))] += 1
        return [((i + 0.5) * width / 1e9, c / (width / 1e9)) for i, c in enumerate(counts)]


async def read_curves(bus: Bus) -> RunCurves:
    from bus.reader import read_log

    curves = RunCurves(bus.run)
    topics = [(Topic.RUN_STARTED, None), (Topic.TRACE_COMPLETED, None),
              (Topic.EVAL_COMPLETED, None), (Topic.METRICS_REPORTED, "orchestrator"),
              (Topic.METRICS_REPORTED, "trainer"), (Topic.METRICS_REPORTED, "eval")]  # fmt: skip
    async for event in read_log(
        bus, topics, (RunStarted, TraceCompleted, EvalCompleted, MetricsReported)
    ):
        curves.apply(event)
    return curves


def plot_run(curves: RunCurves, path: Path) -> Path | None:
    """Write the six panels to ``path``; None when the run has no metrics yet."""
    if not (curves.train or curves.trainer or curves.eval):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8))
    (reward, evals, loss), (stale, rate, tps) = axes
    _line(reward, curves.series(curves.train, "reward_mean"), "train reward (batch mean)")
    reward.set(title="train reward", xlabel="step")
    for key in curves.eval_keys():
        _line(evals, curves.series(curves.eval, key), key, marker="o")
    evals.set(title="eval reward", xlabel="policy version")
    _line(loss, curves.series(curves.trainer, "loss"), "loss", color="C3")
    loss.set(title="trainer loss", xlabel="step")
    _line(stale, curves.series(curves.train, "staleness_mean"), "mean")
    _line(stale, curves.series(curves.train, "staleness_max"), "max", marker="x")
    stale.set(title="staleness (policy versions behind)", xlabel="step")
    _line(rate, curves.rollout_rate(), "rollouts/s", marker="")
    rate.set(title="rollout throughput", xlabel="seconds since the first rollout")
    _line(tps, curves.series(curves.trainer, "tokens_per_s"), "tokens/s", color="C2")
    tps.set(title="trainer tokens/s", xlabel="step")
    for ax in (reward, evals, loss, stale):
        if curves.warmup_steps:
            ax.axvspan(0, curves.warmup_steps, color="0.9", label="SFT warm start")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"rlbus run {curves.run}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _line(ax: Any, points: Series, label: str, marker: str = ".", **kw: Any) -> None:
    if points:
        ax.plot(*zip(*points, strict=True), marker=marker, label=label, **kw)
