"""`rlbus up` end to end: every role as a real process on an embedded nats-server (the
session's smoke run, shared with the analytics, sinks and replay tests)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

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
from tests.e2e.conftest import ANALYTICS_OVERRIDES, ANALYTICS_RUN
from tests.e2e.helpers import summary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_smoke_run_trains_end_to_end(smoke: tuple[Path, list[Any]]) -> None:
    """Every event kind appears, versions advance, no stale sample trains, one step per
    batch (the session's smoke run, ``tests/e2e/conftest.py``)."""
    data, events = smoke
    cfg = load_config("smoke", list(ANALYTICS_OVERRIDES))
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
    s = summary(data, ANALYTICS_RUN)
    assert s["steps"] == cfg.max_steps and (data / ANALYTICS_RUN / "curves.png").exists()
