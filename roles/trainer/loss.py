"""The trainer's loss: a sum of three loss channels, each normalised by its own count.

Pure torch functions over one micro-batch, unit-tested against finite differences
(``tests/unit/test_loss.py``). Tensors are ``[B, T]`` and already *aligned*: position
``t`` holds the target token and the logits that predict it (the caller drops the
first token of each sample and the last logit row, ``core.TrainerCore`` does).

Channels and their positions (``positions(mb, phase)``; ``phase`` is the batch's):

- phase ``"sft"`` (warm-start batches): only **ce**, on ``mask | sft_mask``, weight 1.
  No rl, no ref_kl. (Exactly the pre-channel behaviour: recorded runs replay bit for bit.)
- phase ``"rl"``:

  - **rl** on ``mask & ~sft_mask``, weighted by the advantage ``A_t``. A token marked
    for cross-entropy is never also policy-gradient-trained ("ce wins").
  - **ce** on ``sft_mask``, weighted by ``ce_weights`` (1 where the sample has none).
  - **ref** (ref_kl) on ``ref_weights > 0``, with coefficient ``beta_t = ref_weights``.

A position may sit in ce and ref, or in rl and ref, at once; each channel's term counts.

Per-token losses. ``lp1`` = log softmax(logits)[target] (temperature 1), ``lpT`` = the
same at the token's sampling temperature T (0, greedy, counts as 1), ``lp_inf`` = the
inference policy's logprob of the token:

- **rl**: with ``r = exp(lpT - lp_inf)``, a token is *kept* when ``1 - trust_region_low
  <= r <= 1 + trust_region_high`` (r measured without gradient) and contributes

      loss_t = -(r * A_t) + kl_coef * (r - 1 - log r)

  (d/dθ of ``r * A`` is ``r * A * ∇lpT``: the importance-weighted policy gradient; the
  second term is the k3 estimator of KL(π_inf ‖ π_θ)). Masked tokens contribute 0 and
  get exactly zero gradient, but stay in the channel's normaliser.
- **ce**: ``loss_t = -w_t * lp1`` (plain likelihood of the data, whatever it was sampled
  at: a teacher's or a tool's tokens). No ratio, no trust region, no KL.
- **ref** (ref_kl): with ``ref_t`` the reference model's logprob of the token (scored at
  temperature 1),

      loss_t = beta_t * rho_t * sg(lp1 - ref_t) * lp1

  where ``sg`` stops the gradient and ``rho_t = sg(min(exp(lpT - lp_inf), 1 +
  trust_region_high))`` on sampled tokens (``mask`` = 1, or a non-zero inference
  logprob: unsampled tokens record exactly 0), 1 elsewhere. Its gradient
  ``beta * rho * (lp1 - ref) * ∇lp1`` is the per-token, importance-weighted
  score-function gradient of the reverse KL(π ‖ π_ref) = E_π[log π - log π_ref] (the
  ``E_π[∇ log π]`` term vanishes): descending it pulls the policy toward the reference
  (a token the policy likes more than the reference, ``lp1 > ref``, loses probability).
  ``rho`` corrects for the tokens having been sampled by the (possibly stale) inference
  policy; the clamp keeps one stale sample from blowing up. On tokens that were not
  sampled (tool outputs, teacher tokens) there is no sampling policy to correct for.

Normalisation (``cfg.loss.normalize``), per channel c with positions P_c:

- ``"tokens"``: ``L = sum_c (1 / N_c) * sum_{t in P_c} loss_c(t)``, N_c = |P_c| over the
  WHOLE batch (every micro-batch);
- ``"sequences"``: per channel, each sequence's mean over its P_c positions, averaged over
  the S_c sequences of the whole batch that have a P_c position.

So adding tokens to one channel never changes another channel's contribution, and
summing the micro-batch losses gives exactly the loss of one big batch.
``loss_denominators`` computes every N_c (or S_c) over all micro-batches before the
first backward.

Metrics (``LossStats``, summed over micro-batches then ``finalize``d):

- ``loss`` and its per-channel parts ``loss_rl``, ``loss_ce``, ``loss_ref`` (each
  channel's normalised contribution; 0.0 for an empty channel). ``loss_ref`` is a
  surrogate: its gradient is the point, its value (``sum beta*rho*(lp1-ref)*lp1``) has
  no meaning of its own; ``ref_kl`` is the number to watch;
- ``entropy``: mean full-vocab entropy over all loss positions, at the temperature ``lpT``
  uses there (the sampling temperature on rl and sampled ref positions, 1 elsewhere);
- over rl positions: ``mismatch_kl`` (mean k3 between inference and trainer logprobs),
  ``ratio_mean`` (mean r) and ``masked_fraction`` (trust-region-masked / rl positions);
  ce and ref tokens have no ratio of interest (a teacher's or a tool's tokens);
- ``loss_tokens`` (positions in any channel), ``rl_tokens``, ``ce_tokens``, ``ref_tokens``;
- ``ce_nll``: mean ``-lp1`` over ce positions, unweighted (the NLL of the tool-output /
  SFT tokens), and ``ce_nll_max``, the largest (prime-rl's ``sft_nll_max``: the one
  token the model fits worst, which a mean hides);
- ``ref_kl``: mean over ref positions of the k3 estimator ``exp(ref - lp1) - 1 - (ref -
  lp1)`` (>= 0), an estimate of KL(π ‖ π_ref).

``ce_nll``, ``ce_nll_max`` and ``ref_kl`` are emitted only when their channel has tokens in the batch: a
0.0 would read as a perfect fit, a missing value is a gap in the curve.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal, NamedTuple

import torch

from configs import LossConfig

Phase = Literal["rl", "sft"]
PHASES = ("rl", "sft")
CHANNELS = ("rl", "ce", "ref")
NORMALIZE = ("tokens", "sequences")
# Metrics clamp the log-ratio so one wild token cannot turn a mean into inf.
_METRIC_LOG_RATIO_CLAMP = 20.0


@dataclass
class LossBatch:
    """One micro-batch's per-position tensors, all ``[B, T]`` and aligned with the logits."""

    targets: torch.Tensor  # int64: the token each position predicts
    mask: torch.Tensor  # bool: sampled tokens to train on
    sft_mask: torch.Tensor  # bool: the ce channel's positions
    inference_logprobs: torch.Tensor  # float32
    temperatures: torch.Tensor  # float32; 0 (greedy) is treated as 1
    advantages: torch.Tensor  # float32
    ce_weights: torch.Tensor  # float32: ce weight of each position (phase "rl")
    ref_logprobs: torch.Tensor  # float32: the reference model's logprob of each target
    ref_weights: torch.Tensor  # float32: ref_kl coefficient beta; > 0 = in the ref channel

    def to(self, device: str | torch.device) -> LossBatch:
        return LossBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


