"""`rlbus up` says which device each model-running role uses, resolved as the roles do;
what each role process is started with (its sandbox: ``bus.sandbox``)."""

from __future__ import annotations

from pathlib import Path

import torch

from bus.auth import RunAuth
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


def test_bus_sandbox_false_starts_every_role_unconfined(tmp_path: Path) -> None:
    """The config's switch reaches every role process the launcher would start."""
    paths = RunPaths(tmp_path / "runs", "r1")
    RunAuth.ensure(paths.auth, "r1")
    confined = role_specs(load_config("smoke"), paths, "nats://x")
    assert confined and all(r.hidden is not None for r in confined)
    assert all(r.hidden() == [tmp_path / "runs" / ".admin"] for r in confined)  # type: ignore[misc]
    # asked at each start: a run made meanwhile is hidden from a restarted role
    RunAuth.ensure(RunPaths(tmp_path / "runs", "r2").auth, "r2")
    later = confined[0].hidden() if confined[0].hidden else []
    assert tmp_path / "runs" / "r2" / "auth" in later
    free = role_specs(load_config("smoke", ["bus.sandbox=false"]), paths, "nats://x")
    assert [r.name for r in free] == [r.name for r in confined]
    assert all(r.hidden is None for r in free)


def test_rlbus_up_places_auto_weights_on_one_gpu_as_ipc() -> None:
    """``trainer.weights_via = "auto"``: a device-to-device copy when the trainer and the
    torch inference replicas share one CUDA device; the object store otherwise (the CPU,
    two devices, LoRA adapters, several ranks, vLLM), and an explicit choice stays."""
    from roles.up.launcher import placed_weights_via

    def via(*overrides: str) -> str:
        return placed_weights_via(load_config("default", list(overrides))).trainer.weights_via

    gpu = ("trainer.device=cuda", "inference.device=cuda")
    assert via(*gpu) == "ipc"
    assert via("trainer.device=cpu", "inference.device=cpu") == "auto"
    assert via("trainer.device=cuda:0", "inference.device=cuda:1") == "auto"
    assert via(*gpu, "trainer.world_size=2") == "auto"
    assert via(*gpu, "inference.backend=vllm") == "auto"
    assert via(*gpu, "trainer.lora={rank=8}") == "auto"
    assert via(*gpu, "trainer.weights_via=shm") == "shm"
