"""The trainer loss: gradients (finite differences, hand-derived), masking, SFT, normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from configs import LossConfig
from roles.trainer.loss import LossBatch, LossStats, loss_denominator, policy_loss, token_logprobs

V = 7


def make_batch(
    logits: torch.Tensor,
    *,
    seed: int = 0,
    ratio_noise: float = 0.05,
    mask: torch.Tensor | None = None,
    sft_mask: torch.Tensor | None = None,
    temperatures: torch.Tensor | None = None,
) -> LossBatch:
    """A batch whose inference logprobs sit close to the model's (ratios near 1)."""
    g = torch.Generator().manual_seed(seed)
    b, t, _ = logits.shape
    targets = torch.randint(0, V, (b, t), generator=g)
    temps = temperatures if temperatures is not None else torch.full((b, t), 1.0)
    with torch.no_grad():
        lp, _ = token_logprobs(logits, targets, temps.to(logits.dtype))
    noise = (torch.rand(b, t, generator=g, dtype=torch.float64) * 2 - 1) * ratio_noise
    return LossBatch(
        targets=targets,
        mask=mask if mask is not None else torch.rand(b, t, generator=g) < 0.7,
        sft_mask=sft_mask if sft_mask is not None else torch.zeros(b, t, dtype=torch.bool),
        inference_logprobs=(lp.double() + noise).to(logits.dtype),
        temperatures=temps,
        advantages=torch.randn(b, t, generator=g, dtype=torch.float64).to(logits.dtype),
    )


def grad_of(
    logits: torch.Tensor, mb: LossBatch, cfg: LossConfig, phase: str = "rl"
) -> torch.Tensor:
    x = logits.detach().clone().requires_grad_(True)
    loss, _ = policy_loss(x, mb, cfg, phase, loss_denominator([mb], phase, cfg.normalize))
    loss.backward()
    assert x.grad is not None
    return x.grad


