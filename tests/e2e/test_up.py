"""`rlbus up` end to end: every role as a real process on an embedded nats-server."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from bus.server import EmbeddedServer, running_server_url
from configs import load_config
from schemas import (
    BatchAssembled,
    EvalCompleted,
    MetricsReported,
    RunStarted,
    RunStopped,
    SamplesScored,
    TaskRequested,
    TraceCompleted,
    WeightsPublished,
)
from tests.e2e.helpers import all_events, reached_version, rlbus_up, running_role, summary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def test_smoke_run_trains_end_to_end(tmp_path: Path) -> None:
    """Every event kind appears, versions advance, no stale sample trains, one step per batch."""
    proc = rlbus_up(tmp_path, "smoke1", "max_steps=6")
    out, _ = await asyncio.to_thread(proc.communicate, timeout=600)
    assert proc.returncode == 0, out[-4000:]
    cfg = load_config("smoke", ["max_steps=6"])
    with EmbeddedServer(tmp_path / "smoke1" / "nats") as server:
        events = await all_events(server.url, "smoke1")
    kinds = {type(e) for e in events}
    for kind in (
        RunStarted,
        RunStopped,
        TaskRequested,
        TraceCompleted,
        EvalCompleted,
        SamplesScored,
        BatchAssembled,
        WeightsPublished,
        MetricsReported,
    ):
        assert kind in kinds, kind.__name__
    batches = [e for e in events if isinstance(e, BatchAssembled)]
    weights = [e for e in events if isinstance(e, WeightsPublished)]
    trainer_steps = [e for e in events if isinstance(e, MetricsReported) and e.role == "trainer"]
    assert [b.step for b in batches] == list(range(1, cfg.max_steps + 1))
    assert [w.version for w in weights] == list(range(1, cfg.max_steps + 1))
    assert len(trainer_steps) == len(batches)
    for b in batches:
        if b.phase == "rl":
            assert all(
                (b.step - 1) - s.policy_min <= cfg.orchestrator.max_off_policy_steps
                for s in b.samples
            )
    assert any(isinstance(e, TraceCompleted) and e.trace.policy_max > 0 for e in events), (
        "inference never picked up new weights"
    )
    (stop,) = [e for e in events if isinstance(e, RunStopped)]
    assert stop.reason == "max_steps"
    s = summary(tmp_path, "smoke1")
    assert s["steps"] == cfg.max_steps and (tmp_path / "smoke1" / "curves.png").exists()


async def test_killed_trainer_resumes_without_training_a_batch_twice(tmp_path: Path) -> None:
    """SIGKILL the trainer mid-run: it is restarted, resumes from checkpoint + log, and the
    final weights equal a fresh replay of the recorded batches (none skipped or doubled)."""
    run = "kill1"
    steps = 30  # long enough that the kill lands mid-run
    proc = rlbus_up(tmp_path, run, f"max_steps={steps}", "trainer.checkpoint_interval=4")
    store = tmp_path / run / "nats"
    url = await reached_version(proc, tmp_path, run, 3, timeout_s=400)
    assert url is not None, "the run never reached version 3"
    os.kill((await running_role(url, run, "trainer")).pid, signal.SIGKILL)
    out, _ = await asyncio.to_thread(proc.communicate, timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert summary(tmp_path, run)["restarts"].get("trainer", 0) >= 1
    with EmbeddedServer(store) as server:
        events = await all_events(server.url, run)
    weights = [e for e in events if isinstance(e, WeightsPublished)]
    assert [w.version for w in weights] == list(range(1, steps + 1))
    batches = [e for e in events if isinstance(e, BatchAssembled)]
    from roles.trainer.core import TrainerCore  # the same fold, uninterrupted

    cfg = load_config(str(tmp_path / run / "config.toml"))
    started = next(e for e in events if isinstance(e, RunStarted))
    core = TrainerCore(cfg, started.model_path)
    for b in batches:
        core.train_step(b)
    assert core.weights_digest() == weights[-1].weights.digest


async def test_ctrl_c_drains_every_role_and_exits_cleanly(tmp_path: Path) -> None:
    """SIGINT to `rlbus up` stops roles in order (each logs role.stopped), keeps the server
    up until they drained, writes the summary, and exits 130."""
    run = "ctrlc1"
    proc = rlbus_up(tmp_path, run, "max_steps=500")
    store = tmp_path / run / "nats"
    await reached_version(proc, tmp_path, run, 2, timeout_s=300)  # then Ctrl-C, reached or not
    proc.send_signal(signal.SIGINT)
    out, _ = await asyncio.to_thread(proc.communicate, timeout=240)
    assert proc.returncode == 130, out[-3000:]
    logs = sorted((tmp_path / run / "logs").glob("*.log"))
    assert len(logs) >= 6
    for log in logs:
        assert '"role.stopped"' in log.read_text(), f"{log.name} did not drain"
    assert (tmp_path / run / "summary.json").exists()
    assert running_server_url(store) is None
