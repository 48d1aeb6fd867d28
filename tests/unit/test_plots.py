"""The run's pictures: ``curves.png`` (``roles.up.plots``), ``rlbus plot`` (``replay.plots``)
and the habits they share (``roles.lib.plotting``), checked on the figure, not the pixels."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from replay.plots import RunCurves, plot_run, run_figure
from roles.lib import plotting
from roles.lib.curves import MetricCurves
from roles.up.plots import curves_figure, plot_curves
from schemas import MetricsReported, RunStarted, run_started_id

WARM, STEPS = 3, 24
C = TypeVar("C", bound=MetricCurves)


def feed(curves: C) -> C:
    """A run as the roles report it: a 3-step warm start, 21 RL steps, evals every 6."""
    warmup = {"orchestrator": {"warmup": {"steps": WARM}}}
    curves.apply(
        RunStarted(
            run=curves.run,
            event_id=run_started_id(curves.run),
            config=warmup,
            seed=0,
            model_path="m",
        )
    )
    for step in range(1, STEPS + 1):
        sft = step <= WARM
        orchestrator = {"reward_mean": 1.0 if sft else 0.1 + step / 100, "sft": float(sft)}
        orchestrator |= {"staleness_mean": 0.0 if sft else 0.5, "staleness_max": float(not sft)}
        trainer = {
            "loss": 4.0 / step if sft else 0.01 * (-1) ** step,
            "loss_ce": 4.0 / step if sft else 0.0,
            "loss_rl": 0.0 if sft else 0.01 * (-1) ** step,
            "ce_tokens": 40.0 if sft else 0.0,
            "rl_tokens": 0.0 if sft else 40.0,
            "tokens_per_s": 1000.0,
        }
        for role, values in (("orchestrator", orchestrator), ("trainer", trainer)):
            curves.apply(MetricsReported(run=curves.run, role=role, step=step, values=values))
    for version in range(0, STEPS + 1, 6):
        values = {"env/avg@4": version / 50, "env/pass@4": version / 40}
        curves.apply(MetricsReported(run=curves.run, role="eval", step=version, values=values))
    return curves


def xs(line: Line2D) -> list[float]:
    return np.asarray(line.get_xdata(), dtype=float).tolist()


def ys(line: Line2D) -> list[float]:
    return np.asarray(line.get_ydata(), dtype=float).tolist()


def spans(ax: Axes) -> list[tuple[float, float]]:
    """The x extent of each axvspan of a panel (a Rectangle spanning the full height)."""
    return [
        (p.get_x(), p.get_x() + p.get_width())
        for p in ax.patches
        if isinstance(p, Rectangle) and p.get_label() in (plotting.WARM_START_LABEL, "_nolegend_")
    ]


def learning_figure(curves: MetricCurves) -> tuple[Figure, list[Axes]]:
    fig = curves_figure(curves)
    return fig, fig.axes


def step_panels(fig: Figure) -> list[Axes]:
    """The panels whose x axis counts trainer steps or policy versions."""
    return [ax for ax in fig.axes if ax.get_xlabel() in (plotting.STEP, plotting.VERSION)]


def run_with_rollouts() -> RunCurves:
    curves = feed(RunCurves(run="r"))
    curves.trace_ns = [i * 10**8 for i in range(100)]
    return curves


@pytest.mark.parametrize(
    ("draw", "panels", "n_step_panels"),
    [
        pytest.param(lambda: curves_figure(feed(MetricCurves(run="r"))), 4, 4, id="curves.png"),
        pytest.param(lambda: run_figure(run_with_rollouts()), 7, 6, id="rlbus-plot"),
    ],
)
def test_every_panel_is_labelled_step_axes_are_integer_and_warm_start_shaded(
    draw: Callable[[], Figure], panels: int, n_step_panels: int
) -> None:
    """Every panel says what its axes are; steps and versions tick on whole numbers; the
    warm start (steps 1..3) is shaded in each step or version panel, labelled once; the
    SFT panel of a run whose SFT is all warm start spans the warm start alone, unshaded."""
    fig = draw()
    assert len(fig.axes) == panels
    for ax in fig.axes:
        assert ax.get_xlabel() and ax.get_ylabel(), ax.get_title()
    steps = step_panels(fig)
    assert len(steps) == n_step_panels
    for ax in steps:
        assert all(float(t).is_integer() for t in ax.get_xticks()), ax.get_title()
        if ax.get_title().startswith("SFT loss"):
            assert ax.get_xlim() == (0.5, WARM + 0.5) and spans(ax) == []
            continue
        assert isinstance(ax.xaxis.get_major_locator(), MaxNLocator)
        assert spans(ax) == [(0.5, WARM + 0.5)], ax.get_title()
    labels = [lab for ax in fig.axes for lab in ax.get_legend_handles_labels()[1]]
    assert labels.count(plotting.WARM_START_LABEL) == 1
    assert all(spans(ax) == [] for ax in fig.axes if ax not in steps)  # seconds: no steps


def test_integer_ticks_on_a_three_step_run() -> None:
    """A short run's step axis has no tick at 1.5 (MaxNLocator(integer=True))."""
    fig = plotting.new_figure((4, 3))
    ax = fig.subplots()
    ax.plot([1, 2, 3], [0.1, 0.2, 0.3])
    assert not all(float(t).is_integer() for t in ax.get_xticks())
    plotting.integer_ticks(ax)
    assert all(float(t).is_integer() for t in ax.get_xticks())