class Channel(NamedTuple):
    """One loss channel of a micro-batch: where it trains, and its per-token weight."""

    positions: torch.Tensor  # bool [B, T]
    weights: torch.Tensor  # float [B, T]: A_t (rl), w_t (ce), beta_t (ref)


def positions(mb: LossBatch, phase: str) -> dict[str, Channel]:
    """Each channel's positions and weights in ``phase``, keyed by ``CHANNELS`` in order."""
    if phase == "sft":
        ce = mb.mask | mb.sft_mask
        nowhere, zeros = torch.zeros_like(ce), torch.zeros_like(mb.advantages)
        return {
            "rl": Channel(nowhere, zeros),
            "ce": Channel(ce, torch.ones_like(mb.advantages)),
            "ref": Channel(nowhere, zeros),
        }
    if phase == "rl":
        return {
            "rl": Channel(mb.mask & ~mb.sft_mask, mb.advantages),
            "ce": Channel(mb.sft_mask, mb.ce_weights),
            "ref": Channel(mb.ref_weights > 0, mb.ref_weights),
        }
    raise ValueError(f"unknown batch phase {phase!r}; expected one of {PHASES}")


def _check_normalize(normalize: str) -> None:
    if normalize not in NORMALIZE:
        raise ValueError(f"unknown loss normalize {normalize!r}; expected one of {NORMALIZE}")


