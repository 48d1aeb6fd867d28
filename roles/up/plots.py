"""Curves of a run: train reward, eval reward, SFT loss, RL loss (PNG, 2 x 2 panels).

Drawn from the monitor's metric tables (``roles.lib.curves.MetricCurves``, the fold
``rlbus plot`` draws its panels from) by the panels ``roles.lib.plotting`` shares with
``rlbus plot``, so ``runs/<run>/curves.png`` and ``rlbus plot``'s top row read the same.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from roles.lib.curves import MetricCurves

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def plot_curves(monitor: MetricCurves, path: Path) -> Path | None:
    """Write the four panels to ``path``; None when there is nothing to plot yet."""
    if not (monitor.train or monitor.trainer or monitor.eval):
        return None
    from roles.lib import plotting

    return plotting.save(curves_figure(monitor), path)


def curves_figure(monitor: MetricCurves) -> Figure:
    """Train reward and eval reward above, SFT loss and RL loss below."""
    from roles.lib import plotting

    fig = plotting.new_figure((13, 8))
    (reward, evals), (sft, rl) = fig.subplots(2, 2)
    panels = plotting.draw_learning_panels(monitor, reward, evals, sft, rl)
    plotting.step_axes(panels, monitor.warmup_steps)
    return plotting.finish(fig, f"rlbus run {monitor.run}")
