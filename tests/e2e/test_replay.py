"""Replay end to end: a real smoke run (the session's, ``tests/e2e/conftest.py``: 4 steps,
a shadow max_rl beside grpo), then every replay command as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import polars as pl
import pytest

from tests.e2e.conftest import ANALYTICS_RUN
from tests.e2e.helpers import rlbus, summary

pytestmark = pytest.mark.e2e

RUN = ANALYTICS_RUN


@pytest.fixture
def recorded(smoke: tuple[Path, list[Any]]) -> Path:
    """The data directory of the session's finished 4-step smoke run."""
    return smoke[0]


def test_trainer_replay_reproduces_every_step(recorded: Path) -> None:
    """Replaying the recorded batches on CPU matches every step and the final digest."""
    r = rlbus(recorded, "replay", RUN, "trainer")
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count(" ok") == 4 and "REPRODUCED 4 steps" in r.stdout
    assert summary(recorded, RUN)["final_weights_digest"] in r.stdout


def test_fork_changes_lr_after_the_fork_step(recorded: Path) -> None:
    """A fork from step 2 with a new lr first differs at step 3, and is itself a replayable run."""
    r = rlbus(recorded, "replay", RUN, "trainer", "--fork", "forked", "--from", "2", "trainer.lr=0.01")  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "first differing step: 3" in r.stdout
    again = rlbus(recorded, "replay", "forked", "trainer")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "REPRODUCED 4 steps" in again.stdout


def test_algorithm_replay_matches_and_shadows(recorded: Path) -> None:
    """The recorded grpo advantages are recomputed exactly; rloo becomes a shadow table."""
    r = rlbus(recorded, "replay", RUN, "algorithm", "grpo")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MATCH grpo" in r.stdout and " 0 changed" in r.stdout
    shadow = rlbus(recorded, "replay", RUN, "algorithm", "rloo")
    assert shadow.returncode == 0, shadow.stdout + shadow.stderr
    df = pl.read_parquet(recorded / RUN / "lake" / "shadow_samples" / "rloo.parquet")
    assert len(df) > 0 and set(df["algorithm"]) == {"rloo"}
    assert {"group_id", "rollout_id", "branch", "adv_mean", "n_masked", "zero_advantage"} <= set(df.columns)  # fmt: skip


def test_rubric_replay_reports_no_change(recorded: Path) -> None:
    """Today's reward functions give the recorded rewards exactly."""
    r = rlbus(recorded, "replay", RUN, "rubric")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ", 0 changed" in r.stdout and "rewards compared, 0 changed" in r.stdout


def test_orchestrator_replay_re_makes_every_decision(recorded: Path) -> None:
    """Stepping the recorded log through the orchestrator's core re-makes every decision."""
    r = rlbus(recorded, "replay", RUN, "orchestrator")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4 BatchAssembled" in r.stdout and "1 RunStopped" in r.stdout
    assert "MATCH orchestrator" in r.stdout


def test_trace_follows_a_rollout_forward(recorded: Path) -> None:
    """A trained rollout's chain names the batch step that trained it and the weights it made."""
    events = rlbus(recorded, "events", RUN, "-t", "batch.assembled", "--json")
    batch = json.loads(events.stdout.splitlines()[-1])["event"]
    rollout = batch["samples"][0]["rollout_id"]
    r = rlbus(recorded, "trace", RUN, rollout, "--json")
    assert r.returncode == 0, r.stderr
    chain = json.loads(r.stdout)
    steps = [(b["step"], b["weights"]["version"]) for b in chain["forward"]["batches"]]
    assert (batch["step"], batch["step"]) in steps
    assert chain["backward"]["request"] is not None and chain["forward"]["scored"]
    text = rlbus(recorded, "trace", RUN, rollout[:12], "--no-tokens")
    assert f"trained in batch step {batch['step']}" in text.stdout
    assert f"weights v{batch['step']}" in text.stdout


def test_exported_run_replays_elsewhere(recorded: Path, tmp_path: Path) -> None:
    """Export, import into another data dir under a new id, and the trainer still
    reproduces there from the archive's model (the original's directory is moved away)."""
    archive = tmp_path / "run.tar"
    assert rlbus(recorded, "export", RUN, str(archive)).returncode == 0
    other = tmp_path / "machine2"
    model = recorded / RUN / "model"
    model.rename(tmp_path / "away")  # as on another machine: the recorded model_path is gone
    try:
        r = rlbus(other, "import", str(archive), "--data-dir", str(other), "--run", "moved")
        assert r.returncode == 0, r.stdout + r.stderr
        replay = rlbus(other, "replay", "moved", "trainer")
    finally:
        (tmp_path / "away").rename(model)
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert str(other / "moved" / "model" / "initial") in replay.stdout
    assert summary(recorded, RUN)["final_weights_digest"] in replay.stdout
