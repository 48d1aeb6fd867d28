"""The trainer loss: per-channel gradients (finite differences, hand-derived), masking, normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from configs import LossConfig
from roles.trainer.loss import (
    CHANNELS,
    LossBatch,
    LossStats,
    loss_denominators,
    policy_loss,
    positions,
    token_logprobs,
)
from tests.unit.loss_batches import (
    F64,
    V,
    fd_objective,
    finite_difference,
    grad_of,
    make_batch,
    replace,
    three_channel_batch,
)


@pytest.mark.parametrize("normalize", ["tokens", "sequences"])
@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_gradient_matches_finite_differences(normalize: str, kl_coef: float) -> None:
    """Autograd gradient of the three-channel loss equals central finite differences (float64)."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, V, generator=g, dtype=F64)
    mb = three_channel_batch(logits, seed=2)
    pos = positions(mb, "rl")
    sampled_ref_at_t = pos["ref"].positions & mb.mask & (mb.temperatures != 1)
    assert all(bool(c.positions.any()) for c in pos.values()) and bool(sampled_ref_at_t.any())
    cfg = LossConfig(kl_coef=kl_coef, normalize=normalize, trust_region_high=0.5)
    analytic = grad_of(logits, mb, cfg)
    assert analytic.abs().max() > 1e-3  # the check is not vacuous
    numeric = finite_difference(fd_objective(logits, mb, cfg), logits)
    torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("normalize", ["tokens", "sequences"])
@pytest.mark.parametrize("channel", CHANNELS)
def test_each_channel_alone_matches_finite_differences(channel: str, normalize: str) -> None:
    """With only one channel populated, its gradient alone still equals finite differences."""
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(2, 4, V, generator=g, dtype=F64)
    temps = torch.tensor([[0.5, 1.0, 1.5, 0.0], [1.0, 2.0, 0.7, 1.0]], dtype=F64)
    some = torch.tensor([[True, True, False, True], [False, True, True, True]])
    nowhere = torch.zeros_like(some)
    # (A sampled token is always rl or ce in phase "rl": a lone ref channel is unsampled.)
    mb = make_batch(
        logits, seed=14, temperatures=temps,
        mask=some if channel == "rl" else nowhere,
        sft_mask=some if channel == "ce" else nowhere,
        ce_weights=torch.tensor([[0.4, 1.0, 0.0, 2.0], [0.0, 0.3, 0.5, 1.0]], dtype=F64),
        ref_weights=torch.where(some, 0.8, 0.0).double() if channel == "ref" else None,
    )  # fmt: skip
    cfg = LossConfig(trust_region_low=0.9, trust_region_high=9.0, normalize=normalize)
    den = loss_denominators([mb], "rl", normalize)
    assert [name for name in CHANNELS if den[name]] == [channel]
    analytic = grad_of(logits, mb, cfg)
    numeric = finite_difference(fd_objective(logits, mb, cfg), logits)
    assert analytic.abs().max() > 1e-3
    torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=1e-8)


