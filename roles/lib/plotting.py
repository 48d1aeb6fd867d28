"""Drawing a run's curves: the panels and habits that ``curves.png`` and ``rlbus plot`` share.

    fig = new_figure((13, 8))
    panels = draw_learning_panels(curves, *fig.subplots(2, 2).flat)   # a MetricCurves
    step_axes(panels, curves.warmup_steps)     # shared x, integer ticks, warm start shaded
    save(finish(fig, f"rlbus run {curves.run}"), Path("curves.png"))

``roles.up.plots.plot_curves`` (``runs/<run>/curves.png``, written by ``rlbus up``) draws
these four panels; ``replay.plots.plot_run`` (``rlbus plot``) draws them and three more.
Every habit lives here once, so both pictures read the same:

- every panel has an x label (trainer step, policy version, seconds) and a y label;
- step and version axes get integer ticks (a 3-step run has no tick at step 1.5);
- the warm start (steps 1..``warmup_steps``, SFT on the teacher's answers) is shaded in
  every step or version panel, labelled once per figure;
- noisy per-step series (train reward, RL loss) are drawn faint, with a centred rolling
  mean over them (its window named in the legend);
- the SFT loss (cross-entropy, ~1-5) and the RL loss (policy gradient, ~0 +- 0.1) get
  panels of their own: on one axis the RL loss would be a flat line at zero. When SFT
  happens only in the warm start, the SFT panel's x axis is the warm start's steps alone
  (shared with the RL steps, its points sat in the first few percent of the width);
- eval scores carry error bars: the standard error the orchestrator reports beside each
  ``avg@k`` (``<key>_stderr``, over the eval's tasks);
- staleness (``rlbus plot``): the max as a shaded step band under the mean, integer y
  ticks (a dashed max zigzagging over the mean between whole versions did not read).

Which metric is which loss: the trainer reports ``loss`` (the step's total) and its
channels ``loss_ce`` / ``loss_rl`` / ``loss_ref`` with their token counts
(``roles.trainer.loss.LossStats``); the orchestrator marks warm-start batches with
``sft`` = 1 (``roles.orchestrator.policy``). A warm-start step's loss is all
cross-entropy; an RL step's RL loss is ``loss_rl``, and its cross-entropy (tool outputs
trained as SFT) joins the SFT panel when it has tokens. Runs recorded before the
channels existed report ``loss`` alone: split by phase then.

matplotlib through its object API on an Agg canvas: no display, no pyplot state, no
global backend switch. Importing this module imports matplotlib, so callers import it
inside the function that draws.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from roles.lib.curves import MetricCurves, Series

WARM_START_LABEL = "warm start (SFT)"
WARM_START_COLOR = "0.88"
STEP = "trainer step"
VERSION = "policy version"


def new_figure(figsize: tuple[float, float]) -> Figure:
    """A figure on its own Agg canvas (saving needs no pyplot and no display)."""
    fig = Figure(figsize=figsize, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def finish(fig: Figure, title: str) -> Figure:
    """Grid and legend on every panel that has data, and the title."""
    for ax in fig.axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    return fig


def save(fig: Figure, path: Path, dpi: int = 100) -> Path:
    """The figure as a PNG at ``path`` (its folder made if need be)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    return path


# -- the shared habits ----------------------------------------------------------------


