"""A finished run trains on: ``rlbus up --run R --resume max_steps=N+k`` (real ``rlbus up``
processes on the smoke preset).

The run finishes at 3 steps with a checkpoint every step, the newest one kept and every
2nd step kept for good; a resume that would change the learning rate, or would not raise
max_steps, is refused in one line; ``--resume max_steps=5`` trains steps 4 and 5 from
where the run stopped and exits 0. Its config says 5, its log holds the resumed start (the
changed config, ``resumed=True``) and the new segment's stop, the trainer replays all 5
steps bit for bit, the stride kept steps 2 and 4, and ``rlbus eval --checkpoint R:3``
says in one line which steps exist and which keys keep more.
"""

from __future__ import annotations

import asyncio
import subprocess
import tomllib
from pathlib import Path

import pytest

from bus.server import EmbeddedServer
from configs.paths import RunPaths
from roles.cli.eval import run_checkpoint
from schemas import RunStarted, RunStopped, run_resumed_id, run_stopped_id
from tests.e2e.helpers import all_events, as_launcher, rlbus, rlbus_up, summary

# Two launches, a replay and a refused eval: more than the suite's 300 s on a busy machine.
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(900)]
RUN = "extended"
KEEP = ("trainer.checkpoint_interval=1", "trainer.keep_checkpoints=1",
        "trainer.checkpoint_keep_every=2")  # fmt: skip


def resume(data_dir: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    return rlbus(data_dir, "up", "--no-view", "--run", RUN, "--resume", *overrides, timeout=600)


def one_line_refusal(done: subprocess.CompletedProcess[str], says: str) -> None:
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], done.stderr


def checkpoint_steps(data_dir: Path) -> list[int]:
    folders = RunPaths(data_dir, RUN).checkpoints.glob("step-*")
    return sorted(int(p.name.removeprefix("step-")) for p in folders)


async def test_a_finished_run_trains_on_to_a_raised_max_steps(tmp_path: Path) -> None:
    first = rlbus_up(tmp_path, RUN, "max_steps=3", *KEEP)
    out, _ = await asyncio.to_thread(first.communicate, timeout=600)
    assert first.returncode == 0, out[-3000:]
    done = summary(tmp_path, RUN)
    assert done["stopped"]["reason"] == "max_steps" and done["steps"] == 3
    assert checkpoint_steps(tmp_path) == [2, 3]  # the stride's 2, the newest 3

    one_line_refusal(resume(tmp_path, "trainer.lr=0.1"), "--resume cannot change trainer.lr")
    one_line_refusal(resume(tmp_path, "max_steps=3"), "nothing to resume; raise max_steps above 3")
    assert summary(tmp_path, RUN) == done  # the refusals touched nothing

    extended = await asyncio.to_thread(resume, tmp_path, "max_steps=5")
    assert extended.returncode == 0, extended.stdout[-3000:] + extended.stderr[-3000:]
    result = summary(tmp_path, RUN)
    assert result["stopped"]["reason"] == "max_steps" and result["steps"] == 5
    config = tomllib.loads(RunPaths(tmp_path, RUN).config.read_text())
    assert config["max_steps"] == 5 and config["trainer"]["lr"] == 3e-4
    assert checkpoint_steps(tmp_path) == [2, 4, 5]

    # The log: the first start, the resumed one with the changed config, a stop per segment.
    as_launcher(tmp_path, RUN)
    with EmbeddedServer(tmp_path / RUN / "nats") as server:
        events = await all_events(server.url, RUN)
    starts = [e for e in events if isinstance(e, RunStarted)]
    assert [(s.resumed, s.config["max_steps"]) for s in starts] == [(False, 3), (True, 5)]
    assert starts[1].event_id == run_resumed_id(RUN, 1)
    stops = [(e.event_id, e.step) for e in events if isinstance(e, RunStopped)]
    assert stops == [(run_stopped_id(RUN), 3), (run_stopped_id(RUN, 1), 5)]

    # Both segments replay bit for bit, each under its own config.
    replayed = rlbus(tmp_path, "replay", RUN, "trainer")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "REPRODUCED 5 steps" in replayed.stdout
    assert result["final_weights_digest"] in replayed.stdout

    # An old step the stride kept is there; one it did not keep is named with what is.
    assert run_checkpoint(tmp_path, f"{RUN}:2") == RunPaths(tmp_path, RUN).checkpoint(2)
    gone = rlbus(tmp_path, "eval", "--checkpoint", f"{RUN}:3")
    one_line_refusal(gone, "no step 3 (kept: 2, 4, 5)")
    assert "trainer.checkpoint_keep_every (2)" in gone.stderr