def test_rl_gradient_matches_hand_derived_formula() -> None:
    """One kept token: dL/dz = -(r*A) * (onehot - softmax(z/T)) / T / N_rl, N_rl counting masked ones."""
    z = torch.tensor([[[0.5, -0.2, 0.1], [0.3, 0.0, -1.0], [0.1, 0.1, 0.1]]], dtype=F64)
    temp, adv, k = 0.5, 2.0, 2
    p = torch.softmax(z[0, 0] / temp, -1)
    lp = math.log(float(p[k]))
    mb = LossBatch(
        targets=torch.tensor([[k, 0, 1]]),
        mask=torch.tensor([[True, True, False]]),
        sft_mask=torch.tensor([[False, False, True]]),  # a ce token: not in N_rl
        # token 0: ratio e^0.1 (kept); token 1: ratio e^3 (masked, but still counted in N)
        inference_logprobs=torch.tensor([[lp - 0.1, -10.0, 0.0]], dtype=F64),
        temperatures=torch.tensor([[temp, 1.0, 1.0]], dtype=F64),
        advantages=torch.tensor([[adv, 5.0, 0.0]], dtype=F64),
        ce_weights=torch.ones(1, 3, dtype=F64),
        ref_logprobs=torch.zeros(1, 3, dtype=F64),
        ref_weights=torch.zeros(1, 3, dtype=F64),
    )
    cfg = LossConfig(trust_region_low=0.2, trust_region_high=0.28)
    grad = grad_of(z, mb, cfg)
    r = math.exp(0.1)
    onehot = torch.nn.functional.one_hot(torch.tensor(k), 3).double()
    expected = -(r * adv) * (onehot - p) / temp / 2
    torch.testing.assert_close(grad[0, 0], expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(grad[0, 1], torch.zeros(3, dtype=F64))


def test_trust_region_masked_tokens_get_zero_gradient_and_are_counted() -> None:
    """Tokens with r outside [1-low, 1+high] get exactly zero gradient; masked_fraction counts them."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 6, V, generator=g, dtype=F64)
    mb = make_batch(logits, mask=torch.ones(1, 6, dtype=torch.bool), ratio_noise=0.01)
    shift = torch.tensor([[0.0, 5.0, 0.0, -5.0, 0.0, 80.0]], dtype=F64)
    mb.inference_logprobs = mb.inference_logprobs - shift  # r = e^5, e^-5, e^80: out
    cfg = LossConfig(kl_coef=0.5)
    grad = grad_of(logits, mb, cfg)
    for t in (1, 3, 5):
        assert torch.equal(grad[0, t], torch.zeros(V, dtype=F64))
    for t in (0, 2, 4):
        assert grad[0, t].abs().sum() > 0
    _, stats = policy_loss(logits, mb, cfg, "rl", loss_denominators([mb], "rl", "tokens"))
    m = stats.finalize()
    assert m["masked_fraction"] == pytest.approx(3 / 6)
    assert math.isfinite(m["ratio_mean"]) and math.isfinite(m["mismatch_kl"])


def test_positions_outside_every_channel_get_zero_gradient() -> None:
    """Positions in no channel (prompt, padding, ref weight 0) get exactly zero gradient."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 4, V, generator=g, dtype=F64)
    mask = torch.tensor([[False, True, False, False], [True, False, False, False]])
    sft = torch.tensor([[False, False, False, True], [False, False, False, False]])
    ref_w = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, 0.5, 0.0, 0.0]], dtype=F64)
    mb = make_batch(logits, mask=mask, sft_mask=sft, ref_weights=ref_w)
    grad = grad_of(logits, mb, LossConfig())
    trained = mask | sft | (ref_w > 0)
    assert torch.equal(grad[~trained], torch.zeros_like(grad[~trained]))
    assert (grad[trained].abs().sum(-1) > 0).all()


