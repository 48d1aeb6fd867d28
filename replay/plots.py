"""A run's curves in one PNG, read from its log alone.

    rlbus plot <run> [--out curves.png]

Seven panels. On top the four that ``curves.png`` shows too (``roles.lib.plotting``
draws them for both): train reward per step (orchestrator metrics of each RL batch, with a
rolling mean), eval reward per policy version, SFT loss and RL loss per step. Below:
staleness per step (mean and max policy lag of a batch's samples), rollouts/s over time
(from the traces' own timestamps: an event's ``ts_ns`` is the producer's clock, fine for
a rate) and trainer tokens/s per step. Step and version panels share one x range with
the warm start shaded. Nothing here imports a role: ``RunCurves`` is a fold over events,
``plot_run`` draws it (matplotlib on an Agg canvas, so it works without a display).

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
    from matplotlib.figure import Figure

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
    """Write the seven panels to ``path``; None when the run has no metrics yet."""
    if not (curves.train or curves.trainer or curves.eval):
        return None
    from roles.lib import plotting

    return plotting.save(run_figure(curves), path)


def run_figure(curves: RunCurves) -> Figure:
    """The four learning panels on top, staleness and throughput below."""
    from roles.lib import plotting

    fig = plotting.new_figure((18, 8.5))
    # Four panels on top, three below, each row filling the width (12 columns).
    top, bottom = ["reward", "evals", "sft", "rl"], ["stale", "rate", "tps"]
    ax = fig.subplot_mosaic(
        [[k for k in top for _ in range(3)], [k for k in bottom for _ in range(4)]]
    )
    panels = plotting.draw_learning_panels(curves, ax["reward"], ax["evals"], ax["sft"], ax["rl"])
    stale, rate, tps = ax["stale"], ax["rate"], ax["tps"]
    train = curves.train
    plotting.draw_staleness(
        stale, curves.series(train, "staleness_mean"), curves.series(train, "staleness_max")
    )
    rollouts = curves.rollout_rate()
    plotting.line(rate, rollouts, "rollouts/s", marker="")
    if not rollouts:
        plotting.note(rate, "fewer than two rollouts")
    rate.set(
        title="rollout throughput", xlabel="seconds since the first rollout", ylabel="rollouts / s"
    )
    plotting.line(tps, curves.series(curves.trainer, "tokens_per_s"), "tokens/s", color="C2")
    tps.set(title="trainer throughput", xlabel=plotting.STEP, ylabel="tokens / s")
    plotting.step_axes([*panels, stale, tps], curves.warmup_steps)
    return plotting.finish(fig, f"rlbus run {curves.run}")