def loss_denominators(mbs: list[LossBatch], phase: str, normalize: str) -> dict[str, int]:
    """Per channel: N_c (its positions) or S_c (sequences with one) over the whole batch."""
    _check_normalize(normalize)
    totals = dict.fromkeys(CHANNELS, 0)
    for mb in mbs:
        for name, channel in positions(mb, phase).items():
            per_row = channel.positions.sum(dim=1)
            totals[name] += (
                int(per_row.sum()) if normalize == "tokens" else int((per_row > 0).sum())
            )
    return totals


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


# A float stat: a Python float, or a 0-dim float64 tensor still on the device.
Stat = float | torch.Tensor


@dataclass
class LossStats:
    """Sums over loss positions (the ``MAXED`` fields: maxima); add micro-batches with
    ``+``, then ``finalize``.

    ``policy_loss`` leaves the float fields and ``masked`` as 0-dim float64 tensors on
    the logits' device, so a step's micro-batches add up there without a host sync;
    ``on_host`` brings them all over in one copy (``finalize`` needs it done)."""

    loss: Stat = 0.0
    loss_rl: Stat = 0.0
    loss_ce: Stat = 0.0
    loss_ref: Stat = 0.0
    loss_tokens: int = 0
    rl_tokens: int = 0
    ce_tokens: int = 0
    ref_tokens: int = 0
    masked: int | torch.Tensor = 0
    entropy_sum: Stat = 0.0
    mismatch_kl_sum: Stat = 0.0
    ratio_sum: Stat = 0.0
    ce_nll_sum: Stat = 0.0
    ce_nll_max: Stat = 0.0  # the worst-fit ce token (NLLs are >= 0, so 0 is "none")
    ref_kl_sum: Stat = 0.0

    MAXED = frozenset({"ce_nll_max"})  # combined by max, not summed (micro-batches, ranks)

    def __add__(self, other: LossStats) -> LossStats:
        def both(name: str) -> Any:  # an int, a float or a 0-dim tensor, as the field is
            a, b = getattr(self, name), getattr(other, name)
            if name not in self.MAXED:
                return a + b
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                return torch.maximum(torch.as_tensor(a), torch.as_tensor(b))
            return max(a, b)

        return LossStats(**{f.name: both(f.name) for f in fields(self)})

    def on_host(self) -> LossStats:
        """These stats with every tensor field a Python number, copied in one transfer."""
        names = [f.name for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)]
        if not names:
            return self
        values = torch.stack([getattr(self, n).double() for n in names]).tolist()
        ints = {f.name for f in fields(self) if isinstance(f.default, int)}
        host = {n: int(v) if n in ints else v for n, v in zip(names, values, strict=True)}
        return LossStats(**{f.name: host.get(f.name, getattr(self, f.name)) for f in fields(self)})

    def finalize(self) -> dict[str, float]:
        host = self.on_host()

        def num(name: str) -> float:
            return float(getattr(host, name))

        n, rl = max(host.loss_tokens, 1), max(host.rl_tokens, 1)
        out = {
            "loss": num("loss"),
            "loss_rl": num("loss_rl"),
            "loss_ce": num("loss_ce"),
            "loss_ref": num("loss_ref"),
            "entropy": num("entropy_sum") / n,
            "mismatch_kl": num("mismatch_kl_sum") / rl,
            "ratio_mean": num("ratio_sum") / rl if host.rl_tokens else 1.0,
            "masked_fraction": num("masked") / rl,
            "loss_tokens": float(host.loss_tokens),
            "rl_tokens": float(host.rl_tokens),
            "ce_tokens": float(host.ce_tokens),
            "ref_tokens": float(host.ref_tokens),
        }
        # Only when measured: 0.0 would read as a perfect fit (see the module docstring).
        if host.ce_tokens:
            out["ce_nll"] = num("ce_nll_sum") / host.ce_tokens
            out["ce_nll_max"] = num("ce_nll_max")
        if host.ref_tokens:
            out["ref_kl"] = num("ref_kl_sum") / host.ref_tokens
        return out


