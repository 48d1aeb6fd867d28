"""Hand-made loss batches and gradient helpers shared by the loss tests."""

from __future__ import annotations

import torch

from configs import LossConfig
from roles.trainer.loss import LossBatch, loss_denominators, policy_loss, positions, token_logprobs

V = 7
F64 = torch.float64


def make_batch(
    logits: torch.Tensor,
    *,
    seed: int = 0,
    ratio_noise: float = 0.05,
    mask: torch.Tensor | None = None,
    sft_mask: torch.Tensor | None = None,
    temperatures: torch.Tensor | None = None,
    ce_weights: torch.Tensor | None = None,
    ref_weights: torch.Tensor | None = None,
) -> LossBatch:
    """A batch whose inference logprobs sit close to the model's (ratios near 1).

    The reference logprobs are the model's at temperature 1 plus noise of +-1 (so the
    ref channel has something to pull toward); channels default to rl only.
    """
    g = torch.Generator().manual_seed(seed)
    b, t, _ = logits.shape
    targets = torch.randint(0, V, (b, t), generator=g)
    temps = temperatures if temperatures is not None else torch.full((b, t), 1.0)
    with torch.no_grad():
        lp, _ = token_logprobs(logits, targets, temps.to(logits.dtype))
        lp1, _ = token_logprobs(logits, targets, torch.ones(b, t, dtype=logits.dtype))
    noise = (torch.rand(b, t, generator=g, dtype=F64) * 2 - 1) * ratio_noise
    ref_noise = torch.rand(b, t, generator=g, dtype=F64) * 2 - 1
    mask = mask if mask is not None else torch.rand(b, t, generator=g) < 0.7
    return LossBatch(
        targets=targets,
        mask=mask,
        sft_mask=sft_mask if sft_mask is not None else torch.zeros(b, t, dtype=torch.bool),
        # as recorded: inference logprobs on sampled tokens, exactly 0 elsewhere
        inference_logprobs=torch.where(mask, lp.double() + noise, 0.0).to(logits.dtype),
        temperatures=temps,
        advantages=torch.randn(b, t, generator=g, dtype=F64).to(logits.dtype),
        ce_weights=ce_weights if ce_weights is not None else torch.ones(b, t, dtype=logits.dtype),
        ref_logprobs=(lp1.double() + ref_noise).to(logits.dtype),
        ref_weights=ref_weights if ref_weights is not None else torch.zeros(b, t, dtype=F64),
    )


def replace(mb: LossBatch, **changes: torch.Tensor) -> LossBatch:
    return LossBatch(**{**mb.__dict__, **changes})


def grad_of(
    logits: torch.Tensor, mb: LossBatch, cfg: LossConfig, phase: str = "rl"
) -> torch.Tensor:
    x = logits.detach().clone().requires_grad_(True)
    loss, _ = policy_loss(x, mb, cfg, phase, loss_denominators([mb], phase, cfg.normalize))
    loss.backward()
    assert x.grad is not None
    return x.grad


def three_channel_batch(logits: torch.Tensor, seed: int) -> LossBatch:
    """rl, ce (weighted, some also sampled: ce wins) and ref (sampled and not) positions."""
    b, t, _ = logits.shape
    g = torch.Generator().manual_seed(seed)
    temps = torch.tensor([0.0, 0.7, 1.0, 1.3, 2.0], dtype=F64)[
        torch.randint(0, 5, (b, t), generator=g)
    ]
    mask = torch.rand(b, t, generator=g) < 0.6
    sft = torch.rand(b, t, generator=g) < 0.3
    ce_w = torch.rand(b, t, generator=g, dtype=F64) * 2
    ref_w = torch.where(
        torch.rand(b, t, generator=g) < 0.5, torch.rand(b, t, generator=g, dtype=F64), 0.0
    )
    return make_batch(
        logits, seed=seed + 1, mask=mask, sft_mask=sft, temperatures=temps,
        ce_weights=ce_w, ref_weights=ref_w,
    )  # fmt: skip


def finite_difference(f, logits: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:  # type: ignore[no-untyped-def]
    numeric = torch.zeros_like(logits)
    flat, out = logits.reshape(-1), numeric.view(-1)
    for i in range(flat.numel()):
        plus, minus = flat.clone(), flat.clone()
        plus[i] += eps
        minus[i] -= eps
        out[i] = (f(plus.view_as(logits)) - f(minus.view_as(logits))) / (2 * eps)
    return numeric


def fd_objective(logits: torch.Tensor, mb: LossBatch, cfg: LossConfig):  # type: ignore[no-untyped-def]
    """The function whose finite differences the autograd gradient must match.

    rl and ce are plain differentiable losses. ref_kl is a surrogate with stopped
    gradients (``rho`` and ``lp1 - ref``), so its value's derivative is not its gradient:
    for it, the reported ``loss_ref`` is swapped for ``sum_t c_t * lp1_t(x)`` with the
    stopped factors ``c_t = w_t * beta_t * rho_t * (lp1_t - ref_t)`` frozen at ``logits``
    (``w_t`` the normalisation weight), written out here from the definition.
    """
    den = loss_denominators([mb], "rl", cfg.normalize)
    ref = positions(mb, "rl")["ref"].positions
    ones = torch.ones_like(mb.temperatures)
    with torch.no_grad():
        lp_t, _ = token_logprobs(logits, mb.targets, torch.where(mb.mask, mb.temperatures, ones))
        lp1, _ = token_logprobs(logits, mb.targets, ones)
        rho = torch.exp(lp_t - mb.inference_logprobs).clamp(max=1 + cfg.trust_region_high)
        rho = torch.where(mb.mask | (mb.inference_logprobs != 0), rho, 1.0)
        if cfg.normalize == "tokens":
            w = torch.full_like(lp1, 1.0 / max(den["ref"], 1))
        else:
            rows = ref.sum(1, keepdim=True).clamp(min=1)
            w = (1.0 / (rows * max(den["ref"], 1))).expand_as(lp1)
        coef = torch.where(ref, w * mb.ref_weights * rho * (lp1 - mb.ref_logprobs), 0.0)

    def f(x: torch.Tensor) -> float:
        loss, stats = policy_loss(x, mb, cfg, "rl", den)
        surrogate = (coef * token_logprobs(x, mb.targets, ones)[0]).sum()
        return float(loss) - stats.loss_ref + float(surrogate)

    return f
