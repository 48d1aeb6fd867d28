"""Ctrl-C's pure parts: segments of ``summary.json`` (each launch of a run, ``rlbus up``
then each ``--resume``, reported apart; the totals never mix throughput across a pause),
the order the roles stop in, and the command the report gives to go on."""

from __future__ import annotations

from pathlib import Path

import pytest

from configs.paths import DATA_DIR_ENV, RunPaths
from roles.up.monitor import RunMonitor, earlier_segments, segment_totals
from roles.up.processes import RoleProcess
from roles.up.supervisor import INTERRUPT_ORDER, resume_command, stop_groups
from schemas import MetricsReported, WeightsPublished
from schemas.run import ObjectRef

S = 1_000_000_000  # ns per second


def trained(m: RunMonitor, steps: range, seq: int, tokens_per_s: float = 100.0) -> int:
    """Fold a batch report, trainer metrics and weights for each step, from stream
    sequence ``seq`` on (as the launcher's follower does); the next free sequence."""
    for step in steps:
        for event in (
            MetricsReported(run="r", role="orchestrator", step=step, values={"reward_mean": 0.5}),
            MetricsReported(run="r", role="trainer", step=step, values={"tokens_per_s": tokens_per_s}),
            WeightsPublished(
                run="r", version=step, step=step,
                weights=ObjectRef(kind="object", location=f"w{step}", digest=f"d{step}"),
            ),
        ):  # fmt: skip
            m.passed(seq)
            m.apply(event)
            seq += 1
    return seq


def rolled_out(m: RunMonitor, n: int, seq: int, start_s: float, every_s: float) -> int:
    """``n`` train rollouts stored ``every_s`` apart from ``start_s`` (server time)."""
    for i in range(n):
        m.trace_completed(seq=seq + i, ts_ns=int((start_s + i * every_s) * S))
    return seq + n


def test_a_first_launch_is_one_segment_with_its_own_rate() -> None:
    m = RunMonitor(run="r", max_steps=10)
    seq = rolled_out(m, 11, 1, start_s=100.0, every_s=1.0)  # 11 rollouts over 10 s
    trained(m, range(1, 4), seq)
    m.finish("max_steps", end_seq=50)
    (segment,) = m.summary()["segments"]
    assert segment["start_step"] == 0 and segment["end_step"] == 3 and segment["steps"] == 3
    assert segment["rollouts"] == 11 and segment["active_s"] == 10.0
    assert segment["rollouts_per_s"] == 1.1
    assert segment["trainer_tokens_per_s"] == 100.0
    assert segment["ended"] == "max_steps" and segment["end_seq"] == 50


def test_a_resumed_launch_reports_both_segments_and_totals_over_active_time() -> None:
    """The earlier launch's rollouts, read back at start, are neither this launch's nor in
    its rate; the totals add the active times, not the pause between them."""
    first = {
        "start_step": 0, "end_step": 3, "steps": 3, "wall_s": 60.0, "active_s": 10.0,
        "rollouts": 20, "rollouts_per_s": 2.0, "trainer_tokens_per_s": 100.0,
        "ended": "interrupted by SIGINT", "end_seq": 40,
    }  # fmt: skip
    m = RunMonitor(run="r", max_steps=10, resume_seq=40, covered_seq=40, earlier=[first])
    seq = rolled_out(m, 20, 1, start_s=0.0, every_s=0.5)  # the first launch's, read back
    seq = trained(m, range(1, 4), seq)
    assert seq <= 40
    # An hour later: 41 rollouts over 20 s at a different trainer speed.
    seq = rolled_out(m, 41, 41, start_s=3600.0, every_s=0.5)
    trained(m, range(4, 7), seq, tokens_per_s=300.0)
    m.finish("max_steps", end_seq=200)
    summary = m.summary()
    earlier, now = summary["segments"]
    assert earlier == first
    assert now["start_step"] == 3 and now["end_step"] == 6 and now["steps"] == 3
    assert now["rollouts"] == 41 and now["active_s"] == 20.0 and now["rollouts_per_s"] == 2.05
    assert now["trainer_tokens_per_s"] == 300.0
    assert summary["steps"] == 6 and summary["rollouts"] == 61
    assert summary["active_s"] == 30.0
    assert summary["rollouts_per_s"] == round(61 / 30.0, 2)  # not over the hour between
    assert summary["wall_s"] == round(60.0 + now["wall_s"], 1)


