"""TrainerCore: bit-identical determinism, checkpoint/resume equivalence, LR schedule, learning."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch

from configs import RunConfig, load_config
from replay.diff import is_timing
from roles.lib.model.loading import load_model
from roles.lib.model.tiny import build_tiny_model
from roles.lib.model.tokenizer import build_tokenizer
from roles.trainer.core import StepOutOfOrder, TrainerCore, latest_checkpoint, lr_at
from schemas import BatchAssembled, Sample, batch_id, stable_seed
from schemas.arrays import pack_f32, pack_i32, pack_mask

TOKENIZER = build_tokenizer()
LETTERS = list("abcdefghijklmnopqrstuvwxyz")


def synthetic_sample(seed: int, index: int, *, sft: bool = False) -> Sample:
    """A reverse-text-like sample: chat prompt, then the reversed string as the completion."""
    rng = np.random.default_rng(seed)
    text = "".join(rng.choice(LETTERS, size=int(rng.integers(6, 16))))
    prompt = TOKENIZER.apply_chat_template(
        [{"role": "user", "content": f"Reverse the text: {text}"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt_ids = TOKENIZER.encode(prompt, add_special_tokens=False)
    completion_ids = TOKENIZER.encode(text[::-1] + "<|end|>", add_special_tokens=False)
    ids = prompt_ids + completion_ids
    n, p = len(ids), len(prompt_ids)
    mask = [0] * p + [1] * (n - p)
    # Near the tiny model's initial logprobs (about -log V), so ratios start near 1.
    logprobs = [0.0] * p + list(-math.log(len(TOKENIZER)) + rng.normal(0, 0.1, n - p))
    advantage = float(rng.normal())
    return Sample(
        rollout_id=f"r{seed}-{index}", branch=0, env="reverse-text", task_index=index,
        group_id=f"g{seed}", token_ids=pack_i32(ids), mask=pack_mask(mask),
        logprobs=pack_f32(logprobs), temperatures=pack_f32([0.0] * p + [1.0] * (n - p)),
        advantages=pack_f32([advantage if m else 0.0 for m in mask]),
        sft_mask=pack_mask(mask) if sft else None,
    )  # fmt: skip


def synthetic_batch(run: str, step: int, n_samples: int = 8, phase: str = "rl") -> BatchAssembled:
    """Batch ``step`` of a synthetic run (deterministic in ``step``)."""
    samples = [
        synthetic_sample(stable_seed("synthetic", step, i), i, sft=phase == "sft")
        for i in range(n_samples)
    ]
    return BatchAssembled(
        run=run, event_id=batch_id(run, step), step=step, samples=samples,
        policy_version=step - 1, num_tokens=sum(len(s) for s in samples), phase=phase,
    )  # fmt: skip


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("trainer") / "tiny", seed=0)


@pytest.fixture
def cfg() -> RunConfig:
    # CPU: bit-for-bit determinism is promised (and tested) on CPU only.
    return load_config("smoke", ["trainer.seq_len=256", "trainer.lr=1e-3", "trainer.device=cpu"])


def deterministic_metrics(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in m.items() if not is_timing(k)}


def test_two_cores_fed_the_same_batches_are_bit_identical(tiny_dir: Path, cfg: RunConfig) -> None:
    """Same config, weights and batches => identical loss floats and weights digests at every step."""
    a, b = TrainerCore(cfg, tiny_dir), TrainerCore(cfg, tiny_dir)
    initial = a.weights_digest()
    for step in (1, 2, 3):
        batch = synthetic_batch("det", step, phase="sft" if step == 1 else "rl")
        ma, mb = a.train_step(batch), b.train_step(batch)
        assert deterministic_metrics(ma) == deterministic_metrics(mb)
        assert a.weights_digest() == b.weights_digest()
        assert ma["loss_tokens"] > 0 and ma["grad_norm"] > 0
    assert a.step == 3 and a.weights_digest() != initial


def test_checkpoint_resume_equals_uninterrupted_run(
    tiny_dir: Path, cfg: RunConfig, tmp_path: Path
) -> None:
    """Save at step 2, load into a fresh core, continue: same digest and losses as never stopping."""
    batches = [synthetic_batch("ckpt", s) for s in range(1, 5)]
    straight = TrainerCore(cfg, tiny_dir)
    losses = [straight.train_step(b)["loss"] for b in batches]

    first = TrainerCore(cfg, tiny_dir)
    for b in batches[:2]:
        first.train_step(b)
    first.save_checkpoint(tmp_path, {"batch_seq": 7})
    (tmp_path / "checkpoints" / ".tmp-step-00000009-junk").mkdir()  # a crashed half-save
    path = latest_checkpoint(tmp_path)
    assert path is not None and path.name == "step-00000002"

    resumed = TrainerCore(cfg, tiny_dir)
    assert resumed.load_checkpoint(path) == {"batch_seq": 7}
    assert resumed.step == 2 and resumed.weights_digest() == first.weights_digest()
    resumed_losses = [resumed.train_step(b)["loss"] for b in batches[2:]]
    assert resumed_losses == losses[2:]
    assert resumed.weights_digest() == straight.weights_digest()


def test_checkpoints_keep_the_newest_two(tiny_dir: Path, cfg: RunConfig, tmp_path: Path) -> None:
    """Older checkpoints are pruned; saving the same step twice replaces it."""
    core = TrainerCore(cfg, tiny_dir)
    for step in (1, 2, 3):
        core.train_step(synthetic_batch("keep", step, n_samples=2))
        core.save_checkpoint(tmp_path)
    core.save_checkpoint(tmp_path)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-00000002", "step-00000003"]


def test_out_of_order_batch_is_rejected(tiny_dir: Path, cfg: RunConfig) -> None:
    """A gap or a repeated step raises instead of training (the fold must see every step once)."""
    core = TrainerCore(cfg, tiny_dir)
    with pytest.raises(StepOutOfOrder):
        core.train_step(synthetic_batch("gap", 2, n_samples=1))
    core.train_step(synthetic_batch("gap", 1, n_samples=1))
    with pytest.raises(StepOutOfOrder):
        core.train_step(synthetic_batch("gap", 1, n_samples=1))
    assert core.step == 1


def test_train_step_leaves_global_rng_and_threads_alone(tiny_dir: Path, cfg: RunConfig) -> None:
    """Seeding happens inside fork_rng: the caller's RNG stream and thread count are unchanged."""
    core = TrainerCore(cfg, tiny_dir)
    threads = torch.get_num_threads()
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    core.train_step(synthetic_batch("rng", 1, n_samples=2))
    assert torch.equal(torch.rand(3), expected)
    assert torch.get_num_threads() == threads


