"""The loop profile's picture: one swim lane per role over ~10 steady steps, and CPU.

Top panel: a lane per role process. The trainer's bars are its steps (``step_s``
before each ``weights.published``, from its metrics, labelled with the step); every
other lane shows when the role had more than ``threshold`` of a core busy (from the
/proc samples of ``benchmarks.proc_sampler``). Markers: ``|`` on the orchestrator's
lane where a batch was assembled, ``v`` on the inference lanes where a version went
live. Dotted vertical lines are the step boundaries (weights published). Below: each
role's CPU utilisation (cores busy), then its run-queue wait (its threads runnable but
waiting for a CPU, in cores: contention), over the same window.

    plot_timeline(Path("profile.png"), rows, sampler.series(), title)

``benchmarks.loop_profile`` writes it; matplotlib through ``roles.lib.plotting``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from roles.lib.plotting import finish, new_figure, save

ORDER = ("orchestrator", "env", "inference", "teacher", "algorithm", "trainer", "nats", "launcher")


def lane_order(names: list[str]) -> list[str]:
    """Roles in data-flow order (orchestrator at the top), unknown kinds last."""

    def key(name: str) -> tuple[int, str]:
        kinds = [i for i, k in enumerate(ORDER) if name.startswith(k)]
        return (kinds[0] if kinds else len(ORDER), name)

    return sorted(names, key=key)


def window(rows: list[dict[str, Any]], steps: int = 10) -> list[dict[str, Any]]:
    """``steps`` consecutive published rows from the middle of ``rows``."""
    stamped = [r for r in rows if r["published"] is not None]
    start = max(0, (len(stamped) - steps) // 2)
    return stamped[start : start + steps]


def busy_spans(t: list[float], util: list[float], threshold: float) -> list[tuple[float, float]]:
    """Merged (start, end) spans of the sampling intervals with ``util >= threshold``
    (interval i runs from t[i-1] to t[i])."""
    spans: list[tuple[float, float]] = []
    for i in range(1, len(t)):
        if util[i] < threshold:
            continue
        if spans and spans[-1][1] == t[i - 1]:
            spans[-1] = (spans[-1][0], t[i])
        else:
            spans.append((t[i - 1], t[i]))
    return spans


def plot_timeline(
    path: Path,
    rows: list[dict[str, Any]],
    steady: list[dict[str, Any]],
    series: dict[str, Any],
    title: str,
    threshold: float = 0.25,
) -> Path | None:
    """Draw ~10 steps from the middle of the ``steady`` rows (lanes and CPU panel) to
    ``path``, the bars and marks of every row in view; None when there is no window."""
    shown = window(steady)
    if len(shown) < 2:
        return None
    walls = [r["step_wall"] for r in shown if r.get("step_wall")]
    pad = sum(walls) / len(walls) if walls else 0.2
    t0, t1 = shown[0]["published"] - pad, shown[-1]["published"] + pad / 2
    ts = series["t"]
    inside = [i for i, t in enumerate(ts) if t0 <= t <= t1]
    util, runq = series["util"], series.get("runq", {})
    seen = {n: sum(u[i] for i in inside) / max(len(inside), 1) for n, u in util.items()}
    names = lane_order([n for n, u in seen.items() if u >= 0.01] or ["trainer"])
    idle = sorted(set(util) - set(names))
    colors = {n: f"C{i % 10}" for i, n in enumerate(names)}
    fig = new_figure((13, 2 + 0.5 * len(names) + 5))
    lanes, cpu, queue = fig.subplots(3, 1, sharex=True, height_ratios=[len(names), 4, 2.5])
    x = [t - t0 for t in ts]
    for lane, name in enumerate(names):
        y = len(names) - 1 - lane
        if name == "trainer":
            spans = [
                (r["train_start"], r["published"]) for r in rows if r["train_start"] is not None
            ]
            for r in rows:
                if r["train_start"] is not None and t0 <= r["train_start"] <= t1:
                    mid = (r["train_start"] + r["published"]) / 2 - t0
                    lanes.text(mid, y, str(r["step"]), ha="center", va="center", fontsize=7)
        else:
            spans = busy_spans(ts, util.get(name, []), threshold)
        bars = [(a - t0, b - a) for a, b in spans if b >= t0 and a <= t1]
        lanes.broken_barh(bars, (y - 0.35, 0.7), color=colors[name], alpha=0.75)
        marks = []
        if name == "orchestrator":
            marks = [r["assembled"] for r in rows]
        elif name.startswith("inference"):
            marks = sorted({r["live"] for r in rows if r["live"] is not None})
        marks = [m - t0 for m in marks if t0 <= m <= t1]
        symbol = "|" if name == "orchestrator" else "v"
        lanes.plot(marks, [y + 0.45] * len(marks), symbol, color="k", ms=6, ls="none")
        cpu.plot(x, util.get(name, [0.0] * len(x)), color=colors[name], label=name, lw=1.2)
        if name in runq:
            queue.plot(x, runq[name], color=colors[name], lw=1.0)
    for r in rows:
        if r["published"] is not None and t0 <= r["published"] <= t1:
            for ax in (lanes, cpu, queue):
                ax.axvline(r["published"] - t0, color="0.4", ls=":", lw=0.8)
    lanes.set_yticks(range(len(names)), list(reversed(names)))
    lanes.set_ylim(-0.6, len(names) - 0.2)
    lanes.set_ylabel(f"busy (trainer: steps; others: CPU > {threshold:.0%})")
    cpu.set_ylabel("CPU (cores busy)")
    queue.set_ylabel("waiting for a CPU\n(cores)")
    queue.set_xlabel("seconds (dotted: weights published; | batch assembled; v version live)")
    queue.set_xlim(0, t1 - t0)
    for ax, values in ((cpu, util), (queue, runq)):
        top = max((values[n][i] for n in names if n in values for i in inside), default=1.0)
        ax.set_ylim(0, max(top, 0.1) * 1.1)
    if idle:
        lanes.set_title(f"not drawn, idle here (< 1% of a core): {', '.join(idle)}", fontsize=8)
    finish(fig, title)
    cpu.legend(fontsize=7, ncols=min(len(names), 5), loc="upper right")
    return save(fig, path)
