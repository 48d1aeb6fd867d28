"""Nothing non-finite is trained or served: refused batches, dropped steps, refused weights.

The trainer core refuses a batch holding a sample ``Sample.problem`` refuses (before
anything is trained) and counts it as a step that trained nothing; a step whose loss or
gradient norm is not finite leaves every parameter as it was. The torch inference
backend refuses a state dict with a NaN and keeps serving the old weights, and weight
fetches retry transient errors only.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import numpy as np
import pytest
import torch

from bus.errors import BodyError, Rejected
from bus.waits import retry_transient
from configs import RunConfig, load_config
from replay.trainer import replay_steps
from roles.inference.backend import WeightsNotFinite
from roles.inference.torch_backend import TorchBackend
from roles.lib.model.tiny import build_tiny_model
from roles.lib.model.weights import (
    bytes_to_state_dict,
    digest,
    state_dict_to_bytes,
    tensors_to_bytes,
)
from roles.trainer import core as core_module
from roles.trainer.core import TrainerCore
from roles.trainer.loss import LossStats
from schemas import BatchAssembled, Sample
from schemas.arrays import f32, mask, pack_f32, pack_mask
from tests.unit.test_trainer_core import synthetic_batch


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("nonfinite") / "tiny", seed=0)


@pytest.fixture
def cfg() -> RunConfig:
    return load_config("smoke", ["trainer.seq_len=256", "trainer.lr=1e-3", "trainer.device=cpu"])


def with_sample(batch: BatchAssembled, index: int, **changes: object) -> BatchAssembled:
    """``batch`` with sample ``index`` changed (fields given as msgspec values)."""
    samples = list(batch.samples)
    samples[index] = msgspec.structs.replace(samples[index], **changes)
    return msgspec.structs.replace(batch, samples=samples)


def nan_at_first_trained_token(values: bytes, sample: Sample) -> bytes:
    out = f32(values).copy()
    out[int(np.argmax(mask(sample.mask)))] = np.nan
    return pack_f32(out.tolist())


def huge_ce_weights(batch: BatchAssembled) -> BatchAssembled:
    """Every completion token in the ce channel with the largest float32 weight: every
    value is finite (``Sample.problem`` passes it), but the loss overflows to inf."""
    samples = []
    for s in batch.samples:
        m = mask(s.mask)
        weights = np.where(m > 0, np.float32(3e38), np.float32(0.0))
        samples.append(
            msgspec.structs.replace(s, sft_mask=pack_mask(m.tolist()), ce_weights=pack_f32(weights.tolist()))
        )  # fmt: skip
    return msgspec.structs.replace(batch, samples=samples)


def parameters(core: TrainerCore) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in core.model.state_dict().items()}


def assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype, k


# -- the trainer refuses a batch it cannot train ------------------------------------------


@pytest.mark.parametrize("field", ["advantages", "ce_weights"])
def test_a_batch_with_a_nan_is_refused_before_anything_is_trained(
    tiny_dir: Path, cfg: RunConfig, field: str
) -> None:
    """A NaN advantage (rl) or ce weight: Rejected naming the step, sample and problem."""
    core = TrainerCore(cfg, tiny_dir)
    good = synthetic_batch("refuse", 1, n_samples=4)
    sample = good.samples[2]
    source = sample.advantages if field == "advantages" else pack_f32([1.0] * len(sample))
    bad = with_sample(good, 2, **{field: nan_at_first_trained_token(source, sample)})
    before = parameters(core)

    with pytest.raises(Rejected) as refused:
        core.train_step(bad)
    message = str(refused.value)
    assert "batch step 1 sample 2" in message and f"{field} holds a non-finite value" in message
    assert core.step == 0 and core.optimizer.state == {}
    assert_bit_identical(before, parameters(core))


def test_a_refused_batch_is_a_step_that_trained_nothing(tiny_dir: Path, cfg: RunConfig) -> None:
    """refuse_step moves the step on with the weights unchanged, so the next batch
    follows it; a replay steps over it the same way and reaches the same weights."""
    batches = [synthetic_batch("step-over", s, n_samples=4) for s in (1, 2, 3)]
    bad = with_sample(batches[1], 0, reward=math.inf)
    core = TrainerCore(cfg, tiny_dir)
    core.train_step(batches[0])
    after_one = core.weights_digest()
    with pytest.raises(ValueError, match="is trainable"):
        core.refuse_step(batches[1])  # a good batch is never stepped over
    with pytest.raises(Rejected, match="reward is not finite"):
        core.train_step(bad)
    metrics = core.refuse_step(bad)
    assert metrics["refused_batch"] == 1.0 and "loss" not in metrics
    assert core.step == 2 and core.weights_digest() == after_one
    assert core.train_step(batches[2])["loss_tokens"] > 0 and core.step == 3

    replayed = replay_steps(TrainerCore(cfg, tiny_dir), [batches[0], bad, batches[2]], None)
    assert [r.step for r in replayed.steps] == [1, 2, 3]
    assert replayed.steps[1].metrics["refused_batch"] == 1.0
    assert replayed.steps[0].digest == replayed.steps[1].digest
    assert replayed.steps[2].digest == digest(core.weights_bytes())


def test_an_unknown_phase_is_refused(tiny_dir: Path, cfg: RunConfig) -> None:
    core = TrainerCore(cfg, tiny_dir)
    bad = msgspec.structs.replace(synthetic_batch("phase", 1, n_samples=2), phase="warmup")
    with pytest.raises(Rejected, match="unknown phase 'warmup'"):
        core.train_step(bad)
    assert core.refuse_step(bad)["refused_batch"] == 1.0 and core.step == 1


# -- a non-finite step is not applied -------------------------------------------------------


def test_a_nonfinite_step_leaves_every_parameter_bit_identical(
    tiny_dir: Path, cfg: RunConfig
) -> None:
    """Finite inputs whose loss overflows: no optimizer step, nonfinite_step=1 with the
    loss, and the fold goes on exactly as if the step had been refused."""
    core = TrainerCore(cfg, tiny_dir)
    before = parameters(core)
    blowup = huge_ce_weights(synthetic_batch("blowup", 1, n_samples=4))
    assert all(s.problem() is None for s in blowup.samples)

    metrics = core.train_step(blowup)
    assert metrics["nonfinite_step"] == 1.0
    assert not (math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"]))
    assert core.step == 1 and core.optimizer.state == {}
    assert all(p.grad is None for p in core.model.parameters())
    assert_bit_identical(before, parameters(core))

    # Step 2 after a dropped step 1 == step 2 after a refused step 1: both trained nothing.
    good = synthetic_batch("blowup", 2, n_samples=4)
    m2 = core.train_step(good)
    assert "nonfinite_step" not in m2 and m2["loss_tokens"] > 0
    other = TrainerCore(cfg, tiny_dir)
    other.refuse_step(with_sample(blowup, 0, reward=math.nan))
    other.train_step(good)
    assert other.weights_digest() == core.weights_digest()


def test_a_nonfinite_loss_is_dropped_whatever_produced_it(
    tiny_dir: Path, cfg: RunConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check is on the step's loss: a NaN from the loss itself is dropped the same way."""
    real = core_module.policy_loss

    def nan_loss(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, LossStats]:
        loss, stats = real(*args, **kwargs)
        return loss * math.nan, dataclasses.replace(stats, loss=math.nan)

    monkeypatch.setattr(core_module, "policy_loss", nan_loss)
    core = TrainerCore(cfg, tiny_dir)
    before = parameters(core)
    metrics = core.train_step(synthetic_batch("nan-loss", 1, n_samples=2))
    assert metrics["nonfinite_step"] == 1.0 and math.isnan(metrics["loss"])
    assert_bit_identical(before, parameters(core))


