"""The run monitor's fold and the live view's rendering, without processes."""

from __future__ import annotations

from dataclasses import dataclass
from io import StringIO
from pathlib import Path

from rich.console import Console

from roles.up.monitor import RunMonitor, sparkline
from roles.up.plots import plot_curves
from roles.up.processes import RoleProcess
from roles.up.view import LiveView
from schemas import (
    MetricsReported,
    RunStarted,
    RunStopped,
    WeightsPublished,
    run_started_id,
    run_stopped_id,
)
from schemas.run import ObjectRef


def fed_monitor() -> RunMonitor:
    m = RunMonitor(run="r", max_steps=4)
    m.apply(
        RunStarted(
            run="r",
            event_id=run_started_id("r"),
            config={"orchestrator": {"warmup": {"steps": 2}}},
            seed=0,
            model_path="m",
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
    m.apply(RunStopped(run="r", event_id=run_stopped_id("r"), reason="max_steps", step=4))
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


def test_the_phase_is_told_as_it_is() -> None:
    """Starting until run.started, the warm start while its batches are assembled, then RL."""
    m = RunMonitor(run="r", max_steps=4, warmup_steps=2)
    assert m.phase_label() == "starting"
    m.apply(RunStarted(run="r", event_id=run_started_id("r"), config={"orchestrator": {"warmup": {"steps": 2}}}, seed=0, model_path="m"))  # fmt: skip
    assert m.phase_label() == "warm start (sft)"
    m.apply(MetricsReported(run="r", role="orchestrator", step=2, values={"sft": 1.0}))
    assert m.phase_label() == "warm start (sft)"
    m.apply(MetricsReported(run="r", role="orchestrator", step=3, values={"sft": 0.0}))
    m.apply(MetricsReported(run="r", role="orchestrator", step=2, values={"sft": 1.0}))  # late
    assert m.phase_label() == "rl"
    m.apply(RunStopped(run="r", event_id=run_stopped_id("r"), reason="max_steps", step=4))
    assert m.phase_label() == "stopped (max_steps)"
    no_warm_start = RunMonitor(run="r", max_steps=4)
    no_warm_start.apply(
        RunStarted(run="r", event_id=run_started_id("r"), config={}, seed=0, model_path="m")
    )
    assert no_warm_start.phase_label() == "rl"


def test_rollouts_count_train_traces_and_eval_traces_apart() -> None:
    m = RunMonitor(run="r", max_steps=4, eval_k=4)
    m.trace_completed(3)
    m.eval_completed(2)
    s = m.summary()
    assert s["rollouts"] == 3 and s["eval_rollouts"] == 8


@dataclass
class FakeRole:
    name: str
    alive: bool = True
    restarts: int = 0
    retiring_since: float | None = None


def test_the_view_shows_roles_draining_while_they_stop(capsys) -> None:  # noqa: ANN001
    roles = [FakeRole("orch", alive=False), FakeRole("env-x")]
    view = LiveView(fed_monitor(), roles, enabled=False)
    view.stopping("max_steps")
    view.role_state("orch", "stopped (exit 0, 0.4s)")
    view.role_state("env-x", "draining")
    assert view.phase_text() == "stopping (max_steps): draining env-x"
    console = Console(file=StringIO(), width=120)
    console.print(view.render())
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "draining" in text and "stopped (exit 0, 0.4s)" in text
    out = capsys.readouterr().out
    assert "[rlbus] stopping (max_steps)" in out and "[rlbus]   env-x: draining" in out
    roles[1].alive = False
    assert view.phase_text() == "stopped (max_steps): every role stopped"


def test_plain_mode_prints_the_phase_when_it_changes(capsys) -> None:  # noqa: ANN001
    m = RunMonitor(run="r", max_steps=4, warmup_steps=1)
    view = LiveView(m, [], enabled=False)
    view.refresh()
    view.refresh()
    m.apply(RunStarted(run="r", event_id=run_started_id("r"), config={"orchestrator": {"warmup": {"steps": 1}}}, seed=0, model_path="m"))  # fmt: skip
    view.refresh()
    out = capsys.readouterr().out
    assert out.count("[rlbus] phase: starting") == 1
    assert "[rlbus] phase: warm start (sft)" in out


def test_the_final_report_is_readable_lines(tmp_path: Path) -> None:
    """How the run ended, steps, eval start -> after warm start -> final, counts, files."""
    m = fed_monitor()
    m.trace_completed(24)
    m.eval_completed(3)
    view = LiveView(m, [], enabled=False)
    summary = m.summary() | {"restarts": {"trainer": 1}}
    report = view.final_report(summary, tmp_path / "summary.json", None, tmp_path / "logs")
    lines = [" ".join(line.split()) for line in report.splitlines()]  # alignment aside
    assert lines[0] == "rlbus run r"
    assert "result stopped: max_steps" in lines
    assert "steps 4/4 trained (2 warm start, 2 rl) wall 0s" in lines
    assert (
        "eval env/avg@1 0.100 at start -> 0.200 after warm start (v2) -> 0.500 final (v4)" in lines
    )
    assert "rollouts 24 train, 3 eval (3 eval tasks x k=1)" in lines
    assert "restarts trainer 1" in lines and f"logs {tmp_path}/logs/<role>.log" in lines
    col = report.splitlines()[1].index("stopped")  # every value starts in this column
    assert all(
        line[col - 2 : col] == "  " != line[col - 1 : col + 1] for line in report.splitlines()[1:]
    )
    assert "{" not in report  # no raw dict


def test_the_final_report_of_a_failed_run_names_the_error(tmp_path: Path) -> None:
    m = RunMonitor(run="r", max_steps=4)
    failed = "trainer died 6 times; last: ModelNotFound: model path does not exist: x (exit 1)"
    summary = m.summary() | {"failed": failed, "restarts": {}}
    report = LiveView(m, [], enabled=False).final_report(summary, tmp_path / "s.json", None)
    lines = [" ".join(line.split()) for line in report.splitlines()]
    assert f"result FAILED: {failed}" in lines and "restarts none" in lines


@dataclass
class FakePools:
    table: list[tuple[str, str, str]]

    def rows(self) -> list[tuple[str, str, str]]:
        return self.table


def test_the_live_view_shows_each_pool_and_a_retiring_replica() -> None:
    """Replicas (with an elastic pool's bounds) and load per pool; a replica its pool
    retired reads ``retiring`` until it has drained and left."""
    retiree = FakeRole("env-x-1", retiring_since=1.0)
    view = LiveView(fed_monitor(), [FakeRole("env-x"), retiree], enabled=False)
    view.pools = FakePools(
        [("env-x", "2 (1..3)", "backlog 37 (16 in flight)"), ("inference-policy", "1", "busy 40%")]
    )
    console = Console(file=StringIO(), width=120)
    console.print(view.render())
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "2 (1..3)" in text and "backlog 37 (16 in flight)" in text and "busy 40%" in text
    assert "retiring" in text


def test_the_monitor_keeps_each_inference_replicas_last_busy_share() -> None:
    """The inference pool's signal: the newest ``busy_frac`` each replica reported."""
    m = RunMonitor(run="r", max_steps=4)
    for busy, ts in ((0.5, 1), (0.9, 2)):
        m.apply(
            MetricsReported(
                run="r", role="inference", step=0, values={"busy_frac": busy}, ts_ns=ts,
                producer="inference-policy-h-7",
            )
        )  # fmt: skip
    m.apply(MetricsReported(run="r", role="inference", step=0, values={}, producer="x-8"))
    assert m.busy == {"inference-policy-h-7": (2, 0.9)}