def integer_ticks(*axes: Axes, axis: str = "x") -> None:
    """Ticks on whole numbers only along ``axis`` (steps and versions are counts)."""
    for ax in axes:
        # The default locator's steps (MaxNLocator's own would allow 6: ticks at 0, 60, 120).
        locator = MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10])
        (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(locator)


def shade_warm_start(axes: Iterable[Axes], warmup_steps: int) -> None:
    """Shade steps (or the versions they produce) 1..``warmup_steps`` in every panel;
    only the first carries the legend label. Nothing when the run has no warm start."""
    if warmup_steps <= 0:
        return
    for i, ax in enumerate(axes):
        # Half a step either side: the span covers exactly the points of steps 1..warmup.
        label = WARM_START_LABEL if i == 0 else "_nolegend_"
        ax.axvspan(0.5, warmup_steps + 0.5, color=WARM_START_COLOR, zorder=0, label=label)


def smoothing_window(n: int) -> int:
    """An odd window of about a twelfth of the series, at least 5 points where the
    series has 20 (1: too short to smooth)."""
    if n < 8:
        return 1
    return max(3, min(n // 4, max(5, n // 12))) | 1


def rolling_mean(values: Sequence[float], window: int) -> list[float]:
    """Centred rolling mean; near the ends the window holds the points there are."""
    half = window // 2
    out = []
    for i in range(len(values)):
        part = values[max(0, i - half) : i + half + 1]
        out.append(sum(part) / len(part))
    return out


def plot_smoothed(ax: Axes, points: Series, label: str, color: str) -> None:
    """``points`` faint, a centred rolling mean over them; a short series plainly."""
    if not points:
        return
    xs, ys = zip(*points, strict=True)
    window = smoothing_window(len(points))
    if window == 1:
        ax.plot(xs, ys, marker="o", color=color, label=label)
        return
    ax.plot(xs, ys, marker=".", markersize=3, lw=0.8, color=color, alpha=0.3, label=label)
    smooth = rolling_mean(ys, window)
    ax.plot(xs, smooth, lw=2, color=color, label=f"centred rolling mean, {window} steps")


def line(ax: Axes, points: Series, label: str, marker: str = ".", **kw: Any) -> None:
    """One plain line, when there are points."""
    if points:
        kw.setdefault("markersize", 3 if len(points) > 60 else 6)  # dense series: small marks
        ax.plot(*zip(*points, strict=True), marker=marker, label=label, **kw)


def note(ax: Axes, text: str) -> None:
    """A panel with no data says why instead of drawing empty axes."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")


# -- which numbers (pure) --------------------------------------------------------------


def is_sft(curves: MetricCurves, step: int) -> bool:
    """Whether ``step`` trained a warm-start batch: the orchestrator's ``sft`` flag, else
    (no orchestrator metrics for the step) its place in the warm start."""
    row = curves.train.get(step)
    if row is not None and "sft" in row:
        return bool(row["sft"])
    return step <= curves.warmup_steps


def rl_reward(curves: MetricCurves) -> Series:
    """Batch-mean reward of the RL batches (a warm-start batch holds the teacher's
    answers, reward 1 by construction: it would say nothing about the policy)."""
    return [
        (k, v) for k, v in curves.series(curves.train, "reward_mean") if not is_sft(curves, int(k))
    ]


def loss_series(curves: MetricCurves) -> tuple[Series, Series]:
    """(SFT loss, RL loss) per trainer step; see the module docstring for which is which."""
    sft: Series = []
    rl: Series = []
    for step, row in sorted(curves.trainer.items()):
        if "loss" not in row:
            continue
        if is_sft(curves, step):
            sft.append((step, row["loss"]))
            continue
        rl.append((step, row.get("loss_rl", row["loss"])))
        if row.get("ce_tokens", 0) > 0 and "loss_ce" in row:
            sft.append((step, row["loss_ce"]))
    return sft, rl


# -- the four panels both pictures open with --------------------------------------------


def draw_learning_panels(
    curves: MetricCurves, reward: Axes, evals: Axes, sft: Axes, rl: Axes
) -> list[Axes]:
    """Train reward, eval reward, SFT loss and RL loss; returns the four panels."""
    plot_smoothed(reward, rl_reward(curves), "RL batch mean (per step)", color="C0")
    reward.set(title="train reward", xlabel=STEP, ylabel="reward (batch mean)")
    if not reward.lines:
        note(reward, "no RL batch yet")

    scores: list[float] = []
    for i, key in enumerate(curves.eval_keys()):
        points = curves.series(curves.eval, key)
        scores += [v for _, v in points]
        # Each later curve smaller and on top: equal scores (avg@1 = pass@1) stay visible.
        marks: dict[str, Any] = {
            "marker": "osD^v"[i % 5],
            "markersize": max(3, 8 - 2 * i),
            "zorder": 2 + i,
        }
        errors = [curves.stderr(key, int(v)) for v, _ in points]
        if any(e is not None for e in errors):
            error_bars(evals, points, [e or 0.0 for e in errors], key, color=f"C{i + 1}", **marks)
        else:
            line(evals, points, key, color=f"C{i + 1}", **marks)
    evals.set(title="eval reward", xlabel=VERSION, ylabel="score (avg@k / pass@k)")
    if not scores:
        note(evals, "no eval yet")
    elif min(scores) >= 0:
        # Scores of 0 sit just above the floor, not mid-panel under a negative half.
        evals.set_ylim(bottom=-0.04 * max(evals.get_ylim()[1], 1e-9))

    sft_loss, rl_loss = loss_series(curves)
    line(sft, sft_loss, "cross-entropy", color="C3")
    sft.set(title="SFT loss", xlabel=STEP, ylabel="cross-entropy (nats/token)")
    if not sft_loss:
        note(sft, "no SFT step" if curves.warmup_steps == 0 else "no SFT step yet")
    plot_smoothed(rl, rl_loss, "policy-gradient loss (per step)", color="C4")
    rl.set(title="RL loss", xlabel=STEP, ylabel="policy-gradient loss")
    if not rl_loss:
        note(rl, "no RL step yet")
    if warm_start_only(sft_loss, curves.warmup_steps):
        w = curves.warmup_steps
        sft.set(title="SFT loss (warm start, " + (f"steps 1-{w})" if w > 1 else "step 1)"))
        sft.set_xlim(0.5, w + 0.5)
        if w <= 10:  # a tick per step (the locator falls back to fractions under two)
            sft.set_xticks(range(1, w + 1))
        else:
            integer_ticks(sft)
        return [reward, evals, rl]  # the SFT panel keeps its own x range
    return [reward, evals, sft, rl]


def warm_start_only(sft_loss: Series, warmup_steps: int) -> bool:
    """Whether every SFT step is a warm-start step (none in RL: no tool SFT), so the SFT
    panel needs only the warm start's x range."""
    return warmup_steps > 0 and bool(sft_loss) and all(s <= warmup_steps for s, _ in sft_loss)


def error_bars(ax: Axes, points: Series, errors: Sequence[float], label: str, **kw: Any) -> None:
    """A line with a +-``errors`` bar at each point (a standard error)."""
    xs, ys = zip(*points, strict=True)
    kw.setdefault("markersize", 3 if len(points) > 60 else 6)
    ax.errorbar(xs, ys, yerr=errors, label=f"{label} (± stderr)", capsize=3, elinewidth=1, **kw)


def draw_staleness(ax: Axes, mean: Series, most: Series) -> None:
    """Staleness per step: the max as a shaded step band (each step's value held across
    it), the mean as a line over it; integer y ticks (versions are counts)."""
    if most:
        xs, ys = zip(*most, strict=True)
        ax.fill_between(xs, ys, step="mid", color="C1", alpha=0.25, lw=0, label="max")
        ax.step(xs, ys, where="mid", color="C1", lw=0.8)
    line(ax, mean, "mean", color="C0")
    ax.set(title="staleness", xlabel=STEP, ylabel="policy versions behind")
    if not (mean or most):
        note(ax, "no RL batch yet")
    ax.set_ylim(bottom=0)
    integer_ticks(ax, axis="y")


def step_axes(axes: Sequence[Axes], warmup_steps: int) -> None:
    """What every step or version panel of a figure gets: one shared x range, integer
    ticks, the warm start shaded (labelled on the first)."""
    for ax in axes[1:]:
        ax.sharex(axes[0])
    integer_ticks(*axes)
    shade_warm_start(axes, warmup_steps)