def test_temperature_scales_logits_and_zero_means_one() -> None:
    """RL logprobs use logits / T per token; T = 0 (greedy) is treated as T = 1."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(1, 3, V, generator=g, dtype=F64)
    mb = make_batch(logits, mask=torch.ones(1, 3, dtype=torch.bool), seed=6)
    mb.temperatures = torch.tensor([[2.0, 2.0, 2.0]], dtype=F64)
    cfg = LossConfig(trust_region_low=0.99, trust_region_high=1e9)  # nothing masked
    den = loss_denominators([mb], "rl", "tokens")
    at_two, _ = policy_loss(logits, mb, cfg, "rl", den)
    mb_one = replace(mb, temperatures=torch.ones(1, 3, dtype=F64))
    pre_scaled, _ = policy_loss(logits / 2.0, mb_one, cfg, "rl", den)
    unscaled, _ = policy_loss(logits, mb_one, cfg, "rl", den)
    torch.testing.assert_close(at_two, pre_scaled)
    assert not torch.allclose(at_two, unscaled)
    mb_zero = replace(mb, temperatures=torch.zeros(1, 3, dtype=F64))
    torch.testing.assert_close(policy_loss(logits, mb_zero, cfg, "rl", den)[0], unscaled)


@pytest.mark.parametrize("normalize", ["tokens", "sequences"])
def test_sft_on_tool_outputs_gets_exact_ce_gradient_whatever_the_ratio(normalize: str) -> None:
    """Regression: tool-output ce tokens get (alpha/N_ce)(softmax - onehot), untouched by ratio/trust region/KL.

    Tool outputs (sft_mask = 1, mask = 0) are not sampled by the policy: their
    "inference logprob" is meaningless, so perturbing it wildly must change nothing for
    them, while the same perturbation masks the rl tokens by the trust region.
    """
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(2, 4, V, generator=g, dtype=F64)
    tool = torch.tensor([[False, True, True, False], [False, False, False, True]])
    actor = torch.tensor([[True, False, False, True], [True, True, False, False]])
    alpha = torch.tensor([[0.0, 0.25, 0.5, 0.0], [0.0, 0.0, 0.0, 0.1]], dtype=F64)
    temps = torch.full((2, 4), 0.6, dtype=F64)  # ce ignores the sampling temperature
    mb = make_batch(logits, seed=8, mask=actor, sft_mask=tool, ce_weights=alpha, temperatures=temps)
    cfg = LossConfig(kl_coef=1.0, normalize=normalize)
    grad = grad_of(logits, mb, cfg)

    # analytic: d(-alpha * log softmax(z)[y]) / dz = alpha * (softmax(z) - onehot(y))
    p = torch.softmax(logits, -1)
    onehot = torch.nn.functional.one_hot(mb.targets, V).double()
    if normalize == "tokens":
        scale = 1.0 / torch.full((2, 1), float(tool.sum()), dtype=F64)  # N_ce = 3
    else:  # each row's mean over its ce tokens, averaged over S_ce = 2 rows
        scale = 1.0 / (tool.sum(1, keepdim=True).double() * 2)
    expected = (alpha * scale).unsqueeze(-1) * (p - onehot)
    torch.testing.assert_close(grad[tool], expected[tool], rtol=1e-12, atol=1e-15)
    assert (grad[tool].abs().sum(-1) > 0).all()
    assert (grad[actor].abs().sum(-1) > 0).all()

    wild = mb.inference_logprobs + torch.tensor([[0.0, 60.0, -60.0, 0.0], [0.0, 0.0, 0.0, 1e4]])
    wild = wild + torch.where(actor, 50.0, 0.0)  # and every rl token far outside the region
    perturbed = grad_of(logits, replace(mb, inference_logprobs=wild), cfg)
    assert torch.equal(perturbed[tool], grad[tool])
    assert torch.equal(perturbed[actor], torch.zeros_like(perturbed[actor]))


def test_ce_wins_over_rl_on_a_token_marked_for_both() -> None:
    """A token with mask = sft_mask = 1 trains by ce only (no ratio, no advantage)."""
    g = torch.Generator().manual_seed(21)
    logits = torch.randn(1, 3, V, generator=g, dtype=F64)
    both = torch.tensor([[True, True, True]])
    mb = make_batch(logits, seed=22, mask=both, sft_mask=both, ce_weights=torch.ones(1, 3))
    mb.advantages = torch.full((1, 3), 100.0, dtype=F64)
    grad = grad_of(logits, mb, LossConfig(kl_coef=1.0))
    x = logits.detach().clone().requires_grad_(True)
    ce = -torch.log_softmax(x, -1).gather(-1, mb.targets.unsqueeze(-1)).mean()
    ce.backward()
    torch.testing.assert_close(grad, x.grad, rtol=1e-12, atol=1e-15)
    _, stats = policy_loss(logits, mb, LossConfig(), "rl", loss_denominators([mb], "rl", "tokens"))
    assert (stats.rl_tokens, stats.ce_tokens, stats.loss_tokens) == (0, 3, 3)


@pytest.mark.parametrize("normalize", ["tokens", "sequences"])
def test_channels_are_normalised_separately(normalize: str) -> None:
    """Adding tokens to one channel changes neither another channel's contribution nor its gradient."""
    g = torch.Generator().manual_seed(18)
    logits = torch.randn(3, 6, V, generator=g, dtype=F64)
    base = three_channel_batch(logits, seed=19)
    cfg = LossConfig(normalize=normalize, kl_coef=0.2)
    rows = torch.arange(6) >= 3

    def run(mb: LossBatch) -> tuple[dict[str, float], torch.Tensor]:
        den = loss_denominators([mb], "rl", normalize)
        return policy_loss(logits, mb, cfg, "rl", den)[1].finalize(), grad_of(logits, mb, cfg)

    m0, g0 = run(base)
    # More ce tokens: on positions no channel used, in a row with and without ce tokens.
    free = ~(base.mask | base.sft_mask | (base.ref_weights > 0))
    assert bool(free.any())
    more_ce = replace(base, sft_mask=base.sft_mask | free)
    m1, g1 = run(more_ce)
    assert m1["ce_tokens"] > m0["ce_tokens"] and m1["loss_ce"] != m0["loss_ce"]
    for name in ("loss_rl", "loss_ref"):
        assert m1[name] == pytest.approx(m0[name], rel=1e-12, abs=1e-15)
    rl_pos = positions(base, "rl")["rl"].positions
    torch.testing.assert_close(g1[rl_pos], g0[rl_pos], rtol=1e-12, atol=1e-15)
    # More ref tokens: ce and rl contributions unchanged.
    more_ref = replace(base, ref_weights=torch.where(rows, 0.3, base.ref_weights))
    m2, _ = run(more_ref)
    assert m2["ref_tokens"] > m0["ref_tokens"]
    for name in ("loss_rl", "loss_ce"):
        assert m2[name] == pytest.approx(m0[name], rel=1e-12, abs=1e-15)
    for m in (m0, m1, m2):
        assert m["loss"] == pytest.approx(m["loss_rl"] + m["loss_ce"] + m["loss_ref"], rel=1e-12)