@pytest.mark.parametrize("normalize", ["tokens", "sequences"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_gradient_matches_finite_differences(normalize: str, kl_coef: float) -> None:
    """Autograd gradient of the loss w.r.t. logits equals central finite differences (float64)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 5, V, generator=g, dtype=torch.float64)
    temps = torch.tensor([[1.0, 0.7, 0.0, 1.3, 1.0], [0.5, 1.0, 1.0, 2.0, 1.0]])
    sft = torch.zeros(2, 5, dtype=torch.bool)
    sft[1, 4] = True
    mb = make_batch(logits, seed=2, temperatures=temps.double(), sft_mask=sft)
    cfg = LossConfig(kl_coef=kl_coef, normalize=normalize)
    den = loss_denominator([mb], "rl", normalize)

    def f(x: torch.Tensor) -> float:
        return float(policy_loss(x, mb, cfg, "rl", den)[0])

    analytic = grad_of(logits, mb, cfg)
    numeric = torch.zeros_like(logits)
    eps = 1e-6
    flat, out = logits.view(-1), numeric.view(-1)
    for i in range(flat.numel()):
        plus, minus = flat.clone(), flat.clone()
        plus[i] += eps
        minus[i] -= eps
        out[i] = (f(plus.view_as(logits)) - f(minus.view_as(logits))) / (2 * eps)
    assert analytic.abs().max() > 1e-3  # the check is not vacuous
    torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=1e-8)


def test_gradient_matches_hand_derived_formula() -> None:
    """One kept token: dL/dz = -(r*A) * (onehot - softmax(z/T)) / T / N, with N counting every loss token."""
    z = torch.tensor([[[0.5, -0.2, 0.1], [0.3, 0.0, -1.0]]], dtype=torch.float64)
    temp, adv, k = 0.5, 2.0, 2
    p = torch.softmax(z[0, 0] / temp, -1)
    lp = math.log(float(p[k]))
    mb = LossBatch(
        targets=torch.tensor([[k, 0]]),
        mask=torch.tensor([[True, True]]),
        sft_mask=torch.tensor([[False, False]]),
        # token 0: ratio e^0.1 (kept); token 1: ratio e^3 (masked, but still counted in N)
        inference_logprobs=torch.tensor([[lp - 0.1, -10.0]], dtype=torch.float64),
        temperatures=torch.tensor([[temp, 1.0]], dtype=torch.float64),
        advantages=torch.tensor([[adv, 5.0]], dtype=torch.float64),
    )
    cfg = LossConfig(trust_region_low=0.2, trust_region_high=0.28)
    grad = grad_of(z, mb, cfg)
    r = math.exp(0.1)
    onehot = torch.nn.functional.one_hot(torch.tensor(k), 3).double()
    expected = -(r * adv) * (onehot - p) / temp / 2
    torch.testing.assert_close(grad[0, 0], expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(grad[0, 1], torch.zeros(3, dtype=torch.float64))


def test_trust_region_masked_tokens_get_zero_gradient_and_are_counted() -> None:
    """Tokens with r outside [1-low, 1+high] get exactly zero gradient; masked_fraction counts them."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 6, V, generator=g, dtype=torch.float64)
    mb = make_batch(logits, mask=torch.ones(1, 6, dtype=torch.bool), ratio_noise=0.01)
    shift = torch.tensor([[0.0, 5.0, 0.0, -5.0, 0.0, 80.0]], dtype=torch.float64)
    mb.inference_logprobs = mb.inference_logprobs - shift  # r = e^5, e^-5, e^80: out
    cfg = LossConfig(kl_coef=0.5)
    grad = grad_of(logits, mb, cfg)
    for t in (1, 3, 5):
        assert torch.equal(grad[0, t], torch.zeros(V, dtype=torch.float64))
    for t in (0, 2, 4):
        assert grad[0, t].abs().sum() > 0
    _, stats = policy_loss(logits, mb, cfg, "rl", 6)
    m = stats.finalize()
    assert m["masked_fraction"] == pytest.approx(3 / 6)
    assert math.isfinite(m["ratio_mean"]) and math.isfinite(m["mismatch_kl"])


def test_unmasked_tokens_get_zero_gradient() -> None:
    """Positions with mask 0 (prompt, padding) get exactly zero gradient."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 4, V, generator=g, dtype=torch.float64)
    mask = torch.tensor([[False, True, False, True], [True, False, False, False]])
    grad = grad_of(logits, make_batch(logits, mask=mask), LossConfig())
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
    assert (grad[mask].abs().sum(-1) > 0).all()


def test_temperature_scales_logits_and_zero_means_one() -> None:
    """RL logprobs use logits / T per token; T = 0 (greedy) is treated as T = 1."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 3, V, generator=g, dtype=torch.float64)
    mb = make_batch(logits, mask=torch.ones(1, 3, dtype=torch.bool), seed=6)
    mb.temperatures = torch.tensor([[2.0, 2.0, 2.0]], dtype=torch.float64)
    cfg = LossConfig(trust_region_low=0.99, trust_region_high=1e9)  # nothing masked
    at_two, _ = policy_loss(logits, mb, cfg, "rl", 3)
    mb_one = LossBatch(**{**mb.__dict__, "temperatures": torch.ones(1, 3, dtype=torch.float64)})
    pre_scaled, _ = policy_loss(logits / 2.0, mb_one, cfg, "rl", 3)
    unscaled, _ = policy_loss(logits, mb_one, cfg, "rl", 3)
    torch.testing.assert_close(at_two, pre_scaled)
    assert not torch.allclose(at_two, unscaled)
    mb_zero = LossBatch(**{**mb.__dict__, "temperatures": torch.zeros(1, 3, dtype=torch.float64)})
    torch.testing.assert_close(policy_loss(logits, mb_zero, cfg, "rl", 3)[0], unscaled)


def test_sft_mask_tokens_get_weighted_ce_gradient_without_ratio() -> None:
    """sft_mask tokens: gradient = -A * grad(lp) / N even when their ratio is far outside the trust region."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(1, 4, V, generator=g, dtype=torch.float64)
    sft = torch.tensor([[False, True, True, False]])
    mask = torch.tensor([[True, False, True, False]])  # sft positions train whatever the mask
    mb = make_batch(logits, mask=mask, sft_mask=sft, seed=8, temperatures=torch.full((1, 4), 0.5))
    mb.inference_logprobs = mb.inference_logprobs - 50.0  # ratio e^50 everywhere
    mb.advantages = torch.tensor([[1.0, 0.1, 0.3, 9.0]], dtype=torch.float64)
    cfg = LossConfig(kl_coef=1.0)
    grad = grad_of(logits, mb, cfg)
    n = 3  # loss positions: 0 (rl, masked by the trust region), 1 and 2 (sft)
    for t in (1, 2):
        x = logits[0, t].detach().clone().requires_grad_(True)
        lp = torch.log_softmax(x, -1)[mb.targets[0, t]]  # temperature 1 for SFT tokens
        (expected,) = torch.autograd.grad(-mb.advantages[0, t] * lp / n, x)
        torch.testing.assert_close(grad[0, t], expected, rtol=1e-12, atol=1e-14)
    assert torch.equal(grad[0, 0], torch.zeros(V, dtype=torch.float64))
    assert torch.equal(grad[0, 3], torch.zeros(V, dtype=torch.float64))


def test_sft_phase_is_plain_cross_entropy_on_mask_tokens() -> None:
    """Phase "sft": mean cross-entropy over mask tokens, ignoring advantages, ratios and temperatures."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(2, 5, V, generator=g, dtype=torch.float64)
    mb = make_batch(logits, seed=10, temperatures=torch.full((2, 5), 0.3))
    mb.inference_logprobs = mb.inference_logprobs + 30.0
    den = loss_denominator([mb], "sft", "tokens")
    loss, stats = policy_loss(logits, mb, LossConfig(), "sft", den)
    expected = torch.nn.functional.cross_entropy(logits[mb.mask], mb.targets[mb.mask])
    torch.testing.assert_close(loss, expected)
    assert stats.rl_tokens == 0 and stats.sft_tokens == int(mb.mask.sum()) == den


@pytest.mark.parametrize("normalize", ["tokens", "sequences"])
def test_micro_batches_sum_to_the_loss_and_gradient_of_one_big_batch(normalize: str) -> None:
    """Normalising by the whole batch's count makes split micro-batches equal one big batch."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 6, V, generator=g, dtype=torch.float64)
    mb = make_batch(logits, seed=12)
    mb.mask[3] = False  # a sequence with no loss token: not counted by "sequences"
    cfg = LossConfig(normalize=normalize, kl_coef=0.1)
    big_grad = grad_of(logits, mb, cfg)
    big_loss, big_stats = policy_loss(
        logits, mb, cfg, "rl", loss_denominator([mb], "rl", normalize)
    )

    parts = [slice(0, 2), slice(2, 3), slice(3, 5)]
    mbs = [LossBatch(**{k: v[s] for k, v in mb.__dict__.items()}) for s in parts]
    den = loss_denominator(mbs, "rl", normalize)
    assert den == (int(mb.mask.sum()) if normalize == "tokens" else 4)
    x = logits.detach().clone().requires_grad_(True)
    total, stats = torch.zeros((), dtype=torch.float64), LossStats()
    for s, part in zip(parts, mbs, strict=True):
        loss, st = policy_loss(x[s], part, cfg, "rl", den)
        loss.backward()
        total, stats = total + loss.detach(), stats + st
    torch.testing.assert_close(total, big_loss.detach(), rtol=1e-12, atol=1e-15)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, big_grad, rtol=1e-12, atol=1e-15)
    assert stats.finalize()["entropy"] == pytest.approx(big_stats.finalize()["entropy"])