def test_sft_and_rl_loss_get_panels_of_their_own() -> None:
    """Cross-entropy (~4) and the policy-gradient loss (~0.01) never share a y axis: the
    SFT panel holds the warm-start steps, the RL panel the others."""
    _, (_, _, sft, rl) = learning_figure(feed(MetricCurves(run="r")))
    (ce,) = sft.lines
    assert xs(ce) == [1, 2, 3] and ys(ce)[0] == 4.0
    raw = rl.lines[0]
    assert xs(raw) == list(range(WARM + 1, STEPS + 1))
    assert max(abs(y) for y in ys(raw)) == pytest.approx(0.01)
    assert sft.get_ylabel() != rl.get_ylabel()


def test_train_reward_is_drawn_faint_under_its_rolling_mean() -> None:
    """RL batches only (a warm-start batch is the teacher's, reward 1), raw points faint,
    the smoothed line named with its window in the legend."""
    _, (reward, *_) = learning_figure(feed(MetricCurves(run="r")))
    raw, smooth = reward.lines
    assert xs(raw) == list(range(WARM + 1, STEPS + 1))
    assert (raw.get_alpha() or 1) < 0.5 and smooth.get_linewidth() > raw.get_linewidth()
    window = plotting.smoothing_window(STEPS - WARM)
    assert smooth.get_label() == f"centred rolling mean, {window} steps"


def test_rolling_mean_is_centred_and_keeps_the_ends() -> None:
    assert plotting.rolling_mean([0, 0, 3, 0, 0], 3) == [0, 1, 1, 1, 0]
    assert plotting.rolling_mean([1, 3], 5) == [2, 2]
    assert plotting.smoothing_window(5) == 1  # too short to smooth: drawn plainly
    assert all(plotting.smoothing_window(n) % 2 == 1 for n in range(8, 500))


def test_loss_series_of_a_run_recorded_before_loss_channels() -> None:
    """Runs that report ``loss`` alone split it by phase (the orchestrator's sft flag)."""
    c = MetricCurves(run="r", warmup_steps=1)
    for step in (1, 2):
        c.apply(MetricsReported(run="r", role="orchestrator", step=step, values={"sft": float(step == 1)}))  # fmt: skip
        c.apply(MetricsReported(run="r", role="trainer", step=step, values={"loss": 3.0 - step}))
    assert plotting.loss_series(c) == ([(1, 2.0)], [(2, 1.0)])


def test_cross_entropy_on_rl_steps_joins_the_sft_panel() -> None:
    """Tool outputs trained as SFT during RL (ce tokens on an RL step) are cross-entropy."""
    c = MetricCurves(run="r")
    values = {"loss": 1.5, "loss_rl": 0.5, "loss_ce": 1.0, "ce_tokens": 7.0}
    c.apply(MetricsReported(run="r", role="trainer", step=1, values=values))
    assert plotting.loss_series(c) == ([(1, 1.0)], [(1, 0.5)])


def test_no_warm_start_no_span() -> None:
    fig = plotting.new_figure((4, 3))
    ax = fig.subplots()
    plotting.shade_warm_start([ax], 0)
    assert spans(ax) == []


def test_plot_curves_writes_a_png_of_four_readable_panels(tmp_path: Path) -> None:
    """``curves.png``: a PNG, and nothing when no metric arrived yet."""
    path = plot_curves(feed(MetricCurves(run="r")), tmp_path / "curves.png")
    assert path is not None and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_curves(MetricCurves(run="r"), tmp_path / "none.png") is None


def test_plot_run_writes_a_png_of_seven_panels(tmp_path: Path) -> None:
    """``rlbus plot``: the four learning panels plus staleness and throughput."""
    path = plot_run(run_with_rollouts(), tmp_path / "sub" / "plot.png")
    assert path is not None and path.stat().st_size > 10_000
    assert plot_run(RunCurves(run="r"), tmp_path / "none.png") is None
