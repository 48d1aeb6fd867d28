"""A run id is never destroyed and a launcher leaves nothing behind, however it ends.

Real ``rlbus up`` processes on the smoke preset: a second launcher on a live run is
refused and the first completes intact; a finished run is refused without a flag; the
launcher killed with SIGHUP, SIGTERM or SIGKILL leaves no role and no nats-server alive;
an interrupted run resumes with ``--resume`` and finishes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import rlbus_up, summary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 30  # the signal lands as the roles start, long before the last step


def processes_under(data_dir: Path) -> list[str]:
    """Command lines of live processes that name ``data_dir`` (roles pass it as
    --data-dir, the nats-server its store)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().split()[2]
        except OSError:
            continue
        if str(data_dir) in cmd and state != "Z":  # a zombie has exited already
            found.append(cmd)
    return found


async def wait_for_roles(data_dir: Path, run: str, proc: subprocess.Popen[str]) -> None:
    """Until every role the launcher started (6 at least, the trainer and the
    orchestrator among them) has logged ``role.started``. A role still importing when
    the launcher stops it dies of the signal before it has a log line to write."""
    logs = data_dir / run / "logs"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        roles = {p.stem: p for p in logs.glob("*.log") if p.stem != "launcher"}
        started = ['"role.started"' in log.read_text(errors="replace") for log in roles.values()]
        if len(roles) >= 6 and {"trainer", "orchestrator"} <= set(roles) and all(started):
            return
        await asyncio.sleep(0.5)
    raise AssertionError(f"roles of {run} did not start: {proc.poll()=}")


def up(
    data_dir: Path, run: str, *args: str, preset: str | None = "smoke", timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Another ``rlbus up`` (``preset`` None: no ``-c``, as ``--resume`` wants)."""
    cmd = [sys.executable, "-m", "roles.cli", "up", "--no-view", "--run", run]
    cmd += ["-c", preset] if preset else []
    return subprocess.run(
        [*cmd, f"bus.data_dir={data_dir}", *args], capture_output=True, text=True, timeout=timeout
    )


def one_line_refusal(done: subprocess.CompletedProcess[str], says: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr


async def test_a_live_or_finished_run_id_is_refused(tmp_path: Path) -> None:
    run = "guarded"
    first = rlbus_up(tmp_path, run, "max_steps=6")
    await wait_for_roles(tmp_path, run, first)
    one_line_refusal(up(tmp_path, run), "is live")
    out, _ = await asyncio.to_thread(first.communicate, timeout=300)
    assert first.returncode == 0, out[-3000:]
    result = summary(tmp_path, run)
    assert result["stopped"]["reason"] == "max_steps" and result["steps"] == 6
    one_line_refusal(up(tmp_path, run), "already exists: finished (max_steps at step 6)")
    one_line_refusal(up(tmp_path, run, "--resume", preset=None), "nothing to resume")
    assert summary(tmp_path, run) == result  # the refusals touched nothing
    one_line_refusal(up(tmp_path, "typo", "--resume", preset=None), "has no data")
    assert not (tmp_path / "typo").exists()


# SIGTERM and SIGHUP take SIGINT's path (SIGHUP also detaches from a terminal: none here).
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
async def test_a_launcher_leaves_no_process_behind(tmp_path: Path, sig: signal.Signals) -> None:
    run = f"killed-{sig.name.lower()}"
    launcher = rlbus_up(tmp_path, run, f"max_steps={STEPS}")
    await wait_for_roles(tmp_path, run, launcher)
    assert len(processes_under(tmp_path)) >= 6
    launcher.send_signal(sig)
    out, _ = await asyncio.to_thread(launcher.communicate, timeout=120)
    deadline = time.monotonic() + 30
    while processes_under(tmp_path) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    assert processes_under(tmp_path) == []
    if sig == signal.SIGINT:  # Ctrl-C: roles stopped in order, each drained; a summary
        assert launcher.returncode == 130, out[-3000:]
        # every role's log (the launcher's own, logs/launcher.log, is no role's)
        logs = sorted(p for p in (tmp_path / run / "logs").glob("*.log") if p.stem != "launcher")
        assert len(logs) >= 6
        for log in logs:
            assert '"role.stopped"' in log.read_text(), f"{log.name} did not drain"
        assert (tmp_path / run / "summary.json").exists()
    if sig == signal.SIGKILL:  # no drain, no summary: the run is interrupted, and resumes
        refused = up(tmp_path, run, "--resume")  # `up` passes -c smoke
        one_line_refusal(refused, "drop -c and overrides")
        done = await asyncio.to_thread(up, tmp_path, run, "--resume", preset=None, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr
        result = summary(tmp_path, run)
        assert result["stopped"]["reason"] == "max_steps" and result["steps"] == STEPS