@pytest.mark.parametrize("normalize", ["tokens", "sequences"])
def test_micro_batches_sum_to_the_loss_and_gradient_of_one_big_batch(normalize: str) -> None:
    """Per-channel whole-batch denominators make split micro-batches equal one big batch, every channel."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(6, 6, V, generator=g, dtype=F64)
    mb = three_channel_batch(logits, seed=12)
    mb.mask[3] = False  # a sequence with no rl token: not counted by "sequences" for rl
    mb.sft_mask[4] = False
    mb.ref_weights[5] = 0.0
    cfg = LossConfig(normalize=normalize, kl_coef=0.1, trust_region_high=0.6)
    big_grad = grad_of(logits, mb, cfg)
    big_den = loss_denominators([mb], "rl", normalize)
    big_loss, big_stats = policy_loss(logits, mb, cfg, "rl", big_den)

    parts = [slice(0, 2), slice(2, 3), slice(3, 6)]
    mbs = [LossBatch(**{k: v[s] for k, v in mb.__dict__.items()}) for s in parts]
    den = loss_denominators(mbs, "rl", normalize)
    assert den == big_den
    pos = positions(mb, "rl")
    for name in CHANNELS:
        per_row = pos[name].positions.sum(1)
        assert den[name] == (
            int(per_row.sum()) if normalize == "tokens" else int((per_row > 0).sum())
        )
    x = logits.detach().clone().requires_grad_(True)
    total, stats = torch.zeros((), dtype=F64), LossStats()
    for s, part in zip(parts, mbs, strict=True):
        loss, st = policy_loss(x[s], part, cfg, "rl", den)
        loss.backward()
        total, stats = total + loss.detach(), stats + st
    torch.testing.assert_close(total, big_loss.detach(), rtol=1e-12, atol=1e-15)
    assert x.grad is not None
    torch.testing.assert_close(x.grad, big_grad, rtol=1e-12, atol=1e-15)
    split, big = stats.finalize(), big_stats.finalize()
    assert split.keys() == big.keys() >= {
        "ce_nll", "ce_nll_max", "ref_kl", "loss_rl", "loss_ce", "loss_ref",
    }  # fmt: skip
    for key, value in big.items():
        assert split[key] == pytest.approx(value, rel=1e-12, abs=1e-15), key
    assert all(big[f"loss_{c}"] != 0 for c in CHANNELS)


def old_sft_loss(logits: torch.Tensor, mb: LossBatch, normalize: str) -> torch.Tensor:
    """The pre-channel phase-"sft" loss, verbatim: the one recorded runs were trained with."""
    sft = mb.mask | mb.sft_mask
    lp, _ = token_logprobs(logits, mb.targets, torch.ones_like(mb.temperatures))
    per_token = torch.zeros_like(lp) + torch.where(sft, -torch.ones_like(lp) * lp, 0.0)
    per_row = sft.sum(dim=1)
    den = int(per_row.sum()) if normalize == "tokens" else int((per_row > 0).sum())
    if normalize == "tokens":
        weights = torch.full_like(lp, 1.0 / max(den, 1))
    else:
        rows = sft.sum(dim=1, keepdim=True).clamp(min=1).to(lp.dtype)
        weights = (1.0 / (rows * max(den, 1))).expand_as(lp)
    return torch.where(sft, per_token * weights, torch.zeros_like(lp)).sum()


@pytest.mark.parametrize("normalize", ["tokens", "sequences"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sft_phase_is_unchanged_plain_cross_entropy(normalize: str, dtype: torch.dtype) -> None:
    """Phase "sft" (mask = sft_mask): the pre-channel CE bit for bit; ref/advantages/ce_weights ignored."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 5, V, generator=g).to(dtype)
    mask = torch.rand(3, 5, generator=g) < 0.6
    mb = make_batch(
        logits, seed=10, mask=mask, sft_mask=mask.clone(), temperatures=torch.full((3, 5), 0.3),
        ce_weights=torch.full((3, 5), 7.0), ref_weights=torch.full((3, 5), 2.0, dtype=F64),
    )  # fmt: skip
    mb.inference_logprobs = mb.inference_logprobs + 30.0
    cfg = LossConfig(normalize=normalize, kl_coef=0.5)
    den = loss_denominators([mb], "sft", normalize)
    assert den["rl"] == den["ref"] == 0
    x = logits.detach().clone().requires_grad_(True)
    loss, stats = policy_loss(x, mb, cfg, "sft", den)
    loss.backward()
    y = logits.detach().clone().requires_grad_(True)
    old = old_sft_loss(y, mb, normalize)
    old.backward()
    assert torch.equal(loss.detach(), old.detach())
    assert x.grad is not None and y.grad is not None and torch.equal(x.grad, y.grad)
    if normalize == "tokens" and dtype == torch.float32:
        expected = torch.nn.functional.cross_entropy(logits[mask], mb.targets[mask])
        torch.testing.assert_close(loss.detach(), expected)
    m = stats.finalize()
    assert stats.rl_tokens == stats.ref_tokens == 0
    assert m["ce_tokens"] == m["loss_tokens"] == int(mask.sum())
    assert "ref_kl" not in m and m["loss_ce"] == m["loss"]


