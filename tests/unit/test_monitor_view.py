"""The run monitor's fold and the live view's rendering, without processes."""

from __future__ import annotations

from io import StringIO
from pathlib import Path

from rich.console import Console

from roles.up.monitor import RunMonitor, sparkline
from roles.up.plots import plot_curves
from roles.up.processes import RoleProcess
from roles.up.view import LiveView
from schemas import MetricsReported, RunStarted, RunStopped, WeightsPublished
from schemas.run import ObjectRef


def fed_monitor() -> RunMonitor:
    m = RunMonitor(run="r", max_steps=4)
    m.apply(
        RunStarted(
            run="r", config={"orchestrator": {"warmup": {"steps": 2}}}, seed=0, model_path="m"
        )
    )
    for step in range(1, 5):
        m.apply(
            MetricsReported(
                run="r",
                role="orchestrator",
                step=step,
                values={"reward_mean": step / 10, "sft": float(step <= 2)},
            )
        )
        m.apply(
            MetricsReported(
                run="r",
                role="trainer",
                step=step,
                values={"loss": 1 / step, "tokens_per_s": 1000.0},
            )
        )
        m.apply(
            WeightsPublished(
                run="r",
                version=step,
                step=step,
                weights=ObjectRef(kind="object", location=f"w{step}", digest=f"d{step}"),
            )
        )
    for version, score in ((0, 0.1), (2, 0.2), (4, 0.5)):
        m.apply(MetricsReported(run="r", role="eval", step=version, values={"env/avg@1": score}))
    m.apply(RunStopped(run="r", reason="max_steps", step=4))
    return m


def test_summary_reports_the_gain_of_rl_over_the_warm_start() -> None:
    """The summary compares eval right after the warm start with the final eval."""
    s = fed_monitor().summary()
    assert s["env/avg@1:after_warm_start"] == 0.2 and s["env/avg@1:final"] == 0.5
    assert s["env/avg@1:gain"] == 0.3
    assert s["steps"] == 4 and s["final_weights_digest"] == "d4"
    assert s["stopped"] == {"reason": "max_steps", "detail": ""}


def test_live_view_renders_step_rewards_and_roles(tmp_path: Path) -> None:
    """The rich panel shows the step, the eval score and each role's health."""
    roles = [RoleProcess("trainer", ["true"], tmp_path / "t.log")]
    view = LiveView(fed_monitor(), roles, enabled=False)
    console = Console(file=StringIO(), width=120)
    console.print(view.render())
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "4/4" in text and "env/avg@1" in text and "0.500" in text and "trainer" in text


def test_plain_mode_prints_one_line_per_trained_step(capsys) -> None:  # noqa: ANN001
    view = LiveView(fed_monitor(), [], enabled=False)
    view.refresh()
    out = capsys.readouterr().out
    assert out.count("[rlbus] step") == 4 and "eval at policy v4" in out


def test_curves_are_written(tmp_path: Path) -> None:
    path = plot_curves(fed_monitor(), tmp_path / "c.png")
    assert path is not None and path.stat().st_size > 10_000


def test_sparkline_spans_the_range() -> None:
    assert sparkline([0, 1]) == "▁█" and sparkline([]) == ""