# -- inference refuses non-finite weights -------------------------------------------------


async def test_the_torch_backend_refuses_a_nan_tensor_and_keeps_its_weights(
    tiny_dir: Path,
) -> None:
    backend = TorchBackend.from_path(tiny_dir, device="cpu")
    try:
        before = parameters_of(backend)
        state = {k: v.clone() for k, v in backend.engine.model.state_dict().items()}
        data = state_dict_to_bytes(backend.engine.model)
        names = sorted(bytes_to_state_dict(data))
        target = names[len(names) // 2]
        state[target].view(-1)[3] = math.nan
        poisoned = tensors_to_bytes({k: state[k] for k in names})

        with pytest.raises(WeightsNotFinite, match=repr(target)) as refused:
            await backend.load_weights(poisoned, digest(poisoned), version=1)
        assert refused.value.tensor == target
        assert backend.policy_version == 0
        assert_bit_identical(before, parameters_of(backend))

        await backend.load_weights(data, digest(data), version=1)  # finite: swapped in
        assert backend.policy_version == 1
    finally:
        await backend.close()


def parameters_of(backend: TorchBackend) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in backend.engine.model.state_dict().items()}


# -- weight fetches retry transient errors only ---------------------------------------------


async def test_a_transient_fetch_error_is_retried_with_backoff() -> None:
    calls: list[int] = []
    waits: list[float] = []
    told: list[tuple[int, float, str]] = []

    async def flaky() -> bytes:
        calls.append(1)
        if len(calls) < 3:
            raise nats.errors.TimeoutError
        return b"weights"

    async def sleep(seconds: float) -> bool:
        waits.append(seconds)
        return False

    got = await retry_transient(
        flaky, attempts=5, backoff_s=0.5, sleep=sleep,
        on_retry=lambda n, d, e: told.append((n, d, type(e).__name__)),
    )  # fmt: skip
    assert got == b"weights" and len(calls) == 3
    assert waits == [0.5, 1.0] and [t[:2] for t in told] == [(1, 0.5), (2, 1.0)]
    assert told[0][2] == "TimeoutError"


async def test_retries_are_bounded_and_other_errors_are_not_retried() -> None:
    calls: list[str] = []

    async def sleep(seconds: float) -> bool:
        return False

    async def always_down() -> bytes:
        calls.append("down")
        raise ConnectionResetError("gone")

    with pytest.raises(ConnectionResetError):
        await retry_transient(always_down, attempts=3, backoff_s=0.0, on_retry=lambda *a: None, sleep=sleep)  # fmt: skip
    assert calls == ["down"] * 3

    async def corrupt() -> bytes:
        calls.append("corrupt")
        raise BodyError("object does not match its reference")

    calls.clear()
    with pytest.raises(BodyError):
        await retry_transient(corrupt, attempts=3, backoff_s=0.0, on_retry=lambda *a: None, sleep=sleep)  # fmt: skip
    assert calls == ["corrupt"]

    async def stopping(seconds: float) -> bool:
        return True  # the role stops: no further try

    calls.clear()
    with pytest.raises(ConnectionResetError):
        await retry_transient(always_down, attempts=5, backoff_s=0.0, on_retry=lambda *a: None, sleep=stopping)  # fmt: skip
    assert calls == ["down"]
