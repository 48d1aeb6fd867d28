"""Token sampling on logits for every row at once: temperature, top-k, top-p, seeded per row.

Pure functions on tensors, shared by the torch engine's decode step, its tests, and anyone
who needs "the distribution inference sampled from" to recompute a logprob. The rules:

- each row has its own ``temperature`` (0 = greedy), ``top_k`` (0 = off) and ``top_p``
  (1 = off), applied in that order (as Hugging Face and vLLM do): scale by 1/T, keep the
  k most likely tokens, then keep the smallest prefix of the sorted distribution whose
  mass reaches p, renormalise;
- the logprob reported for a sampled token is its log-probability under that filtered,
  renormalised distribution, i.e. the distribution actually sampled from. A greedy row
  reports the plain log-softmax of its logits (temperature 1, unfiltered): a point mass
  would make every logprob 0 and useless to the trainer;
- randomness is counter-based: row r's draw at its completion token t is a pure hash of
  (the request's seed, t) (``uniforms``: splitmix64, computed on the host with numpy for
  every row at once), so a request's completion depends only on its seed and its logits,
  never on which other requests share its batch, where its row sits or when it was
  admitted; and the device step needs no per-row generator, no Python loop over rows and
  no host sync, so it can be captured in a CUDA graph.

How a row draws: one uniform ``u`` in [0, 1) per row and step (52 bits), then the inverse
CDF: the first token whose cumulative probability (summed in float64 in vocabulary
order) exceeds ``u`` times the row's total mass. One random number per row instead of
one per vocabulary entry (an exponential race over a 151k vocabulary costs a dozen
passes over [B, V] per step).

    p = RowParams.of(temperature=[0.0, 1.0], top_k=[0, 5], top_p=[1.0, 0.9])
    u = torch.from_numpy(uniforms(row_keys([1, 2]), np.array([0, 0], dtype=np.uint64)))
    ids, logprobs = sample(logits, p, u[:, None], filtered=True)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RowParams:
    """Sampling parameters of each row of a batch, as tensors with one entry per row."""

    temperature: torch.Tensor  # float [B]; 0 = greedy
    top_k: torch.Tensor  # long [B]; 0 = off
    top_p: torch.Tensor  # float [B] in (0, 1]; 1 = off
    inv_temperature: torch.Tensor  # float [B, 1]: 1 / temperature, 1 for greedy rows
    greedy: torch.Tensor  # bool [B]

    @classmethod
    def of(
        cls,
        temperature: Sequence[float],
        top_k: Sequence[int] | None = None,
        top_p: Sequence[float] | None = None,
        device: torch.device | str = "cpu",
    ) -> RowParams:
        n = len(temperature)
        t = torch.tensor(list(temperature), dtype=torch.float32, device=device)
        return cls(
            temperature=t,
            top_k=torch.tensor(list(top_k) if top_k is not None else [0] * n, device=device).long(),
            top_p=torch.tensor(
                list(top_p) if top_p is not None else [1.0] * n, dtype=torch.float32, device=device
            ),
            inv_temperature=torch.where(t > 0, 1.0 / t, 1.0)[:, None],
            greedy=t <= 0,
        )

    def head(self, b: int) -> RowParams:
        """The parameters of rows ``[0, b)`` (views)."""
        return RowParams(
            self.temperature[:b],
            self.top_k[:b],
            self.top_p[:b],
            self.inv_temperature[:b],
            self.greedy[:b],
        )

    def put(self, rows: torch.Tensor, other: RowParams) -> None:
        """Write ``other``'s rows into rows ``rows`` of these tensors (in place)."""
        for name in ("temperature", "top_k", "top_p", "inv_temperature", "greedy"):
            getattr(self, name)[rows] = getattr(other, name)


def validate(temperature: float, top_k: int, top_p: float) -> str | None:
    """Why these parameters cannot be sampled with, or None when they can."""
    if not temperature >= 0:  # also rejects NaN
        return f"temperature must be >= 0 (0 = greedy), got {temperature}"
    if top_k < 0:
        return f"top_k must be >= 0 (0 = off), got {top_k}"
    if not 0 < top_p <= 1:
        return f"top_p must be in (0, 1], got {top_p}"
    return None


def filters(temperature: float, top_k: int, top_p: float) -> bool:
    """Whether a row with these parameters needs the top-k/top-p filter (a sort)."""
    return temperature > 0 and (top_k > 0 or top_p < 1)


def plain_logprobs(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """Log-probs [B, V] of rows that need no filter: ``log_softmax(logits / T)`` (T = 1
    for greedy rows)."""
    return (logits * params.inv_temperature).log_softmax(dim=-1)  # (float32: promoted)


def filtered_logprobs(logits: torch.Tensor, params: RowParams) -> torch.Tensor:
    """Log-probs [B, V] of the distribution each row samples from (-inf where filtered).

    Greedy rows get ``log_softmax(logits)`` (temperature 1, unfiltered).
    """
    scaled = logits * params.inv_temperature  # float32 whatever the logits' dtype
    vocab = logits.shape[-1]
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
    remove_sorted = remove_sorted & ~params.greedy[:, None]
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return scaled.masked_fill(remove, float("-inf")).log_softmax(dim=-1)


# -- counter-based randomness --------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 values (wrapping arithmetic, as numpy's uint64)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def row_keys(seeds: Sequence[int]) -> np.ndarray:
    """Each request's stream key (uint64 [B]): its seed (any Python int), hashed."""
    return _splitmix64(np.array([s & 0xFFFFFFFFFFFFFFFF for s in seeds], dtype=np.uint64))


def uniforms(keys: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """One uniform draw in [0, 1 - 2^-52] per row (float64 [B]): splitmix64's output
    number ``step + 1`` of the stream ``key`` (52 bits, not 53: then ``u * total`` stays
    strictly below ``total`` after rounding, so the inverse CDF always lands on a token
    of positive probability)."""
    with np.errstate(over="ignore"):
        z = _splitmix64(keys + (steps.astype(np.uint64) + np.uint64(1)) * _GOLDEN)
    return (z >> np.uint64(12)).astype(np.float64) * 2.0**-52


def sample(
    logits: torch.Tensor, params: RowParams, u: torch.Tensor, *, filtered: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row: (ids [B] long, logprobs [B] float32).

    ``u`` [B, 1] holds each row's uniform draw (``uniforms``); ``filtered`` says whether
    any row uses top-k or top-p (``filters``): without, the sort is skipped. A row's token
    is the first whose cumulative probability exceeds ``u`` times the row's mass (inverse
    CDF); greedy rows take the argmax of their logits.
    """
    lp = filtered_logprobs(logits, params) if filtered else plain_logprobs(logits, params)
    cdf = lp.exp().cumsum(dim=-1, dtype=torch.float64)
    drawn = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
    ids = torch.where(params.greedy, logits.argmax(dim=-1), drawn.clamp_(max=lp.shape[-1] - 1))
    return ids, lp.gather(-1, ids[:, None]).squeeze(1)
