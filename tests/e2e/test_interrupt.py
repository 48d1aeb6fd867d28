"""Ctrl-C on ``rlbus up`` pauses the run at once, and ``--resume`` finishes it.

A real launcher on the smoke preset gets SIGINT once its trainer has stepped: the
trainer finishes at most the step it is on (and checkpoints), the report names the
command that continues the run, and that command, run as printed, trains the run to
``max_steps``; its ``summary.json`` reports the two launches as two segments.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import rlbus_up, summary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 12


def logged(log: Path, event: str) -> list[dict[str, object]]:
    """The JSON lines of ``log`` (a role's log under ``runs/<run>/logs``) for ``event``."""
    if not log.exists():
        return []
    lines = [line for line in log.read_text(errors="replace").splitlines() if event in line]
    return [json.loads(line) for line in lines if line.startswith("{")]


async def trainer_stepped(log: Path, proc: subprocess.Popen[str], step: int) -> int:
    """Wait until the trainer logged ``step``: the newest step it logged by then."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        steps = [int(e["step"]) for e in logged(log, '"trainer.step"')]  # type: ignore[call-overload]
        if steps and max(steps) >= step:
            return max(steps)
        await asyncio.sleep(0.1)
    raise AssertionError(f"the trainer did not reach step {step}: {proc.poll()=}")


async def test_ctrl_c_stops_training_at_once_and_resume_finishes_in_two_segments(
    tmp_path: Path,
) -> None:
    run = "paused"
    launcher = rlbus_up(tmp_path, run, f"max_steps={STEPS}")
    trainer_log = tmp_path / run / "logs" / "trainer.log"
    before = await trainer_stepped(trainer_log, launcher, 3)
    launcher.send_signal(signal.SIGINT)
    out, _ = await asyncio.to_thread(launcher.communicate, timeout=120)
    assert launcher.returncode == 130, out[-3000:]

    # Training stopped at once: the step in progress at most (and one whose log line
    # was on its way), never the batches the orchestrator had queued.
    paused = summary(tmp_path, run)
    assert before <= paused["steps"] <= before + 2, (before, paused["steps"])
    (first,) = paused["segments"]
    assert first["end_step"] == paused["steps"] and first["ended"] == "interrupted by SIGINT"
    resume = paused["resume"]
    assert resume.startswith(f"rlbus up --run {run} --resume")
    assert f"interrupted (SIGINT) at step {paused['steps']}; continue with: {resume}" in out

    # The printed command continues the run; the trainer starts from the checkpoint the
    # interrupted one wrote at its last step.
    cmd = [sys.executable, "-m", "roles.cli", *shlex.split(resume)[1:], "--no-view"]
    done = await asyncio.to_thread(subprocess.run, cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    loaded = logged(trainer_log, '"trainer.loaded"')
    assert len(loaded) == 2 and loaded[1]["step"] == paused["steps"], loaded
    result = summary(tmp_path, run)
    assert result["stopped"]["reason"] == "max_steps" and result["steps"] == STEPS
    assert "resume" not in result
    earlier, resumed = result["segments"]
    assert earlier == first
    assert resumed["start_step"] == first["end_step"] and resumed["end_step"] == STEPS
    assert resumed["ended"] == "max_steps"
    # The resumed launch counts its own rollouts, and the run's rate is over the two
    # launches' active time, not over the pause between them.
    assert resumed["rollouts"] == result["rollouts"] - first["rollouts"] > 0
    active = first["active_s"] + resumed["active_s"]
    assert result["active_s"] == pytest.approx(active, abs=0.1)
    assert result["rollouts_per_s"] == pytest.approx(result["rollouts"] / active, rel=0.02)
