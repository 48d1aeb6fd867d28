"""Rollout quality end to end: a bug in env code stops the run with a clear message; a
frozen actor trains to max_steps (its samples are never stale)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bus.server import EmbeddedServer
from schemas import BatchAssembled, DeadLettered, RunStopped, TaskRequested
from tests.e2e.helpers import all_events, rlbus_up

pytestmark = [pytest.mark.e2e]


def events_of(data: Path, run: str) -> list[object]:
    with EmbeddedServer(data / run / "nats") as server:
        return asyncio.run(all_events(server.url, run))


def test_a_bug_in_env_code_dead_letters_its_tasks_and_stops_the_run(tmp_path: Path) -> None:
    """Every third task's rubric divides by zero: those tasks are dead-lettered with the
    traceback, their groups released, and after `max_env_errors` the run stops naming the
    env and the error (exit 3: stopped for a reason other than max_steps)."""
    proc = rlbus_up(
        tmp_path, "bug1", "max_steps=50", "orchestrator.warmup.steps=0",
        "orchestrator.eval.interval=0", 'orchestrator.train.env=[{id="tests.e2e.buggy_env:make",group_size=4}]',
    )  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 3, out[-4000:]
    events = events_of(tmp_path, "bug1")
    stopped = next(e for e in events if isinstance(e, RunStopped))
    assert stopped.reason == "env_error"
    assert "tests-e2e-buggy_env-make" in stopped.detail
    assert "ZeroDivisionError" in stopped.detail
    dead = [e for e in events if isinstance(e, DeadLettered)]
    assert len(dead) >= 3 and all(d.role == "env" for d in dead)
    assert all("Traceback" in d.error and "buggy_env.py" in d.error for d in dead)
    requests = {e.event_id for e in events if isinstance(e, TaskRequested)}
    assert {d.causation_id for d in dead} <= requests


def test_a_frozen_actor_trains_to_max_steps(tmp_path: Path) -> None:
    """SFT on the scripted teacher's rollouts in the RL phase with max_off_policy_steps 0:
    the teacher's tokens are not the policy's, so none is dropped as stale (before: three
    batches, then every sample dropped and the run stuck)."""
    proc = rlbus_up(
        tmp_path, "frozen1", "max_steps=6", "orchestrator.warmup.steps=0",
        "orchestrator.eval.interval=0", 'orchestrator.actor="teacher"',
        "orchestrator.max_off_policy_steps=0", 'orchestrator.algorithms=[{id="sft"}]',
    )  # fmt: skip
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    events = events_of(tmp_path, "frozen1")
    batches = [e for e in events if isinstance(e, BatchAssembled)]
    assert [b.step for b in batches] == list(range(1, 7))
    assert all(b.phase == "rl" and b.dropped_stale == 0 for b in batches)
    assert all(not s.from_policy for b in batches for s in b.samples)