def test_sft_steps_reduce_cross_entropy(tiny_dir: Path, cfg: RunConfig) -> None:
    """Repeated SFT steps on the same teacher tokens lower their loss (the optimizer really learns)."""
    core = TrainerCore(cfg, tiny_dir)
    batch = synthetic_batch("learn", 1, phase="sft")
    losses = []
    for step in range(1, 6):
        losses.append(core.train_step(msgspec.structs.replace(batch, step=step))["loss"])
    assert losses[-1] < losses[0] - 0.3


def with_channels(sample: Sample) -> Sample:
    """``sample`` plus a ce channel on its last prompt tokens (like tool output: sft_mask=1,
    mask=0, weight 0.5) and a ref_kl channel on its completion (beta 0.1)."""
    a = sample.arrays()
    mask = a["mask"].astype(bool)
    n, p = len(mask), int(np.argmax(mask))
    tool = np.zeros(n, dtype=bool)
    tool[p - 4 : p] = True
    return msgspec.structs.replace(
        sample,
        sft_mask=pack_mask(tool.tolist()),
        ce_weights=pack_f32(np.where(tool, 0.5, 0.0).tolist()),
        ref_logprobs=pack_f32((a["logprobs"] - 0.5).tolist()),
        ref_weights=pack_f32(np.where(mask, 0.1, 0.0).tolist()),
    )


def test_three_channel_batch_trains_and_reports_channel_metrics(
    tiny_dir: Path, cfg: RunConfig
) -> None:
    """An rl batch with rl, ce and ref_kl tokens reports each channel; repeated steps lower ce_nll."""
    batch = synthetic_batch("channels", 1, n_samples=4)
    batch = msgspec.structs.replace(batch, samples=[with_channels(s) for s in batch.samples])
    core = TrainerCore(cfg, tiny_dir)
    metrics = []
    for step in range(1, 5):
        metrics.append(core.train_step(msgspec.structs.replace(batch, step=step)))
    m = metrics[0]
    completion = sum(int(s.arrays()["mask"].sum()) for s in batch.samples)
    assert (m["ce_tokens"], m["rl_tokens"], m["ref_tokens"]) == (16, completion, completion)
    assert m["loss_tokens"] == 16 + completion
    assert m["loss"] == pytest.approx(m["loss_rl"] + m["loss_ce"] + m["loss_ref"], rel=1e-5)
    assert m["ce_nll"] > 0 and m["ref_kl"] > 0 and "sft_tokens" not in m
    assert metrics[-1]["ce_nll"] < metrics[0]["ce_nll"]