def _normalised_sum(
    per_token: torch.Tensor, where: torch.Tensor, normalize: str, denominator: int
) -> torch.Tensor:
    """One channel's share of the batch loss: ``per_token`` at ``where``, normalised."""
    if normalize == "tokens":
        weights = torch.full_like(per_token, 1.0 / max(denominator, 1))
    else:
        per_row = where.sum(dim=1, keepdim=True).clamp(min=1).to(per_token.dtype)
        weights = (1.0 / (per_row * max(denominator, 1))).expand_as(per_token)
    return torch.where(where, per_token * weights, torch.zeros_like(per_token)).sum()


class Known(NamedTuple):
    """What a micro-batch's loss needs to know on the host: each channel's positions, and
    whether any position needs a second log-softmax (``_logprobs``). ``known`` computes it
    from the host copy of the batch, so the device copy is never read back for it."""

    rl_tokens: int
    ce_tokens: int
    ref_tokens: int
    loss_tokens: int
    redo: bool


def _sampled_ref(mb: LossBatch, ref: torch.Tensor) -> torch.Tensor:
    # Sampled tokens: the rl channel's, and any token inference gave a logprob (a
    # distillation-only sample has no rl positions; unsampled tokens record exactly 0).
    return ref & (mb.mask | (mb.inference_logprobs != 0))


def _redo(mb: LossBatch, at_t: torch.Tensor, at_1: torch.Tensor) -> torch.Tensor:
    """Positions needed at temperature 1 that were sampled at another one."""
    return at_1 & at_t & (mb.temperatures > 0) & (mb.temperatures != 1)


def known(mb: LossBatch, phase: str) -> Known:
    """``Known`` of ``mb`` (best called on its host copy: each count is a read)."""
    ch = positions(mb, phase)
    rl, ce, ref = ch["rl"].positions, ch["ce"].positions, ch["ref"].positions
    redo = _redo(mb, rl | _sampled_ref(mb, ref), ce | ref)
    return Known(
        int(rl.sum()), int(ce.sum()), int(ref.sum()), int((rl | ce | ref).sum()), bool(redo.any())
    )


