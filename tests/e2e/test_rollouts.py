"""`rlbus rollout` end to end: embedded NATS, the real inference and env role processes."""

from __future__ import annotations

import asyncio
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bus.reader import read_log
from bus.runtime import Bus
from bus.server import EmbeddedServer, running_server_url
from bus.subjects import Topic
from roles.up.processes import PYTHON
from schemas import TraceCompleted
from tests.samples import user_dir

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]


def rlbus_rollout(data_dir: Path, run: str, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "roles.cli", "rollout", "--run", run, *args, f"bus.data_dir={data_dir}"]  # fmt: skip
    # cwd = the repo, so `examples.*` import paths resolve in the role processes too.
    return subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=REPO)


async def traces_on_stream(data_dir: Path, run: str) -> list[TraceCompleted]:
    """Every TraceCompleted in the run's log (reopening its stopped embedded server)."""
    with EmbeddedServer(data_dir / run / "nats") as server:
        bus = await Bus.connect(server.url, run=run, producer="e2e")
        try:
            topics = [(Topic.TRACE_COMPLETED, None)]
            return [e async for e in read_log(bus, topics, (TraceCompleted,))]
        finally:
            await bus.close()


async def test_rollout_command_runs_and_summarises(tmp_path: Path) -> None:
    """`rlbus rollout --env reverse-text -n 8 --group-size 4` starts what it needs, prints the
    summary and a rendered trace, stops its processes and server, and leaves 8 aligned traces."""
    proc = await asyncio.to_thread(rlbus_rollout, tmp_path, "ro1", "--env", "reverse-text", "-n", "8", "--group-size", "4")  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-4000:] + out[-2000:]
    assert "rollouts: 8" in out and "errors: none" in out
    reward = float(re.search(r"mean reward: ([\d.]+)", out).group(1))  # type: ignore[union-attr]
    assert 0.0 <= reward <= 1.0
    assert re.search(r"mean completion tokens: [\d.]+", out)
    assert "[system] 'Reverse the text.'" in out and "[assistant]" in out and "completion (" in out
    for name in ("inference-policy", "env-reverse-text"):
        assert f"stopped {name} (exit 0)" in proc.stderr  # drained on SIGTERM, not killed
        assert (tmp_path / "ro1" / "logs" / f"{name}.log").exists()
    assert (tmp_path / "ro1" / "config.toml").exists()
    assert running_server_url(tmp_path / "ro1" / "nats") is None  # the server it started is gone
    events = await traces_on_stream(tmp_path, "ro1")
    assert len({e.trace.rollout_id for e in events}) == 8 and len(events) == 8
    assert len({e.request_id for e in events}) == 2
    for e in events:
        assert e.trace.ok and e.env == "reverse-text"
        ids, sampled, lps, _ = e.trace.branch_tokens(e.trace.branches[0])
        assert len(ids) == len(sampled) == len(lps) and sampled.any()


@pytest.mark.slow
async def test_rollout_command_with_custom_env_by_import_path(tmp_path: Path) -> None:
    """A user env given as `module:function` runs through the real role processes (its bus key
    is a valid subject token) and is scored by its own rubric, started as a prime-rl user
    would start it: from their own directory, beside a `configs/` folder of TOML files and
    folders named like rlbus's other packages, with the env in `my_env.py` there."""
    work = user_dir(tmp_path)
    # As the `rlbus` script imports (the working directory not first on the path).
    cmd = [*PYTHON, "-m", "roles.cli", "rollout", "--run", "ro2", "--env", "my_env:make_env",
           "-n", "2", "--group-size", "2", f"bus.data_dir={tmp_path}"]  # fmt: skip
    run = functools.partial(subprocess.run, capture_output=True, text=True, timeout=280)
    proc = await asyncio.to_thread(run, cmd, cwd=work)
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    assert "rollouts: 2" in proc.stdout and "[system] 'Count the words.'" in proc.stdout
    events = await traces_on_stream(tmp_path, "ro2")
    assert len(events) == 2 and {e.env for e in events} == {"my_env-make_env"}
    assert all(e.trace.ok for e in events)
