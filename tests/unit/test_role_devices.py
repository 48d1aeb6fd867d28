"""`rlbus up` says which device each model-running role uses, resolved as the roles do."""

from __future__ import annotations

from pathlib import Path

import torch

from configs import RunPaths, load_config
from roles.up.launcher import role_devices, role_specs


def devices(tmp_path: Path, *overrides: str) -> dict[str, str]:
    cfg = load_config("smoke", [*overrides, "inference.replicas=2"])
    roles = role_specs(cfg, RunPaths(tmp_path, "dev"), "nats://127.0.0.1:4222")
    return role_devices(cfg, roles)


def test_auto_is_what_torch_sees(tmp_path: Path) -> None:
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    assert devices(tmp_path) == {
        "trainer": auto, "inference-policy-0": auto, "inference-policy-1": auto,
    }  # fmt: skip


def test_explicit_devices_and_vllm(tmp_path: Path) -> None:
    found = devices(tmp_path, "trainer.device=cuda:1", 'inference.backend="vllm"')
    assert found["trainer"] == "cuda:1"
    assert found["inference-policy-0"] == "cuda (vllm)"
