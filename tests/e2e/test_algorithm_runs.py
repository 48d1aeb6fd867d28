"""Short real runs of the channel algorithms: echo on the tool env, opd toward a reference.

- `rlbus up -c tools`: echo = GRPO on the policy's turns + cross-entropy on the
  calculator's outputs. The tool-output NLL (`ce_nll`) falls while RL goes on.
- opd on reverse-text with a frozen reference model (a tiny model with another seed):
  the KL to the reference (`ref_kl`, trainer metric) falls.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from statistics import mean

import pytest

from bus.server import EmbeddedServer
from schemas import MetricsReported
from tests.e2e.helpers import all_events, rlbus_up, summary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def trainer_metrics(data: Path, run: str) -> list[dict[str, float]]:
    """The trainer's metrics per step, in step order."""
    with EmbeddedServer(data / run / "nats") as server:
        events = asyncio.run(all_events(server.url, run))
    by_step = {
        e.step: e.values for e in events if isinstance(e, MetricsReported) and e.role == "trainer"
    }
    return [by_step[s] for s in sorted(by_step)]


def finished(proc: subprocess.Popen[str]) -> None:
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]


def test_echo_trains_tool_outputs_while_rl_continues(tmp_path: Path) -> None:
    """The README's tools preset, shortened (half its warm start, 40 RL steps), finishes
    with finite evals; RL steps carry both channels; tool-output NLL falls; advantages
    stay non-zero."""
    finished(rlbus_up(tmp_path, "echo1", "orchestrator.eval.interval=60", "orchestrator.eval.num_tasks=8",
                      "orchestrator.warmup.steps=60", "max_steps=100", config="tools"))  # fmt: skip
    s = summary(tmp_path, "echo1")
    assert s["stopped"]["reason"] == "max_steps" and not s["restarts"], s["stopped"]
    assert {"0", "60", "100"} <= set(s["eval"])
    assert all(0.0 <= v <= 1.0 for m in s["eval"].values() for k, v in m.items() if "/avg@" in k)
    steps = trainer_metrics(tmp_path, "echo1")
    rl = [m for m in steps if m["rl_tokens"] > 0]
    assert len(rl) == 40  # 100 steps, 60 of them the warm start
    assert all(m["ce_tokens"] > 0 and "ce_nll" in m for m in rl)
    first, last = mean(m["ce_nll"] for m in rl[:5]), mean(m["ce_nll"] for m in rl[-10:])
    assert last < 0.7 * first, (first, last)
    # RL on actions continues beside it: every RL step trains the policy's own tokens by
    # policy gradient, with a learning signal in a share of them (how large a share is
    # the tiny model's luck: 26 to 74 of 80 seen on the full preset; see its alpha).
    assert sum(m["loss_rl"] != 0.0 for m in rl) >= len(rl) // 10


def test_opd_pulls_the_policy_toward_the_reference(tmp_path: Path) -> None:
    """Only the ref_kl channel trains; the KL to the frozen reference falls."""
    ref = tmp_path / "reference"
    init = [
        sys.executable,
        "-m",
        "roles.cli",
        "model",
        "init",
        "-c",
        "smoke",
        "--seed",
        "7",
        "--out",
        str(ref),
    ]
    subprocess.run(init, check=True, capture_output=True, timeout=120)
    finished(rlbus_up(
        tmp_path, "opd1", "max_steps=40", "orchestrator.warmup.steps=0", "orchestrator.eval.interval=0",
        "orchestrator.max_async_level=0", 'orchestrator.algorithms=[{id="opd"}]',
        'orchestrator.models.reference.kind="reference"', f'orchestrator.models.reference.path="{ref}"',
    ))  # fmt: skip
    steps = trainer_metrics(tmp_path, "opd1")
    assert len(steps) == 40
    assert all(m["ref_tokens"] > 0 and m["rl_tokens"] == 0 and m["ce_tokens"] == 0 for m in steps)
    first, last = mean(m["ref_kl"] for m in steps[:5]), mean(m["ref_kl"] for m in steps[-10:])
    assert last < 0.7 * first, (first, last)