def test_lr_schedules() -> None:
    """Warmup ramps linearly; linear/cosine decay over max_steps; SFT batches use warmup.lr."""

    def cfg_of(schedule: str, warmup: int = 0, warmup_lr: float | None = None) -> RunConfig:
        overrides = [f"trainer.lr_schedule={schedule}", "trainer.lr=1.0",
                     f"trainer.warmup_steps={warmup}", "max_steps=10"]  # fmt: skip
        if warmup_lr is not None:
            overrides.append(f"orchestrator.warmup.lr={warmup_lr}")
        return load_config("smoke", overrides)

    assert [lr_at(cfg_of("constant", 2), s) for s in (1, 2, 3, 10)] == [0.5, 1.0, 1.0, 1.0]
    linear = cfg_of("linear", 2)
    assert [lr_at(linear, s) for s in (1, 2, 3, 7)] == [0.5, 1.0, 1.0, 0.5]
    assert lr_at(linear, 10) == pytest.approx(1 / 8)
    cosine = cfg_of("cosine")
    assert lr_at(cosine, 1) == 1.0
    assert lr_at(cosine, 6) == pytest.approx(0.5)
    assert 0 < lr_at(cosine, 10) < 0.05
    assert lr_at(cfg_of("cosine", warmup_lr=0.25), 3, "sft") == 0.25
    assert lr_at(cfg_of("cosine"), 1, "sft") == 1.0


def test_each_step_reports_its_model_flops_and_mfu_where_the_peak_is_known(tiny_dir: Path) -> None:
    """6 x parameters x tokens over the step's time; MFU only with a peak (none is known
    for a CPU), and neither is compared by replay (timing)."""
    batch = synthetic_batch("flops", 1)
    plain = TrainerCore(load_config("smoke", ["trainer.device=cpu"]), tiny_dir).train_step(batch)
    assert plain["flops_per_s"] > 0 and "mfu" not in plain
    peaked = load_config("smoke", ["trainer.device=cpu", "trainer.peak_tflops=0.5"])
    m = TrainerCore(peaked, tiny_dir).train_step(batch)
    assert m["mfu"] == pytest.approx(m["flops_per_s"] / 0.5e12)
    params = sum(p.numel() for p in load_model(tiny_dir).parameters())
    assert m["flops_per_s"] == pytest.approx(6 * params * m["tokens_per_s"])
    assert is_timing("mfu") and is_timing("flops_per_s")


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="trainer.compile on the CPU needs a C++ compiler (torch inductor)",
)
# dynamo itself reads a non-leaf's .grad while tracing (a UserWarning of torch's own).
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_compiled_core_trains_as_the_eager_one(tiny_dir: Path, cfg: RunConfig) -> None:
    """trainer.compile: the blocks run as torch.compile'd graphs (fused, not bit-equal on
    the CPU), and three steps of sft and rl land on the eager core's weights and metrics
    within float tolerance; the state dict keeps its names (checkpoints and published
    weights read the same)."""
    compiled_cfg = cfg.model_copy(
        update={"trainer": cfg.trainer.model_copy(update={"compile": True})}
    )
    eager, compiled = TrainerCore(cfg, tiny_dir), TrainerCore(compiled_cfg, tiny_dir)
    blocks = [m for m in compiled.model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    assert blocks and all(getattr(b, "_compiled_call_impl", None) for b in blocks)
    for step in (1, 2, 3):
        batch = synthetic_batch("compiled", step, phase="sft" if step == 1 else "rl")
        me, mc = eager.train_step(batch), compiled.train_step(batch)
        assert mc["loss_tokens"] == me["loss_tokens"] > 0
        assert mc["loss"] == pytest.approx(me["loss"], rel=1e-4)
        assert mc["grad_norm"] == pytest.approx(me["grad_norm"], rel=1e-4)
    want, got = eager.model.state_dict(), compiled.model.state_dict()
    assert list(got) == list(want)
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-3, atol=1e-4)
    assert compiled.weights_digest() != TrainerCore(cfg, tiny_dir).weights_digest()


def test_transformer_blocks_are_found_by_the_models_own_names(tiny_dir: Path) -> None:
    """FSDP's units and trainer.compile's regions: the classes `_no_split_modules` names,
    in order; a model naming none is refused by compile_blocks with the reason."""
    from roles.lib.model.loading import compile_blocks, transformer_blocks

    model = load_model(tiny_dir)
    blocks = transformer_blocks(model)
    assert blocks == list(model.model.layers) and len(blocks) == model.config.num_hidden_layers
    model._no_split_modules = []
    assert transformer_blocks(model) == []
    with pytest.raises(ValueError, match="no transformer blocks"):
        compile_blocks(model)
