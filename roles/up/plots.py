"""Curves of a run: train reward, eval reward, loss (matplotlib, written to PNG).

Drawn from the monitor's metric tables (``roles.lib.curves.MetricCurves``, the fold
``rlbus plot`` draws its six panels from).
"""

from __future__ import annotations

from pathlib import Path

from roles.lib.curves import MetricCurves


def plot_curves(monitor: MetricCurves, path: Path) -> Path | None:
    """Three panels side by side; returns None when there is nothing to plot yet."""
    if not monitor.train and not monitor.eval:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    # Warm-start batches hold the teacher's answers (reward 1 by construction): plot RL only.
    reward = [
        (k, v)
        for k, v in monitor.series(monitor.train, "reward_mean")
        if not monitor.train[int(k)].get("sft")
    ]
    if reward:
        axes[0].plot(*zip(*reward, strict=True), marker=".", label="train reward (RL batch mean)")
    warm = monitor.warmup_steps
    for ax in axes[:2]:
        if warm:
            ax.axvspan(0, warm, color="0.9", label="SFT warm start")
    axes[0].set(title="train reward", xlabel="step")
    for key in monitor.eval_keys():
        pts = monitor.series(monitor.eval, key)
        axes[1].plot(*zip(*pts, strict=True), marker="o", label=key)
    axes[1].set(title="eval reward", xlabel="policy version")
    loss = monitor.series(monitor.trainer, "loss")
    if loss:
        axes[2].plot(*zip(*loss, strict=True), marker=".", color="C3")
    axes[2].set(title="trainer loss", xlabel="step")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"rlbus run {monitor.run}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
