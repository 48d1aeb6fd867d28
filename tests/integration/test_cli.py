"""The rlbus CLI as a user runs it: dry-run config, deprecations, typos, events, status."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from bus.runtime import Bus
from bus.server import EmbeddedServer
from tests.samples import every_event

RLBUS = [sys.executable, "-m", "roles.cli"]


def rlbus(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*RLBUS, *args], capture_output=True, text=True, timeout=timeout)


def test_dry_run_prints_the_resolved_config() -> None:
    """`rlbus up --dry-run -c smoke` prints a TOML config that loads back, with overrides applied."""
    out = rlbus("up", "--dry-run", "-c", "smoke", "trainer.lr=0.5")
    assert out.returncode == 0, out.stderr
    cfg = tomllib.loads(out.stdout)
    assert cfg["trainer"]["lr"] == 0.5
    assert cfg["orchestrator"]["train"]["sampling"]["max_completion_tokens"] == 16


def test_deprecated_keys_work_and_warn(tmp_path: Path) -> None:
    """Old spellings are translated and each warns once naming the new key."""
    old = tmp_path / "old.toml"
    old.write_text(
        '[orchestrator.sampling]\ntemperature = 0.7\nmax_tokens = 20\n\n[[orchestrator.env]]\nid = "reverse-text"\n'
    )
    out = rlbus("up", "--dry-run", "-c", str(old))
    assert out.returncode == 0, out.stderr
    cfg = tomllib.loads(out.stdout)
    assert cfg["orchestrator"]["train"]["sampling"]["max_completion_tokens"] == 20
    assert cfg["orchestrator"]["train"]["env"][0]["id"] == "reverse-text"
    assert out.stderr.count("orchestrator.train.sampling") >= 1
    assert "max_completion_tokens" in out.stderr and "orchestrator.train.env" in out.stderr


def test_a_typo_fails_naming_the_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer]\nlearning_rate = 0.1\n")
    out = rlbus("up", "--dry-run", "-c", str(bad))
    assert out.returncode == 2
    assert "trainer.learning_rate" in out.stderr


@pytest.mark.nats
async def test_events_prints_the_log_and_filters_by_topic(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """`rlbus events` shows every event in order; --topic keeps only that topic."""
    await bus.publish_many(every_event(bus.run))
    out = rlbus("events", bus.run, "--nats-url", nats_server.url)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == len(every_event()) and "RunStarted" in lines[0]
    assert "AlgorithmDetached" in lines[-1]
    only = rlbus("events", bus.run, "--nats-url", nats_server.url, "--topic", "trace.completed")
    assert [ln.split()[3] for ln in only.stdout.strip().splitlines()] == ["TraceCompleted"]


@pytest.mark.nats
async def test_status_lists_live_roles(nats_server: EmbeddedServer, bus: Bus) -> None:
    """`rlbus status --run R` shows a role that is heartbeating."""
    from bus.registry import Heartbeat

    hb = Heartbeat(bus.js, bus.run, "trainer", "trainer-x", interval_s=0.2)
    await hb.beat()
    out = rlbus("status", "--run", bus.run, "--nats-url", nats_server.url)
    assert out.returncode == 0, out.stderr
    assert "trainer-x" in out.stdout and "alive" in out.stdout


def test_model_export_writes_a_loadable_model_with_the_checkpoint_weights(tmp_path: Path) -> None:
    """`rlbus model export` = the run's config/tokenizer + the chosen checkpoint's weights."""
    import torch
    from safetensors.torch import save_file

    from roles.lib.model import ensure_tiny_model
    from roles.lib.model.loading import load_model

    run_dir = tmp_path / "r1"
    initial = ensure_tiny_model(run_dir, {"hidden_size": 32, "num_layers": 1}, seed=0)
    model = load_model(initial)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    name = next(k for k in state if k.endswith("norm.weight"))
    for step, value in ((1, 0.5), (2, 2.0)):
        state[name] = torch.full_like(state[name], value)
        ckpt = run_dir / "checkpoints" / f"step-{step:08d}"
        ckpt.mkdir(parents=True)
        save_file(state, ckpt / "model.safetensors")
        (ckpt / "state.json").write_text("{}")
    out = rlbus(
        "model", "export", "r1", "--out", str(tmp_path / "out"), "--data-dir", str(tmp_path)
    )
    assert out.returncode == 0, out.stderr
    newest = load_model(tmp_path / "out")
    assert torch.all(newest.state_dict()[name] == 2.0)
    rlbus(
        "model",
        "export",
        "r1",
        "--out",
        str(tmp_path / "s1"),
        "--step",
        "1",
        "--data-dir",
        str(tmp_path),
    )
    assert torch.all(load_model(tmp_path / "s1").state_dict()[name] == 0.5)
    missing = rlbus(
        "model",
        "export",
        "r1",
        "--out",
        str(tmp_path / "x"),
        "--step",
        "9",
        "--data-dir",
        str(tmp_path),
    )
    assert missing.returncode == 2 and "no checkpoint 9" in missing.stderr
