"""The `gpu` preset: it resolves anywhere, and `rlbus up` refuses it where torch sees no GPU.

The command-line tests run `python -m roles.cli up` as a user does (a subprocess: the
whole CLI app configures structlog for its process), with the data directory in a
temporary folder. The rest call the preset and `roles.up.preflight` directly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from configs import load_config
from configs.loading import resolve
from roles.algorithm.checks import routing_problems
from roles.lib.model.tiny import count_params, tiny_config
from roles.lib.model.tokenizer import build_tokenizer
from roles.up import preflight

RLBUS = [sys.executable, "-m", "roles.cli"]
RUN = "gpu1"
NO_GPU = not torch.cuda.is_available()


def up(data: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBUS_")}
    cmd = [*RLBUS, "up", "--run", RUN, "--no-view", "-c", "gpu", *args, f"bus.data_dir={data}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_the_dry_run_resolves_the_gpu_preset_on_any_machine(tmp_path: Path) -> None:
    """Exit 0 and the resolved config on stdout; without a GPU, one stderr note says that
    `rlbus up` would refuse it here."""
    out = up(tmp_path, "--dry-run")
    assert out.returncode == 0, out.stderr
    cfg = resolve(tomllib.loads(out.stdout))
    assert cfg == load_config("gpu", [f"bus.data_dir={tmp_path}", f"run={RUN}"])
    assert (cfg.trainer.device, cfg.inference.device) == ("cuda", "cuda")
    if NO_GPU:
        (note,) = out.stderr.strip().splitlines()
        assert note.startswith("note: rlbus up would refuse this here: `trainer.device`"), note
    assert not (tmp_path / RUN).exists()


@pytest.mark.skipif(not NO_GPU, reason="torch sees a GPU here")
def test_up_refuses_cuda_without_a_gpu_before_any_role_starts(tmp_path: Path) -> None:
    out = up(tmp_path)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, out.stderr
    assert len(lines) == 1, out.stderr
    version = torch.__version__
    assert lines[0] == (
        f'config error: `trainer.device` = "cuda", but torch sees no CUDA GPU (torch {version}); '
        f'`inference.device` = "cuda", but torch sees no CUDA GPU (torch {version})'
    )
    assert not (tmp_path / RUN).exists(), "a role (or its log) was started"


# -- the checks and the preset themselves ------------------------------------------------------


def test_device_checks_name_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU and "auto" are never checked; a CUDA device must be one torch sees; vLLM
    ignores `inference.device`."""
    assert preflight.device_problems(load_config("smoke")) == []  # "auto"
    cpu = load_config("smoke", ["trainer.device=cpu", "inference.device=cpu"])
    assert preflight.device_problems(cpu) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    one_gpu = load_config("smoke", ['trainer.device="cuda:0"', 'inference.device="cuda:1"'])
    assert preflight.device_problems(one_gpu) == [
        '`inference.device` = "cuda:1", but torch sees 1 CUDA GPU(s), so no cuda:1'
    ]
    vllm = load_config("smoke", ['inference.backend="vllm"', 'inference.device="cuda:1"'])
    assert preflight.device_problems(vllm) == []
    (bad,) = preflight.device_problems(load_config("smoke", ['trainer.device="cuda:x"']))
    assert bad.startswith('`trainer.device` = "cuda:x": ')  # then torch's own words


def test_the_gpu_preset_passes_every_other_check(tmp_path: Path) -> None:
    cfg = load_config("gpu", [f"bus.data_dir={tmp_path}"])
    preflight.check(cfg, devices=False)
    assert routing_problems(cfg) == []
    assert cfg.model.dtype == "float32" and cfg.inference.gpu_memory_fraction == 0.45


def test_the_gpu_preset_model_has_the_parameters_its_header_states() -> None:
    """~100 M parameters: counted on the meta device (no memory), as the builder makes it."""
    tiny = load_config("gpu").model.tiny
    config = tiny_config(
        build_tokenizer(), **tiny.model_dump(exclude={"init_seed", "arch", "vocab_size"})
    )
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        n = count_params(LlamaForCausalLM(config))
    assert n == 99_191_040
    header = Path(__file__).parents[2].joinpath("configs/presets/gpu.toml").read_text()
    assert f"{n:,} parameters" in header