def _logprobs(
    logits: torch.Tensor, mb: LossBatch, at_t: torch.Tensor, at_1: torch.Tensor, redo_any: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lpT, lp1, entropy): lpT at the sampling temperature on ``at_t``, 1 elsewhere.

    One full-vocab log-softmax serves both wherever the temperature is 1 (or greedy);
    only the ``at_1`` positions that are also sampled at another temperature (``_redo``,
    ``redo_any`` says whether there are any) get a second one, on their rows alone (a
    second ``[B, T, V]`` would double the memory).
    """
    ones = torch.ones_like(mb.temperatures)
    temps = torch.where(at_t, mb.temperatures, ones)
    lp_t, entropy = token_logprobs(logits, mb.targets, temps)
    if not redo_any:
        return lp_t, lp_t, entropy
    redo = _redo(mb, at_t, at_1)
    lp_redo, _ = token_logprobs(logits[redo], mb.targets[redo], ones[redo])
    return lp_t, lp_t.masked_scatter(redo, lp_redo), entropy


def _masked_sum(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """The float64 sum of ``values`` at ``where``, without reading ``where`` on the host."""
    return torch.where(where, values.double(), 0.0).sum()


def policy_loss(
    logits: torch.Tensor,
    mb: LossBatch,
    cfg: LossConfig,
    phase: str,
    denominators: Mapping[str, int],
    facts: Known | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """This micro-batch's share of the batch loss (see the module docstring) and its stats.

    ``logits`` is ``[B, T, V]`` aligned with ``mb``; ``denominators`` is
    ``loss_denominators`` over the whole batch; ``facts`` is ``known(mb, phase)``, best
    computed on the host copy of ``mb`` (None: computed here, reading ``mb``). Nothing
    here waits for the device: the stats stay tensors there (``LossStats.on_host``).
    """
    _check_normalize(cfg.normalize)
    facts = facts if facts is not None else known(mb, phase)
    ch = positions(mb, phase)
    rl, ce, ref = ch["rl"].positions, ch["ce"].positions, ch["ref"].positions
    sampled_ref = _sampled_ref(mb, ref)
    lp_t, lp1, entropy = _logprobs(logits, mb, rl | sampled_ref, ce | ref, facts.redo)
    dtype = lp_t.dtype
    loss_pos = rl | ce | ref

    log_ratio = lp_t - mb.inference_logprobs.to(dtype)
    parts: dict[str, torch.Tensor] = {}
    masked: Any = 0
    # An empty channel is left out of the graph altogether: a batch without ce/ref tokens
    # computes exactly what the single-channel loss did, bit for bit.
    if facts.rl_tokens:
        with torch.no_grad():
            ratio_seen = torch.exp(log_ratio)
            kept = (
                rl
                & (ratio_seen >= 1.0 - cfg.trust_region_low)
                & (ratio_seen <= 1.0 + cfg.trust_region_high)
            )
            masked = (rl & ~kept).sum().double()
        # exp only where kept: a masked token's huge ratio must not turn into inf * 0 = nan
        # in the backward pass (torch.where's backward selects, it never multiplies).
        safe_log_ratio = torch.where(kept, log_ratio, torch.zeros_like(log_ratio))
        ratio = torch.exp(safe_log_ratio)
        rl_term = -(ratio * ch["rl"].weights.to(dtype))
        if cfg.kl_coef > 0:
            rl_term = rl_term + cfg.kl_coef * (ratio - 1.0 - safe_log_ratio)
        per_token = torch.where(kept, rl_term, torch.zeros_like(rl_term))
        parts["rl"] = _normalised_sum(per_token, rl, cfg.normalize, denominators["rl"])
    if facts.ce_tokens:
        per_token = -ch["ce"].weights.to(dtype) * lp1
        parts["ce"] = _normalised_sum(per_token, ce, cfg.normalize, denominators["ce"])
    if facts.ref_tokens:
        with torch.no_grad():
            # Capped in log space: exp of a stale token's huge log-ratio is inf, not a number.
            cap = math.log1p(cfg.trust_region_high)
            rho = torch.where(
                sampled_ref, torch.exp(log_ratio.detach().clamp(max=cap)), torch.ones_like(lp_t)
            )
            pull = ch["ref"].weights.to(dtype) * rho * (lp1.detach() - mb.ref_logprobs.to(dtype))
        parts["ref"] = _normalised_sum(pull * lp1, ref, cfg.normalize, denominators["ref"])

    if parts:
        loss = _total(parts)
    else:  # nothing to train here: a zero that still backpropagates (to zeros)
        loss = torch.where(loss_pos, lp_t, torch.zeros_like(lp_t)).sum()

    with torch.no_grad():
        clamped = log_ratio.detach().clamp(-_METRIC_LOG_RATIO_CLAMP, _METRIC_LOG_RATIO_CLAMP)
        k3 = torch.exp(clamped) - 1.0 - clamped
        ref_gap = (mb.ref_logprobs.to(dtype) - lp1.detach()).clamp(
            -_METRIC_LOG_RATIO_CLAMP, _METRIC_LOG_RATIO_CLAMP
        )
        ref_k3 = torch.exp(ref_gap) - 1.0 - ref_gap
        nll = -lp1.detach()
        stats = LossStats(
            loss=loss.detach().double(),
            loss_rl=parts["rl"].detach().double() if "rl" in parts else 0.0,
            loss_ce=parts["ce"].detach().double() if "ce" in parts else 0.0,
            loss_ref=parts["ref"].detach().double() if "ref" in parts else 0.0,
            loss_tokens=facts.loss_tokens,
            rl_tokens=facts.rl_tokens,
            ce_tokens=facts.ce_tokens,
            ref_tokens=facts.ref_tokens,
            masked=masked,
            entropy_sum=_masked_sum(entropy, loss_pos),
            mismatch_kl_sum=_masked_sum(k3, rl),
            ratio_sum=_masked_sum(torch.exp(clamped), rl),
            ce_nll_sum=_masked_sum(nll, ce),
            ce_nll_max=(torch.where(ce, nll, -math.inf).max().double() if facts.ce_tokens else 0.0),
            ref_kl_sum=_masked_sum(ref_k3, ref),
        )
    return loss, stats


def _total(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """The channels' contributions added in ``CHANNELS`` order (a lone one is returned as is)."""
    terms = [parts[name] for name in CHANNELS if name in parts]
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total
