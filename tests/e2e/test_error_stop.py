"""A run whose every rollout errors stops with one line saying why (issue 31, item 1: a
run trained 0 of 10 steps in 206 s, 48,140 errored rollouts, nothing on the console)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bus.server import EmbeddedServer
from schemas import BatchAssembled, RunStopped
from tests.e2e.helpers import all_events, rlbus_up, summary

pytestmark = [pytest.mark.e2e]


def test_rollouts_that_only_error_stop_the_run_with_one_line(tmp_path: Path) -> None:
    """`inference.max_model_len=8` is shorter than every prompt: each rollout errors
    (`context_too_long`, a retryable error: its group is replaced by a new one). The
    orchestrator stops the run after `orchestrator.error_stop_s` (reason
    `rollout_errors`, long before the 900 s stall stop); `rlbus up` prints the reason in
    one line naming the error and what to change, reports the errored rollouts beside a
    rate of 0, and exits 3 (stopped, not at max_steps)."""
    proc = rlbus_up(
        tmp_path, "errstop1", "max_steps=3", "orchestrator.warmup.steps=0",
        "orchestrator.eval.interval=0", "orchestrator.eval.at_start=false",
        "inference.max_model_len=8", "orchestrator.error_stop_s=5",
    )  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 3, out[-4000:]
    line = next((x for x in out.splitlines() if "run stopped: rollout_errors" in x), None)
    assert line is not None, out[-4000:]
    assert "context_too_long: prompt has" in line and "inference.max_model_len" in line
    assert "env reverse-text, model policy" in line
    assert "0.0 train rollouts/s (" in out and " errored, 0 filtered: not in the rate)" in out
    s = summary(tmp_path, "errstop1")
    assert s["trainable_rollouts"] == 0 and s["errored_rollouts"] > 0
    assert s["stopped"]["reason"] == "rollout_errors"
    with EmbeddedServer(tmp_path / "errstop1" / "nats") as server:
        events = asyncio.run(all_events(server.url, "errstop1"))
    stopped = [e for e in events if isinstance(e, RunStopped)]
    assert [e.reason for e in stopped] == ["rollout_errors"]
    assert not [e for e in events if isinstance(e, BatchAssembled)]
