"""Token sampling on logits: temperature, top-k, top-p per row, seeded per request.

Pure functions on tensors, shared by every torch-side consumer (the torch backend, its
tests, and anyone who needs "the distribution inference sampled from" to recompute a
logprob). The rules:

- each row has its own ``temperature`` (0 = greedy), ``top_k`` (0 = off) and ``top_p``
  (1 = off), applied in that order (as Hugging Face and vLLM do): scale by 1/T, keep the
  k most likely tokens, then keep the smallest prefix of the sorted distribution whose
  mass reaches p, renormalise;
- the logprob reported for a sampled token is its log-probability under that filtered,
  renormalised distribution, i.e. the distribution actually sampled from. A greedy row
  reports the plain log-softmax of its logits (temperature 1, unfiltered): a point mass
  would make every logprob 0 and useless to the trainer;
- randomness comes from one ``torch.Generator`` per request, seeded from the request's
  seed, so a request's completion depends only on its seed and its logits, never on
  which other requests share its batch or where its row sits (no global RNG).

    p = RowParams.of(temperature=[0.0, 1.0], top_k=[0, 5], top_p=[1.0, 0.9])
    ids, logprobs = sample(logits, p, [make_generator(1), make_generator(2)])
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Seeds are reduced into torch's accepted range (it takes unsigned 64-bit values).
_SEED_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class RowParams:
    """Sampling parameters of each row of a batch, as 1-D tensors of length B."""

    temperature: torch.Tensor  # float; 0 = greedy
    top_k: torch.Tensor  # long; 0 = off
    top_p: torch.Tensor  # float in (0, 1]; 1 = off

    @classmethod
    def of(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int] | None = None,
        top_p: Sequence[float] | None = None,
        device: torch.device | str = "cpu",
    ) -> RowParams:
        n = len(temperature)
        return cls(
            temperature=torch.tensor(list(temperature), dtype=torch.float32, device=device),
            top_k=torch.tensor(list(top_k) if top_k is not None else [0] * n, device=device).long(),
            top_p=torch.tensor(
                list(top_p) if top_p is not None else [1.0] * n, dtype=torch.float32, device=device
            ),
        )

    @property
    def greedy(self) -> torch.Tensor:
        return self.temperature <= 0

    def select(self, rows: torch.Tensor) -> RowParams:
        """The parameters of a subset of rows (finished rows leave the batch)."""
        return RowParams(self.temperature[rows], self.top_k[rows], self.top_p[rows])


def validate(temperature: float, top_k: int, top_p: float) -> str | None:
    """Why these parameters cannot be sampled with, or None when they can."""
    if not temperature >= 0:  # also rejects NaN
        return f"temperature must be >= 0 (0 = greedy), got {temperature}"
    if top_k < 0:
        return f"top_k must be >= 0 (0 = off), got {top_k}"
    if not 0 < top_p <= 1:
        return f"top_p must be in (0, 1], got {top_p}"
    return None


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's own random stream (on the device its noise is drawn on)."""
    g = torch.Generator(device=device)
    g.manual_seed(seed & _SEED_MASK)
    return g


def filtered_logprobs(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """Log-probs [B, V] of the distribution each row samples from (-inf where filtered).

    Greedy rows get ``log_softmax(logits)`` (temperature 1, unfiltered).
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    greedy = params.greedy
    temperature = torch.where(greedy, torch.ones_like(params.temperature), params.temperature)
    scaled = logits / temperature[:, None]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    k = torch.where(params.top_k > 0, params.top_k.clamp(max=vocab), vocab)
    remove_sorted = ranks >= k[:, None]
    probs_sorted = sorted_logits.masked_fill(remove_sorted, float("-inf")).softmax(dim=-1)
    # A token is dropped when the tokens ranked above it already hold top_p of the mass;
    # the first token never is (its mass before is 0 < top_p). top_p == 1 is skipped
    # outright: rounding in the cumsum could otherwise drop tail tokens it must keep.
    mass_before = probs_sorted.cumsum(dim=-1) - probs_sorted
    nucleus_on = (params.top_p < 1)[:, None]
    remove_sorted = remove_sorted | (nucleus_on & (mass_before >= params.top_p[:, None]))
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    out = scaled.masked_fill(remove, float("-inf")).log_softmax(dim=-1)
    return torch.where(greedy[:, None], logits.log_softmax(dim=-1), out)


def sample(
    logits: torch.Tensor, params: RowParams, generators: Sequence[torch.Generator | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row: (ids [B] long, logprobs [B] float32).

    Non-greedy rows draw with the exponential-race trick: argmax(p / E) with E ~ Exp(1)
    i.i.d. picks token i with probability p_i. The noise of row r comes only from
    ``generators[r]``, so the row's draw is independent of the rest of the batch.
    Greedy rows take the argmax of the raw logits and need no generator.
    """
    logprobs = filtered_logprobs(logits, params)
    greedy = params.greedy
    ids = logits.float().argmax(dim=-1)
    random_rows = (~greedy).nonzero().flatten().tolist()
    if random_rows:
        vocab = logits.shape[-1]
        noise = torch.empty(len(random_rows), vocab, device=logits.device)
        for j, row in enumerate(random_rows):
            g = generators[row]
            if g is None:
                raise ValueError(f"row {row} samples (temperature > 0) but has no generator")
            noise[j].exponential_(generator=g)
        # exponential_ may return exactly 0; a tiny floor keeps p / E finite.
        probs = logprobs[random_rows].exp()
        drawn = (probs / noise.clamp_min(1e-30)).argmax(dim=-1)
        ids[random_rows] = drawn
    chosen = logprobs.gather(-1, ids[:, None]).squeeze(-1)
    return ids, chosen
