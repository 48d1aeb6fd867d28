"""A verifiers environment trains: `rlbus up` with `vf:tests.vf_envs.add` on a Qwen3-
architecture model runs verifiers' episodes in the env server, the trainer trains on
them, verifiers' rewards and metrics land in the lake, and the trainer's recomputed
logprobs match the sampled ones (mismatch_kl as small as on rlbus' own envs). On the
character model, which verifiers cannot render for, `rlbus up` refuses before any role
starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import rlbus_up, summary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN = "vf"
STEPS = 3


def sql(data_dir: Path, query: str) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "roles.cli", "sql", "--run", RUN, "--data-dir",
                          str(data_dir), "-f", "json", query],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_a_verifiers_env_trains_with_its_rewards_in_the_lake(tmp_path: Path) -> None:
    env = 'orchestrator.train.env=[{id="vf:tests.vf_envs.add",group_size=4}]'
    refused = rlbus_up(tmp_path, "char", env)  # the character model: no renderer for verifiers
    out, _ = refused.communicate(timeout=120)
    assert refused.returncode == 2 and "is a verifiers env" in out, out[-2000:]
    assert not (tmp_path / "char").exists()

    proc = rlbus_up(tmp_path, RUN, "model.tiny.arch=qwen3", "orchestrator.warmup.steps=0",
                    f"max_steps={STEPS}", "orchestrator.eval.interval=0",
                    "orchestrator.skip_zero_advantage_groups=false", env)  # fmt: skip
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-4000:]
    assert summary(tmp_path, RUN)["steps"] == STEPS

    rows = sql(tmp_path, "select env, reward, reward_exact, reward_brief, metrics, num_turns "
               "from rollouts where split = 'train'")  # fmt: skip
    assert len(rows) >= STEPS * 8 and {r["env"] for r in rows} == {"vf-tests-vf_envs-add"}
    for r in rows:
        assert r["reward"] == pytest.approx(r["reward_exact"] + r["reward_brief"])
        assert list(r["metrics"]) == ["reply_chars"] and r["num_turns"] == 1, r
    kl = sql(tmp_path, "select step, value from metrics where metric = 'mismatch_kl'")
    assert len(kl) >= STEPS and max(k["value"] for k in kl) < 0.05, kl
