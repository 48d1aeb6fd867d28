"""Every preset the README names starts and finishes through `rlbus up`.

Each runs as written, shrunk only in length: a few warm-start steps, a few RL steps and
small evals, so a preset that no longer loads, routes or trains fails here in seconds
rather than minutes into a demo. `smoke` is not repeated here: `tests/e2e/test_up.py`
(`test_smoke_run_trains_end_to_end`) runs it and checks its summary's steps.
"""

from __future__ import annotations

import math
import signal
import subprocess
from pathlib import Path

import pytest

from configs import load_config
from tests.e2e.helpers import rlbus_up, summary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_STEPS = 6
WARMUP_STEPS = 3
SHRINK = (
    f"max_steps={MAX_STEPS}",
    f"orchestrator.warmup.steps={WARMUP_STEPS}",
    # Evaluations at version 0, after the warm start (3) and at the end (6).
    f"orchestrator.eval.interval={WARMUP_STEPS}",
    "orchestrator.eval.num_tasks=8",
)


# alphabet-sort's reward is all or nothing: 3 warm-start steps leave every RL group at
# reward 0, which the run would skip and then stop on (no_learning_signal); train on them.
SHRUNK_EXTRA = {"qwen3-tiny": ("orchestrator.skip_zero_advantage_groups=false",)}


def finite(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# `tools` runs, longer and with evals, in tests/e2e/test_algorithm_runs.py (the echo test).
@pytest.mark.parametrize("preset", ["default", "qwen3-tiny"])
def test_readme_preset_reaches_max_steps(tmp_path: Path, preset: str) -> None:
    """Exit 0 at max_steps; summary.json has a finite train reward and loss for each step,
    rewards in [0, 1], and finite evals at the start, after the warm start and at the end."""
    shrink = [*SHRINK, *SHRUNK_EXTRA.get(preset, ())]
    cfg = load_config(preset, shrink)  # the overrides still name real keys
    assert cfg.max_steps == MAX_STEPS and cfg.orchestrator.warmup.steps == WARMUP_STEPS
    run = f"preset-{preset}"
    proc = rlbus_up(tmp_path, run, *shrink, config=preset)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # the launcher drains its roles, as on Ctrl-C
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"{preset}: still running after 240 s\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]

    s = summary(tmp_path, run)
    assert s["stopped"]["reason"] == "max_steps", s["stopped"]
    assert s["steps"] == MAX_STEPS and s["warmup_steps"] == WARMUP_STEPS
    steps = [str(i) for i in range(1, MAX_STEPS + 1)]
    assert sorted(s["train_reward"], key=int) == steps and sorted(s["loss"], key=int) == steps
    assert all(finite(r) and 0.0 <= r <= 1.0 for r in s["train_reward"].values()), s
    assert all(finite(x) for x in s["loss"].values()), s["loss"]  # rl losses may be < 0
    assert {"0", str(WARMUP_STEPS), str(MAX_STEPS)} <= set(s["eval"]), s["eval"]
    for version, metrics in s["eval"].items():
        avg = {k: v for k, v in metrics.items() if "/avg@" in k}
        assert avg and all(finite(v) and 0.0 <= v <= 1.0 for v in avg.values()), (version, metrics)
    assert not s["restarts"], s["restarts"]  # no role died on the way
    assert (tmp_path / run / "curves.png").exists()
