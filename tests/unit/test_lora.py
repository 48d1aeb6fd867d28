"""LoRA (``[trainer.lora]``): the trainer trains and publishes adapters only; whatever
serves weights merges them into the base (roles.lib.model.lora, roles.lib.model.weights)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from configs import ConfigError, RunConfig, load_config
from roles.inference.engine import TorchEngine
from roles.lib.model.loading import load_model, load_tokenizer
from roles.lib.model.tiny import build_tiny_model
from roles.lib.model.weights import (
    adapter_scale,
    digest,
    load_state_bytes,
    state_dict_to_bytes,
    write_checkpoint_model,
)
from roles.trainer.core import TrainerCore, latest_checkpoint
from tests.unit.test_trainer_core import synthetic_batch

PROBE = torch.tensor([[1, 5, 7, 9, 11, 13, 17, 19]])


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("lora") / "tiny", seed=0)


def lora_cfg(*extra: str) -> RunConfig:
    return load_config(
        "smoke",
        ["trainer.seq_len=256", "trainer.lr=1e-2", "trainer.device=cpu",
         "trainer.lora={rank=4, alpha=8}", *extra],
    )  # fmt: skip


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=PROBE).logits


def trained(tiny_dir: Path, steps: int = 2) -> TrainerCore:
    core = TrainerCore(lora_cfg(), tiny_dir)
    for step in range(1, steps + 1):
        core.train_step(synthetic_batch("lora", step))
    return core


def test_only_the_adapters_train_and_travel(tiny_dir: Path) -> None:
    """Two cores fed the same batches publish the same adapter bytes; the base weights
    never move; the blob is the adapters (a fraction of the model), marked as such."""
    base = load_model(tiny_dir, dtype="float32", device="cpu").state_dict()
    a, b = trained(tiny_dir), trained(tiny_dir)
    assert a.weights_digest() == b.weights_digest()
    blob = a.weights_bytes()
    assert adapter_scale(blob) == 2.0  # alpha / rank
    assert len(blob) * 10 < len(state_dict_to_bytes(load_model(tiny_dir)))
    trainable = [n for n, p in a.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    for name, tensor in a.model.get_base_model().state_dict().items():
        if ".lora_" not in name:
            key = name.replace(".base_layer", "")
            assert torch.equal(tensor, base[key]), name
    assert a.weights_digest() != TrainerCore(lora_cfg(), tiny_dir).weights_digest()


def test_a_lora_checkpoint_resumes_as_if_never_stopped(tiny_dir: Path, tmp_path: Path) -> None:
    batches = [synthetic_batch("ckpt", s) for s in range(1, 4)]
    straight = TrainerCore(lora_cfg(), tiny_dir)
    losses = [straight.train_step(b)["loss"] for b in batches]
    first = TrainerCore(lora_cfg(), tiny_dir)
    first.train_step(batches[0])
    first.save_checkpoint(tmp_path)
    resumed = TrainerCore(lora_cfg(), tiny_dir)
    path = latest_checkpoint(tmp_path)
    assert path is not None
    resumed.load_checkpoint(path)
    assert [resumed.train_step(b)["loss"] for b in batches[1:]] == losses[1:]
    assert resumed.weights_digest() == straight.weights_digest()


def test_a_served_model_merges_each_version_from_its_base(tiny_dir: Path) -> None:
    """A plain model given adapter bytes computes what the trainer's peft model does;
    version after version it merges into the base (no drift: v1 then v2 equals v2 alone),
    and a fresh adapter (B = 0) is the base exactly."""
    core = TrainerCore(lora_cfg(), tiny_dir)
    served = load_model(tiny_dir, dtype="float32", device="cpu")
    base_logits = logits(served)
    v0 = core.weights_bytes()
    load_state_bytes(served, v0, digest(v0))
    assert torch.equal(logits(served), base_logits)
    core.train_step(synthetic_batch("m", 1))
    v1 = core.weights_bytes()
    load_state_bytes(served, v1, digest(v1))
    core.train_step(synthetic_batch("m", 2))
    v2 = core.weights_bytes()
    load_state_bytes(served, v2, digest(v2))
    torch.testing.assert_close(logits(served), logits(core.model), atol=1e-5, rtol=0)
    fresh = load_model(tiny_dir, dtype="float32", device="cpu")
    load_state_bytes(fresh, v2, digest(v2))
    assert torch.equal(logits(fresh), logits(served))
    assert not torch.equal(logits(served), base_logits)


def test_the_engine_serves_adapter_versions(tiny_dir: Path) -> None:
    """The torch engine checks an adapter blob (digest, shapes, finite) and loads its
    merged layers: it then answers as the trainer's model; a corrupted blob is refused."""
    core = trained(tiny_dir)
    blob = core.weights_bytes()
    engine = TorchEngine(load_model(tiny_dir), load_tokenizer(tiny_dir))
    state = engine.check_state(blob, digest(blob))
    assert state and all(k.endswith("_proj.weight") for k in state)
    engine.load_state(blob, digest(blob), version=2)
    torch.testing.assert_close(logits(engine.model), logits(core.model), atol=1e-5, rtol=0)
    with pytest.raises(Exception, match="digest"):
        engine.check_state(blob, "sha256:" + "0" * 64)


