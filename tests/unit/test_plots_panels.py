"""Panels that read (issue 31, item 11): eval scores with their standard error, an SFT
panel whose x axis is the warm start when SFT happens only there, and a staleness panel
with whole-version ticks and the max as a band under the mean."""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.axes import Axes
from matplotlib.collections import PolyCollection
from matplotlib.container import ErrorbarContainer

from replay.plots import RunCurves, run_figure
from roles.lib import plotting
from roles.lib.curves import MetricCurves
from roles.up.plots import curves_figure
from schemas import MetricsReported
from tests.unit.test_plots import STEPS, WARM, feed, xs


def panel(axes: list[Axes], title: str) -> Axes:
    (ax,) = [a for a in axes if a.get_title().startswith(title)]
    return ax


def with_stderr(curves: MetricCurves) -> MetricCurves:
    """``feed``'s run, its avg@4 reported with a standard error (its pass@4 without)."""
    for version, values in curves.eval.items():
        values["env/avg@4_stderr"] = 0.01 + version / 1000
    return curves


def test_eval_scores_carry_their_stderr_as_error_bars() -> None:
    curves = with_stderr(feed(MetricCurves(run="r")))
    evals = panel(curves_figure(curves).axes, "eval reward")
    (bars,) = [c for c in evals.containers if isinstance(c, ErrorbarContainer)]
    assert bars.get_label() == "env/avg@4 (± stderr)"
    line, _, (segments,) = bars.lines
    versions = list(range(0, STEPS + 1, 6))
    assert xs(line) == versions
    heights = [float(np.ptp(s[:, 1])) for s in segments.get_segments()]
    assert heights == pytest.approx([2 * (0.01 + v / 1000) for v in versions])  # +- one stderr
    # pass@4 reports no stderr: a plain line, no bars
    assert [ln.get_label() for ln in evals.lines if ln.get_label() == "env/pass@4"]


def test_sft_panel_spans_the_warm_start_when_sft_happens_only_there() -> None:
    """The SFT loss is steps 1..3 of 24: its panel does not share the RL steps' x range."""
    axes = curves_figure(feed(MetricCurves(run="r"))).axes
    sft, rl = panel(axes, "SFT loss"), panel(axes, "RL loss")
    assert sft.get_xlim() == (0.5, WARM + 0.5)
    assert rl.get_xlim()[1] > STEPS - 1
    assert list(sft.get_xticks()) == [1, 2, 3]
    assert sft.get_title() == f"SFT loss (warm start, steps 1-{WARM})"


def test_sft_panel_shares_the_run_when_rl_steps_train_sft_too() -> None:
    """Tool outputs trained as SFT on RL steps put cross-entropy beyond the warm start:
    then the SFT panel keeps the whole run's x range."""
    curves = feed(MetricCurves(run="r"))
    curves.trainer[STEPS] |= {"loss_ce": 0.5, "ce_tokens": 9.0}
    axes = curves_figure(curves).axes
    sft, rl = panel(axes, "SFT loss"), panel(axes, "RL loss")
    assert sft.get_title() == "SFT loss"
    assert sft.get_xlim() == rl.get_xlim()
    assert xs(sft.lines[0])[-1] == STEPS


def test_no_sft_step_is_no_warm_start_only_panel() -> None:
    assert not plotting.warm_start_only([], 3)
    assert not plotting.warm_start_only([(1, 2.0)], 0)
    assert plotting.warm_start_only([(1, 2.0), (3, 1.0)], 3)
    assert not plotting.warm_start_only([(1, 2.0), (4, 1.0)], 3)


def test_staleness_max_is_a_step_band_under_the_mean_with_whole_version_ticks() -> None:
    curves = feed(RunCurves(run="r"))
    for step in range(WARM + 1, STEPS + 1):  # a max that jumps between whole versions
        curves.train[step] |= {"staleness_max": float(step % 3), "staleness_mean": 0.4}
    curves.trace_ns = [i * 10**8 for i in range(100)]
    stale = panel(run_figure(curves).axes, "staleness")
    (band,) = [c for c in stale.collections if isinstance(c, PolyCollection)]
    assert band.get_label() == "max"
    assert [
        str(ln.get_label()) for ln in stale.lines if not str(ln.get_label()).startswith("_")
    ] == ["mean"]
    assert stale.get_ylim()[0] == 0
    assert all(float(t).is_integer() for t in stale.get_yticks())


def test_a_run_without_rl_batches_says_so_in_the_staleness_panel() -> None:
    curves = RunCurves(run="r")
    curves.apply(MetricsReported(run="r", role="trainer", step=1, values={"loss": 2.0}))
    stale = panel(run_figure(curves).axes, "staleness")
    assert [t.get_text() for t in stale.texts] == ["no RL batch yet"]
