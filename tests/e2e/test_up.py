"""`rlbus up` end to end: every role as a real process on an embedded nats-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bus.server import EmbeddedServer
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
from tests.e2e.helpers import all_events, rlbus_up, summary

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
