"""The trainer's loss: importance-weighted policy gradient with a trust-region mask, plus SFT.

Pure torch functions over one micro-batch, unit-tested against finite differences
(``tests/unit/test_loss.py``). Tensors are ``[B, T]`` and already *aligned*: position
``t`` holds the target token and the logits that predict it (the caller drops the
first token of each sample and the last logit row, ``core.TrainerCore`` does).

Which positions train, and how (``phase`` is the batch's phase):

- **RL positions** (phase ``"rl"``, ``mask`` = 1 and ``sft_mask`` = 0). With
  ``lp = log softmax(logits / T)[target]`` (T = the token's sampling temperature; 0,
  greedy, counts as 1) and ``r = exp(lp - lp_inf)`` (``lp_inf`` = the inference
  policy's logprob), a token is *kept* when ``1 - trust_region_low <= r <= 1 +
  trust_region_high`` (r measured without gradient) and contributes

      loss_t = -(r * A_t) + kl_coef * (r - 1 - log r)

  (d/dθ of ``r * A`` is ``r * A * ∇lp``: the importance-weighted policy gradient; the
  second term is the k3 estimator of KL(π_inf ‖ π_θ)). Masked tokens contribute 0 and
  get exactly zero gradient, but stay in the normaliser.
- **SFT positions** (phase ``"sft"``: every ``mask`` or ``sft_mask`` token; any phase:
  ``sft_mask`` tokens). ``loss_t = -w_t * lp`` at temperature 1 (plain likelihood of
  the data, whatever it was sampled at), with ``w_t = 1`` in phase ``"sft"`` and
  ``w_t = A_t`` in phase ``"rl"`` (the algorithm puts its SFT weight alpha in the
  advantage). No ratio, no trust region, no KL.

The per-token losses are summed with weights ``1 / N`` (``normalize = "tokens"``: N =
loss positions in the WHOLE batch) or ``1 / (n_seq * S)`` (``"sequences"``: each
sequence's mean, averaged over the S sequences with a loss position in the whole
batch), so summing the micro-batch losses gives exactly the loss of one big batch.
``loss_denominator`` computes N or S over every micro-batch before the first backward.

Metrics (``LossStats``, summed over micro-batches then ``finalize``d): ``entropy`` =
mean full-vocab entropy at the training temperature over loss positions;
``mismatch_kl`` = mean k3 between inference and trainer logprobs and ``ratio_mean`` =
mean r, both over RL positions (SFT tokens have no inference-policy logprob to compare:
a teacher's or a tool's); ``masked_fraction`` = trust-region-masked / RL positions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch

from configs import LossConfig

Phase = Literal["rl", "sft"]
PHASES = ("rl", "sft")
# Metrics clamp the log-ratio so one wild token cannot turn a mean into inf.
_METRIC_LOG_RATIO_CLAMP = 20.0


@dataclass
class LossBatch:
    """One micro-batch's per-position tensors, all ``[B, T]`` and aligned with the logits."""

    targets: torch.Tensor  # int64: the token each position predicts
    mask: torch.Tensor  # bool: sampled tokens to train on
    sft_mask: torch.Tensor  # bool: tokens trained by (weighted) cross-entropy
    inference_logprobs: torch.Tensor  # float32
    temperatures: torch.Tensor  # float32; 0 (greedy) is treated as 1
    advantages: torch.Tensor  # float32

    def to(self, device: str | torch.device) -> LossBatch:
        return LossBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def positions(mb: LossBatch, phase: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rl positions, sft positions, sft weights) of a micro-batch in ``phase``."""
    if phase == "sft":
        sft = mb.mask | mb.sft_mask
        return torch.zeros_like(sft), sft, torch.ones_like(mb.advantages)
    if phase == "rl":
        return mb.mask & ~mb.sft_mask, mb.sft_mask, mb.advantages
    raise ValueError(f"unknown batch phase {phase!r}; expected one of {PHASES}")


def loss_denominator(mbs: list[LossBatch], phase: str, normalize: str) -> int:
    """N (loss positions) or S (sequences with a loss position) over the whole batch."""
    total = 0
    for mb in mbs:
        rl, sft, _ = positions(mb, phase)
        per_row = (rl | sft).sum(dim=1)
        total += int(per_row.sum()) if normalize == "tokens" else int((per_row > 0).sum())
    return total


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each target at its temperature, full-vocab entropy there, no grad)."""
    # At least float32 (bf16 logits lose too much in log_softmax); float64 stays float64.
    dtype = torch.promote_types(logits.dtype, torch.float32)
    temps = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    logp = torch.log_softmax(logits.to(dtype) / temps.unsqueeze(-1).to(dtype), dim=-1)
    lp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy


@dataclass
class LossStats:
    """Sums over loss positions; add micro-batches with ``+``, then ``finalize``."""

    loss: float = 0.0
    loss_tokens: int = 0
    rl_tokens: int = 0
    sft_tokens: int = 0
    masked: int = 0
    entropy_sum: float = 0.0
    mismatch_kl_sum: float = 0.0
    ratio_sum: float = 0.0

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )

    def finalize(self) -> dict[str, float]:
        n, rl = max(self.loss_tokens, 1), max(self.rl_tokens, 1)
        return {
            "loss": self.loss,
            "entropy": self.entropy_sum / n,
            "mismatch_kl": self.mismatch_kl_sum / rl,
            "ratio_mean": self.ratio_sum / rl if self.rl_tokens else 1.0,
            "masked_fraction": self.masked / rl,
            "loss_tokens": float(self.loss_tokens),
            "rl_tokens": float(self.rl_tokens),
            "sft_tokens": float(self.sft_tokens),
        }


def policy_loss(
    logits: torch.Tensor, mb: LossBatch, cfg: LossConfig, phase: str, denominator: int
) -> tuple[torch.Tensor, LossStats]:
    """This micro-batch's share of the batch loss (see the module docstring) and its stats.

    ``logits`` is ``[B, T, V]`` aligned with ``mb``; ``denominator`` is
    ``loss_denominator`` over the whole batch.
    """
    rl, sft, sft_weight = positions(mb, phase)
    # SFT positions train at temperature 1: the data's likelihood under the model itself.
    temps = torch.where(rl, mb.temperatures, torch.ones_like(mb.temperatures))
    lp, entropy = token_logprobs(logits, mb.targets, temps)
    loss_pos = rl | sft

    log_ratio = lp - mb.inference_logprobs.to(lp.dtype)
    with torch.no_grad():
        ratio_seen = torch.exp(log_ratio)
        kept = (
            rl
            & (ratio_seen >= 1.0 - cfg.trust_region_low)
            & (ratio_seen <= 1.0 + cfg.trust_region_high)
        )
    # exp only where kept: a masked token's huge ratio must not turn into inf * 0 = nan
    # in the backward pass (torch.where's backward selects, it never multiplies).
    safe_log_ratio = torch.where(kept, log_ratio, torch.zeros_like(log_ratio))
    ratio = torch.exp(safe_log_ratio)
    rl_term = -(ratio * mb.advantages.to(lp.dtype))
    if cfg.kl_coef > 0:
        rl_term = rl_term + cfg.kl_coef * (ratio - 1.0 - safe_log_ratio)
    per_token = torch.where(kept, rl_term, torch.zeros_like(rl_term))
    per_token = per_token + torch.where(sft, -sft_weight.to(lp.dtype) * lp, torch.zeros_like(lp))

    if cfg.normalize == "tokens":
        weights = torch.full_like(lp, 1.0 / max(denominator, 1))
    else:
        per_row = loss_pos.sum(dim=1, keepdim=True).clamp(min=1).to(lp.dtype)
        weights = (1.0 / (per_row * max(denominator, 1))).expand_as(lp)
    loss = torch.where(loss_pos, per_token * weights, torch.zeros_like(lp)).sum()

    with torch.no_grad():
        clamped = log_ratio.detach().clamp(-_METRIC_LOG_RATIO_CLAMP, _METRIC_LOG_RATIO_CLAMP)
        k3 = torch.exp(clamped) - 1.0 - clamped
        stats = LossStats(
            loss=float(loss.detach()),
            loss_tokens=int(loss_pos.sum()),
            rl_tokens=int(rl.sum()),
            sft_tokens=int(sft.sum()),
            masked=int((rl & ~kept).sum()),
            entropy_sum=float(entropy[loss_pos].double().sum()),
            mismatch_kl_sum=float(k3[rl].double().sum()),
            ratio_sum=float(torch.exp(clamped)[rl].double().sum()),
        )
    return loss, stats
