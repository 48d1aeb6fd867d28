"""The ref_kl channel: its gradient by hand, in expectation, and in a gradient step."""

from __future__ import annotations

import math

import pytest
import torch

from configs import LossConfig
from roles.trainer.loss import (
    LossBatch,
    loss_denominators,
    policy_loss,
    token_logprobs,
)
from tests.unit.loss_batches import (
    F64,
    V,
    grad_of,
    make_batch,
)


def test_ref_gradient_matches_hand_derived_formula_with_importance_ratio() -> None:
    """ref token: dL/dz = beta * rho * (lp1 - ref) * (onehot - softmax(z)) / N_ref, rho capped at 1 + high."""
    z = torch.tensor([[[0.5, -0.2, 0.1], [0.3, 0.0, -1.0], [-0.4, 0.9, 0.2]]], dtype=F64)
    k = torch.tensor([[2, 0, 1]])
    temps = torch.tensor([[0.5, 1.0, 1.0]], dtype=F64)
    lp_t = token_logprobs(z, k, temps)[0]
    lp1 = token_logprobs(z, k, torch.ones(1, 3, dtype=F64))[0]
    beta = torch.tensor([[0.3, 0.7, 2.0]], dtype=F64)
    ref = torch.tensor([[-2.0, -0.1, -1.0]], dtype=F64)
    high = 0.28
    mb = LossBatch(
        targets=k,
        mask=torch.tensor([[True, True, False]]),  # token 2 was not sampled: rho = 1
        sft_mask=torch.zeros(1, 3, dtype=torch.bool),
        # token 0: sampled at T = 0.5, ratio e^0.1; token 1: stale, ratio e^5 -> capped
        inference_logprobs=lp_t - torch.tensor([[0.1, 5.0, 0.0]], dtype=F64),
        temperatures=temps,
        advantages=torch.zeros(1, 3, dtype=F64),
        ce_weights=torch.zeros(1, 3, dtype=F64),
        ref_logprobs=ref,
        ref_weights=beta,
    )
    rho = torch.tensor([[math.exp(0.1), 1.0 + high, 1.0]], dtype=F64)
    # Tokens 0 and 1 are also rl tokens, but with A = 0 and no KL their rl gradient is 0.
    grad = grad_of(z, mb, LossConfig(trust_region_high=high))
    p = torch.softmax(z[0], -1)
    onehot = torch.nn.functional.one_hot(k[0], 3).double()
    coef = (beta * rho * (lp1 - ref))[0] / 3
    expected = coef.unsqueeze(-1) * (onehot - p)
    torch.testing.assert_close(grad[0], expected, rtol=1e-10, atol=1e-12)


def test_ref_gradient_is_the_reverse_kl_gradient_in_expectation() -> None:
    """Summed over every target weighted by pi (beta = pi, rho = 1), the ref gradient is grad KL(pi || pi_ref)."""
    g = torch.Generator().manual_seed(15)
    z = torch.randn(V, generator=g, dtype=F64)
    z_ref = torch.randn(V, generator=g, dtype=F64)
    logits = z.expand(1, V, V).clone()  # one position per possible target, same logits
    with torch.no_grad():
        pi = torch.softmax(z, -1)
    mb = LossBatch(
        targets=torch.arange(V).unsqueeze(0),
        mask=torch.zeros(1, V, dtype=torch.bool),  # not sampled: rho = 1
        sft_mask=torch.zeros(1, V, dtype=torch.bool),
        inference_logprobs=torch.zeros(1, V, dtype=F64),
        temperatures=torch.ones(1, V, dtype=F64),
        advantages=torch.zeros(1, V, dtype=F64),
        ce_weights=torch.zeros(1, V, dtype=F64),
        ref_logprobs=torch.log_softmax(z_ref, -1).unsqueeze(0),
        ref_weights=pi.unsqueeze(0),  # the expectation over y ~ pi, written as weights
    )
    grad = grad_of(logits, mb, LossConfig()).sum(dim=(0, 1)) * V  # N_ref = V

    x = z.clone().requires_grad_(True)
    logp = torch.log_softmax(x, -1)
    kl = (logp.exp() * (logp - torch.log_softmax(z_ref, -1))).sum()
    kl.backward()
    assert x.grad is not None and x.grad.abs().max() > 1e-3
    torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("above", [True, False])
def test_ref_kl_gradient_step_moves_toward_the_reference(above: bool) -> None:
    """A gradient-descent step on the ref loss lowers the ref_kl metric (lp1 above or below ref)."""
    g = torch.Generator().manual_seed(16)
    logits = torch.randn(2, 3, V, generator=g, dtype=F64)
    nowhere = torch.zeros(2, 3, dtype=torch.bool)
    mb = make_batch(logits, seed=17, mask=nowhere, ref_weights=torch.full((2, 3), 0.5, dtype=F64))
    lp1 = token_logprobs(logits, mb.targets, torch.ones(2, 3, dtype=F64))[0]
    mb.ref_logprobs = lp1 + (-0.7 if above else 0.7)  # policy above / below the reference
    cfg = LossConfig()
    den = loss_denominators([mb], "rl", "tokens")

    def ref_kl(x: torch.Tensor) -> float:
        return policy_loss(x, mb, cfg, "rl", den)[1].finalize()["ref_kl"]

    grad = grad_of(logits, mb, cfg)
    before = ref_kl(logits)
    after = ref_kl(logits - 0.1 * grad)
    assert before > 0 and after < before
    # and the k3 metric is the mean of exp(d) - 1 - d, d = ref - lp1
    d = torch.full((), -0.7 if above else 0.7, dtype=F64)
    assert before == pytest.approx(float(torch.exp(d) - 1 - d), rel=1e-9)