def test_metrics_per_channel() -> None:
    """Per-channel metrics: loss_ce/ce_nll at temperature 1 (even on sampled tokens), ref_kl k3; absent when empty."""
    g = torch.Generator().manual_seed(23)
    logits = torch.randn(2, 4, V, generator=g, dtype=F64)
    sft = torch.tensor([[False, True, True, False], [False, False, False, True]])
    mask = torch.tensor([[True, True, False, True], [True, True, True, True]])  # 2 ce sampled
    temps = torch.full((2, 4), 0.5, dtype=F64)
    ce_w = torch.tensor([[0.0, 0.1, 0.2, 0.0], [0.0, 0.0, 0.0, 0.3]], dtype=F64)
    mb = make_batch(logits, seed=24, mask=mask, sft_mask=sft, temperatures=temps, ce_weights=ce_w)
    den = loss_denominators([mb], "rl", "tokens")
    m = policy_loss(logits, mb, LossConfig(), "rl", den)[1].finalize()
    lp1 = token_logprobs(logits, mb.targets, torch.ones(2, 4, dtype=F64))[0]
    assert m["ce_nll"] == pytest.approx(float(-lp1[sft].mean()), rel=1e-12)
    assert m["ce_nll_max"] == float((-lp1[sft]).max()) > m["ce_nll"]
    assert m["loss_ce"] == pytest.approx(float(-(ce_w * lp1)[sft].sum() / 3), rel=1e-12)
    assert (m["ce_tokens"], m["rl_tokens"], m["ref_tokens"], m["loss_tokens"]) == (3, 5, 0, 8)
    assert "ref_kl" not in m and m["loss_ref"] == 0.0
    assert set(LossStats().finalize()) == {
        "loss", "loss_rl", "loss_ce", "loss_ref", "entropy", "mismatch_kl", "ratio_mean",
        "masked_fraction", "loss_tokens", "rl_tokens", "ce_tokens", "ref_tokens",
    }  # fmt: skip

    # The sampled ce tokens also in the ref channel: they are sampled at T = 0.5 (so
    # the ref ratio needs lpT there), yet ce and ref_kl still use temperature 1.
    ref_w = torch.where(sft & mask, 0.5, 0.0).double()
    mb_ref = replace(mb, ref_weights=ref_w)
    m2 = policy_loss(
        logits, mb_ref, LossConfig(), "rl", loss_denominators([mb_ref], "rl", "tokens")
    )
    m2 = m2[1].finalize()
    assert m2["loss_ce"] == pytest.approx(m["loss_ce"], rel=1e-12)
    assert m2["ce_nll"] == pytest.approx(m["ce_nll"], rel=1e-12)
    d = (mb.ref_logprobs - lp1)[ref_w > 0]
    assert m2["ref_tokens"] == 2 and m2["loss_tokens"] == 8
    assert m2["ref_kl"] == pytest.approx(float((torch.exp(d) - 1 - d).mean()), rel=1e-12)


def test_empty_micro_batch_backpropagates_zeros() -> None:
    """A micro-batch with no loss position returns a zero loss whose gradient is all zeros."""
    logits = torch.randn(1, 3, V, dtype=F64)
    nowhere = torch.zeros(1, 3, dtype=torch.bool)
    mb = make_batch(logits, mask=nowhere)
    grad = grad_of(logits, mb, LossConfig())
    assert torch.equal(grad, torch.zeros_like(grad))


def test_unknown_phase_or_normalize_is_an_error() -> None:
    """A typo'd phase or normalize mode raises instead of silently training nothing."""
    logits = torch.randn(1, 2, V, dtype=F64)
    mb = make_batch(logits)
    with pytest.raises(ValueError, match="phase"):
        positions(mb, "warmup")
    with pytest.raises(ValueError, match="normalize"):
        loss_denominators([mb], "rl", "token")
