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
from roles.trainer.core import (
    StepOutOfOrder,
    TrainerCore,
    cache_kwargs,
    latest_checkpoint,
    lr_at,
)
from schemas import BatchAssembled, RunStarted, Sample, batch_id, stable_seed
from schemas.arrays import pack_f32, pack_i32, pack_mask

TOKENIZER = build_tokenizer()
LETTERS = list("abcdefghijklmnopqrstuvwxyz")


def synthetic_sample(seed: int, index: int, *, sft: bool = False, attempt: int = -1) -> Sample:
    """A reverse-text-like sample: chat prompt, then the reversed string as the completion;
    ``attempt`` >= 0: one of several answers sampled for the prompt (GRPO's group), the
    reversed string cut short by a few letters, some of them wrong."""
    rng = np.random.default_rng(seed)
    text = "".join(rng.choice(LETTERS, size=int(rng.integers(6, 16))))
    prompt = TOKENIZER.apply_chat_template(
        [{"role": "user", "content": f"Reverse the text: {text}"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    prompt_ids = TOKENIZER.encode(prompt, add_special_tokens=False)
    answer = list(text[::-1])
    if attempt >= 0:
        rng = np.random.default_rng([seed, attempt])
        answer = answer[: len(answer) - int(rng.integers(0, 4))]
        for at in rng.choice(len(answer), size=2):
            answer[at] = str(rng.choice(LETTERS))
    completion_ids = TOKENIZER.encode("".join(answer) + "<|end|>", add_special_tokens=False)
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


def grpo_batch(
    run: str, step: int, groups: int = 3, size: int = 4, phase: str = "rl", alone: int = 0
) -> BatchAssembled:
    """Batch ``step`` shaped as GRPO's: ``groups`` prompts with ``size`` sampled answers
    each, then ``alone`` samples of prompts of their own."""
    samples = [
        synthetic_sample(stable_seed("grpo", step, g), g, sft=phase == "sft", attempt=k)
        for g in range(groups)
        for k in range(size)
    ] + [
        synthetic_sample(stable_seed("alone", step, i), i, sft=phase == "sft") for i in range(alone)
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
    """6 x parameters x tokens run over the step's time; MFU only with a peak (none is
    known for a CPU), and neither is compared by replay (timing)."""
    batch = synthetic_batch("flops", 1)
    plain = TrainerCore(load_config("smoke", ["trainer.device=cpu"]), tiny_dir).train_step(batch)
    assert plain["flops_per_s"] > 0 and "mfu" not in plain
    peaked = load_config("smoke", ["trainer.device=cpu", "trainer.peak_tflops=0.5"])
    m = TrainerCore(peaked, tiny_dir).train_step(batch)
    assert m["mfu"] == pytest.approx(m["flops_per_s"] / 0.5e12)
    params = sum(p.numel() for p in load_model(tiny_dir).parameters())
    assert m["flops_per_s"] == pytest.approx(6 * params * m["tokens_per_s"])
    assert is_timing("mfu") and is_timing("flops_per_s")
    # The tokens the model ran: a shared prompt once, not the samples' tokens.
    shared = TrainerCore(peaked, tiny_dir).train_step(grpo_batch("flops", 1))
    assert shared["computed_tokens"] < shared["tokens"]
    ran = shared["computed_tokens"] / shared["step_s"]
    assert shared["flops_per_s"] == pytest.approx(6 * params * ran)


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
    # Compiled blocks train whole rows (a cache state per layer would recompile them).
    assert eager.shares_prefixes() and not compiled.shares_prefixes()
    for step in (1, 2, 3):
        batch = grpo_batch("compiled", step, alone=1, phase="sft" if step == 1 else "rl")
        me, mc = eager.train_step(batch), compiled.train_step(batch)
        assert mc["computed_tokens"] == mc["tokens"] > me["computed_tokens"]
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


# -- shared prefixes (trainer.shared_prefix) ---------------------------------------------


def unshared(cfg: RunConfig) -> RunConfig:
    return cfg.model_copy(
        update={"trainer": cfg.trainer.model_copy(update={"shared_prefix": False})}
    )


def step_with_gradients(
    core: TrainerCore, batch: BatchAssembled
) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """``core.train_step(batch)``'s metrics and the gradients its optimizer step saw."""
    grads: dict[str, torch.Tensor] = {}

    def record(*_: object) -> None:
        params = core.model.named_parameters()
        grads.update({n: p.grad.clone() for n, p in params if p.grad is not None})

    hook = core.optimizer.register_step_pre_hook(record)
    try:
        return core.train_step(batch), grads
    finally:
        hook.remove()


def assert_trains_as_whole_rows(
    cfg: RunConfig, tiny_dir: Path, batch: BatchAssembled
) -> dict[str, float]:
    """The same batch from the same weights, shared and whole rows: the same loss
    denominators and token counts, the loss and every stat within float rounding, the
    same gradients within a small tolerance. Returns the shared step's metrics."""
    shared, whole = TrainerCore(cfg, tiny_dir), TrainerCore(unshared(cfg), tiny_dir)
    mbs, denominators = shared.micro_batches(batch)
    assert any(mb.prefix is not None for mb in mbs)
    assert denominators == whole.micro_batches(batch)[1]
    ms, gs = step_with_gradients(shared, batch)
    mw, gw = step_with_gradients(whole, batch)
    assert ms.keys() == mw.keys()
    for key in ("tokens", "samples", "loss_tokens", "rl_tokens", "ce_tokens", "ref_tokens"):
        assert ms[key] == mw[key], key
    assert mw["computed_tokens"] == mw["tokens"] > ms["computed_tokens"]
    # seq_len bounds shared rows as whole ones: never more rows per micro-batch.
    assert ms["micro_batches"] >= mw["micro_batches"]
    for key, value in deterministic_metrics(mw).items():
        if key not in ("computed_tokens", "micro_batches"):
            assert ms[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert gs.keys() == gw.keys() and gs
    for name, grad in gw.items():
        torch.testing.assert_close(gs[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    return ms


@pytest.mark.parametrize("phase", ["rl", "sft"])
def test_shared_prefixes_train_as_whole_rows(tiny_dir: Path, cfg: RunConfig, phase: str) -> None:
    """A GRPO batch runs each prompt once (about half the tokens here) and trains as its
    whole rows would, in either phase and either normalisation."""
    ms = assert_trains_as_whole_rows(cfg, tiny_dir, grpo_batch("shared", 1, phase=phase))
    assert ms["computed_tokens"] < 0.6 * ms["tokens"]
    by_sequence = load_config("smoke", ["trainer.seq_len=256", "trainer.device=cpu",
                                        "trainer.loss.normalize=sequences"])  # fmt: skip
    assert_trains_as_whole_rows(by_sequence, tiny_dir, grpo_batch("shared", 1, phase=phase))


def test_a_mixed_batch_shares_its_groups_and_trains_the_rest_whole(
    tiny_dir: Path, cfg: RunConfig
) -> None:
    """Groups and samples of prompts of their own in one batch, split over micro-batches
    (a short seq_len splits a group: each part runs its own copy of the prompt)."""
    batch = grpo_batch("mixed", 1, alone=3)
    assert_trains_as_whole_rows(cfg, tiny_dir, batch)
    kinds = {mb.prefix is None for mb in TrainerCore(cfg, tiny_dir).micro_batches(batch)[0]}
    assert kinds == {True, False}  # shared micro-batches, and whole rows for the rest
    short = load_config("smoke", ["trainer.seq_len=96", "trainer.device=cpu"])
    mbs, _ = TrainerCore(short, tiny_dir).micro_batches(batch)
    shared = [mb for mb in mbs if mb.prefix is not None]
    assert len(shared) > 3 and any(mb.prefix is None for mb in mbs)
    assert sorted(i for mb in mbs for i in mb.indices) == list(range(len(batch.samples)))
    assert_trains_as_whole_rows(short, tiny_dir, batch)


def test_a_batch_without_shared_prefixes_trains_exactly_as_before(
    tiny_dir: Path, cfg: RunConfig
) -> None:
    """Distinct prompts: no shared micro-batch, and bit for bit what trainer.shared_prefix
    = false trains (the same path)."""
    batch = synthetic_batch("distinct", 1)
    shared, whole = TrainerCore(cfg, tiny_dir), TrainerCore(unshared(cfg), tiny_dir)
    assert all(mb.prefix is None for mb in shared.micro_batches(batch)[0])
    ms, mw = shared.train_step(batch), whole.train_step(batch)
    assert deterministic_metrics(ms) == deterministic_metrics(mw)
    assert ms["computed_tokens"] == ms["tokens"]
    assert shared.weights_digest() == whole.weights_digest()


def prefix_lengths(core: TrainerCore, batch: BatchAssembled) -> dict[int, int]:
    """The length of the shared prefix of each sample that has one, by its index."""
    return {
        i: mb.prefix.lengths[int(mb.prefix.rows[k])]
        for mb in core.micro_batches(batch)[0]
        if mb.prefix is not None
        for k, i in enumerate(mb.indices)
    }


def test_channel_samples_share_only_up_to_their_first_loss_token(
    tiny_dir: Path, cfg: RunConfig
) -> None:
    """A ce channel on the last prompt tokens (a tool's output) and a ref_kl channel: the
    prefix ends before the first of them, and the step trains as whole rows."""
    batch = grpo_batch("channels", 1)
    batch = msgspec.structs.replace(batch, samples=[with_channels(s) for s in batch.samples])
    lengths = prefix_lengths(TrainerCore(cfg, tiny_dir), batch)
    assert sorted(lengths) == list(range(len(batch.samples)))
    for i, length in lengths.items():
        prompt = int(np.argmax(batch.samples[i].arrays()["mask"]))
        assert length == prompt - 5  # the 4 tool tokens, and the one whose logits predict them
    ms = assert_trains_as_whole_rows(cfg, tiny_dir, batch)
    assert ms["ce_tokens"] > 0 and ms["ref_tokens"] > 0


def two_turns(first: Sample, second: Sample, train_first: bool) -> Sample:
    """``first``'s conversation, then ``second``'s prompt and answer as a next turn; the
    first answer trained or not (a turn replayed from history)."""
    a, b = first.arrays(), second.arrays()
    both = {name: np.concatenate([a[name], b[name]]) for name in b}
    if not train_first:
        both["mask"][: len(a["mask"])] = False
        both["advantages"][: len(a["mask"])] = 0.0
        if "sft_mask" in both:
            both["sft_mask"][: len(a["mask"])] = False
    return msgspec.structs.replace(
        second,
        token_ids=pack_i32(both["token_ids"].tolist()), mask=pack_mask(both["mask"].tolist()),
        logprobs=pack_f32(both["logprobs"].tolist()),
        temperatures=pack_f32(both["temperatures"].tolist()),
        advantages=pack_f32(both["advantages"].tolist()),
        sft_mask=pack_mask(both["sft_mask"].tolist()) if "sft_mask" in both else None,
    )  # fmt: skip


@pytest.mark.parametrize("phase", ["rl", "sft"])
@pytest.mark.parametrize("train_first", [True, False])
def test_multi_turn_samples_share_only_up_to_their_first_loss_token(
    tiny_dir: Path, phase: str, train_first: bool
) -> None:
    """Two-turn samples of one group: with its first answers trained, they share the
    first prompt; with one untrained first turn for all, its prompt, that turn and the
    second prompt (less its last token). Either way, the step trains as whole rows."""
    cfg = load_config("smoke", ["trainer.seq_len=1024", "trainer.device=cpu"])  # one micro-batch
    sft = phase == "sft"
    samples = []
    for k in range(4):
        first = synthetic_sample(1, 0, sft=sft, attempt=k if train_first else 0)
        samples.append(two_turns(first, synthetic_sample(2, 0, sft=sft, attempt=k), train_first))
    batch = msgspec.structs.replace(
        grpo_batch("turns", 1, phase=phase), samples=samples, num_tokens=sum(map(len, samples))
    )
    shared = TrainerCore(cfg, tiny_dir)
    first_turn, second_prompt = len(synthetic_sample(1, 0, attempt=0)), synthetic_sample(2, 0)
    prompt = int(np.argmax(synthetic_sample(1, 0).arrays()["mask"]))
    expected = (
        prompt - 1
        if train_first
        else first_turn + int(np.argmax(second_prompt.arrays()["mask"])) - 1
    )
    assert prefix_lengths(shared, batch) == dict.fromkeys(range(4), expected)
    assert_trains_as_whole_rows(cfg, tiny_dir, batch)


def test_two_cores_sharing_prefixes_are_bit_identical(tiny_dir: Path, cfg: RunConfig) -> None:
    """The shared path is deterministic: same weights and batches (sft, then rl, one with
    samples of their own), the same metrics and weights digests at every step."""
    a, b = TrainerCore(cfg, tiny_dir), TrainerCore(cfg, tiny_dir)
    for step in (1, 2, 3):
        batch = grpo_batch("det", step, alone=step - 1, phase="sft" if step == 1 else "rl")
        ma, mb = a.train_step(batch), b.train_step(batch)
        assert ma["computed_tokens"] < ma["tokens"]
        assert deterministic_metrics(ma) == deterministic_metrics(mb)
        assert a.weights_digest() == b.weights_digest()


def test_lora_shares_prefixes_too(tiny_dir: Path) -> None:
    """The peft-wrapped model takes the cache as its base model does."""
    lora = load_config("smoke", ["trainer.seq_len=256", "trainer.device=cpu",
                                 "trainer.lora={rank=4, alpha=8}"])  # fmt: skip
    assert_trains_as_whole_rows(lora, tiny_dir, grpo_batch("lora", 1))


def test_a_model_that_takes_no_cache_trains_whole_rows(tiny_dir: Path) -> None:
    """Only a forward that takes a KV cache (transformers 5's ``cache``) shares prefixes;
    another trains whole rows."""

    class NoCache(torch.nn.Module):
        def forward(self, input_ids: torch.Tensor, use_cache: bool = False) -> None: ...

    assert cache_kwargs(NoCache()) == (None, {})
    assert cache_kwargs(load_model(tiny_dir)) == ("cache", {"logits_to_keep": 1})
    core = TrainerCore(load_config("smoke", ["trainer.device=cpu"]), tiny_dir)
    core._cache_kwarg = None  # as a model without one
    assert all(mb.prefix is None for mb in core.micro_batches(grpo_batch("no-cache", 1))[0])


def test_a_run_recorded_before_shared_prefixes_replays_whole_rows() -> None:
    """Its trainer reported no computed_tokens, and trained whole rows whatever its config
    (which has no trainer.shared_prefix) says: replay trains them so; a later one's
    config stands."""
    from replay.diff import StepRecord
    from replay.trainer import TrainerLog

    config = load_config("smoke").model_dump(mode="json")
    del config["trainer"]["shared_prefix"]
    start = RunStarted(run="old", config=config, seed=0, model_path="m")
    refused = StepRecord(1, {"refused_batch": 1.0, "tokens": 9.0})
    for metrics, shares in (({"loss": 0.5}, False), ({"computed_tokens": 5.0}, True), ({}, True)):
        recorded = {1: refused, 2: StepRecord(2, metrics)} if metrics else {1: refused}
        log = TrainerLog([(1, start)], [], {1: 2, 2: 3}, recorded)
        assert log.config(2).trainer.shared_prefix is shares
        assert log.config(2, ["trainer.shared_prefix=true"]).trainer.shared_prefix