def test_modules_to_save_train_whole_and_keep_the_tie(tiny_dir: Path) -> None:
    """``modules_to_save = ["embed_tokens"]``: the embeddings (the tiny model's output
    layer too, tied) train whole beside the adapters and travel whole; the served model
    keeps the tie and answers as the trainer's model; the rest of the base stays."""
    cfg = lora_cfg('trainer.lora.modules_to_save=["embed_tokens"]')
    core = TrainerCore(cfg, tiny_dir)
    for step in (1, 2):
        core.train_step(synthetic_batch("save", step, phase="sft"))
    base = core.model.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight
    blob = core.weights_bytes()
    served = load_model(tiny_dir, dtype="float32", device="cpu")
    load_state_bytes(served, blob, digest(blob))
    assert served.lm_head.weight is served.model.embed_tokens.weight
    assert torch.equal(served.model.embed_tokens.weight, base.model.embed_tokens.weight)
    torch.testing.assert_close(logits(served), logits(core.model), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"in both `target_modules` and `modules_to_save`"):
        TrainerCore(lora_cfg('trainer.lora.modules_to_save=["q_proj"]'), tiny_dir)


def test_an_exported_lora_checkpoint_is_the_merged_model(tiny_dir: Path, tmp_path: Path) -> None:
    core = trained(tiny_dir)
    ckpt = core.save_checkpoint(tmp_path / "run")
    write_checkpoint_model(ckpt, tiny_dir, tmp_path / "out")
    exported = load_model(tmp_path / "out", dtype="float32", device="cpu")
    torch.testing.assert_close(logits(exported), logits(core.model), atol=1e-5, rtol=0)
    assert load_tokenizer(tmp_path / "out") is not None


def test_lora_refuses_what_it_does_not_do_naming_the_key(tiny_dir: Path) -> None:
    with pytest.raises(ConfigError, match=r"trainer\.world_size"):
        lora_cfg("trainer.world_size=2")
    with pytest.raises(ConfigError, match=r"trainer\.weights_via"):
        lora_cfg('trainer.weights_via="ipc"')
    with pytest.raises(ConfigError, match=r"trainer\.lora\.rank"):
        lora_cfg("trainer.lora.rank=0")
    with pytest.raises(
        ValueError, match=r"target_modules`: \['nope_proj'\] matches no linear layer"
    ):
        TrainerCore(lora_cfg('trainer.lora.target_modules=["nope_proj"]'), tiny_dir)


def test_rlbus_up_refuses_a_target_the_model_lacks_before_any_role_starts(tiny_dir: Path) -> None:
    """Preflight's rule is the trainer's: the tiny model by its families' layers, a model
    directory built on the meta device."""
    from roles.up.preflight import lora_problems

    assert lora_problems(lora_cfg()) == []
    assert lora_problems(lora_cfg(f"model.path={tiny_dir}")) == []
    for path in ("tiny", str(tiny_dir)):
        (problem,) = lora_problems(
            lora_cfg(f"model.path={path}", 'trainer.lora.target_modules=["q_proj", "c_attn"]')
        )
        assert problem.startswith(
            "`trainer.lora.target_modules`: ['c_attn'] matches no linear layer"
        )