def test_a_launch_that_wrote_no_summary_is_rebuilt_from_the_log() -> None:
    """Killed (SIGKILL) before its summary: what lies between the last recorded segment
    and this launch's start is one segment, its steps and rollouts read from the log."""
    first = {"start_step": 0, "end_step": 2, "steps": 2, "rollouts": 10, "active_s": 5.0,
             "end_seq": 30}  # fmt: skip
    m = RunMonitor(run="r", max_steps=10, resume_seq=90, covered_seq=30, earlier=[first])
    seq = rolled_out(m, 10, 1, start_s=0.0, every_s=0.5)
    trained(m, range(1, 3), seq)
    seq = rolled_out(m, 9, 31, start_s=500.0, every_s=1.0)  # the killed launch
    trained(m, range(3, 6), seq)
    seq = rolled_out(m, 3, 91, start_s=900.0, every_s=1.0)  # this one
    m.finish("interrupted by SIGINT", end_seq=95)
    recorded, killed, now = m.summary()["segments"]
    assert recorded == first
    assert (killed["start_step"], killed["end_step"], killed["rollouts"]) == (2, 5, 9)
    assert killed["active_s"] == 8.0 and killed["wall_s"] is None
    assert (now["start_step"], now["end_step"], now["rollouts"]) == (5, 5, 3)
    assert now["ended"] == "interrupted by SIGINT"


def test_a_summary_from_before_segments_becomes_one_segment() -> None:
    old = {"steps": 4, "wall_s": 30.0, "rollouts": 12, "rollouts_per_s": 0.5,
           "stopped": None, "interrupted": "SIGINT"}  # fmt: skip
    (segment,) = earlier_segments(old)
    assert (segment["start_step"], segment["end_step"], segment["rollouts"]) == (0, 4, 12)
    assert segment["ended"] == "interrupted by SIGINT" and segment["end_seq"] is None
    assert earlier_segments(None) == []


def test_totals_leave_out_what_no_segment_timed() -> None:
    timed = {"rollouts": 30, "active_s": 10.0, "wall_s": 12.0}
    untimed = {"rollouts": 50, "active_s": None, "wall_s": None}
    totals = segment_totals([timed, untimed])
    assert totals == {"wall_s": 12.0, "active_s": 10.0, "rollouts_per_s": 3.0}


def test_a_resumed_runs_rate_counts_what_can_train_over_every_active_second() -> None:
    """As a single launch's rate: the orchestrator's trainable count (its fold spans
    every segment) over the segments' active time, not the completed (errored too)."""
    first = {"rollouts": 40, "active_s": 10.0, "wall_s": 12.0}
    second = {"rollouts": 40, "active_s": 10.0, "wall_s": 11.0}
    totals = segment_totals([first, second], trainable=60)
    assert totals == {"wall_s": 23.0, "active_s": 20.0, "rollouts_per_s": 3.0}


def test_ctrl_c_stops_dispatch_training_and_rollouts_together_and_inference_after() -> None:
    """On Ctrl-C the orchestrator, the trainer, the env servers and the algorithms stop
    at once; what they call (inference, the teacher) after them; the rest last."""
    names = ["orchestrator", "trainer", "inference-policy-0", "teacher-teacher",
             "env-reverse-text", "env-reverse-text-1", "algorithm-grpo", "lake"]  # fmt: skip
    roles = [RoleProcess(n, [], Path(f"{n}.log")) for n in names]
    groups = [[r.name for r in g] for g in stop_groups(roles, INTERRUPT_ORDER)]
    assert groups == [
        ["orchestrator", "trainer", "env-reverse-text", "env-reverse-text-1", "algorithm-grpo"],
        ["inference-policy-0", "teacher-teacher"],
        ["lake"],
    ]


def test_the_resume_command_names_the_data_dir_only_when_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(DATA_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert resume_command(RunPaths(Path("runs"), "demo")) == "rlbus up --run demo --resume"
    elsewhere = RunPaths(tmp_path / "data", "demo")
    assert (
        resume_command(elsewhere)
        == f"rlbus up --run demo --resume bus.data_dir={tmp_path / 'data'}"
    )
    monkeypatch.setenv(DATA_DIR_ENV, str(tmp_path / "data"))
    assert resume_command(elsewhere) == "rlbus up --run demo --resume"
