"""Unit tests for roles.inference.sampling: filtering, logprobs and seeded draws."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roles.inference.sampling import (
    RowParams,
    filtered_logprobs,
    row_keys,
    sample,
    uniforms,
    validate,
)


def _logits(rows: int, vocab: int = 50, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def _u(seeds: list[int], steps: list[int] | None = None) -> torch.Tensor:
    """Each row's uniform draw [B, 1] for request seeds at completion steps (0 default)."""
    at = np.array(steps if steps is not None else [0] * len(seeds), dtype=np.uint64)
    return torch.from_numpy(uniforms(row_keys(seeds), at))[:, None]


def _draws(logits: torch.Tensor, params: RowParams, seed: int, n: int) -> list[int]:
    """One row's first ``n`` tokens from the same logits (steps 0..n-1 of its stream)."""
    rows = logits.expand(n, -1)
    p = RowParams.of([float(params.temperature[0])] * n, [int(params.top_k[0])] * n,
                     [float(params.top_p[0])] * n)  # fmt: skip
    return sample(rows, p, _u([seed] * n, list(range(n))), filtered=True)[0].tolist()


def test_greedy_is_argmax_and_reports_plain_log_softmax() -> None:
    """Temperature 0 picks the argmax and reports log_softmax at temperature 1."""
    logits = _logits(4)
    params = RowParams.of([0.0] * 4, top_k=[0, 3, 0, 1], top_p=[1.0, 1.0, 0.5, 1.0])
    ids, lps = sample(logits, params, _u([1, 2, 3, 4]), filtered=True)
    assert ids.tolist() == logits.argmax(-1).tolist()
    expected = logits.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    torch.testing.assert_close(lps, expected)


def test_top_k_one_equals_greedy_at_any_temperature() -> None:
    """top_k=1 leaves one token: the argmax, with probability 1 (logprob 0)."""
    logits = _logits(6, seed=1)
    params = RowParams.of([2.0] * 6, top_k=[1] * 6)
    ids, lps = sample(logits, params, _u(list(range(6))), filtered=True)
    assert ids.tolist() == logits.argmax(-1).tolist()
    torch.testing.assert_close(lps, torch.zeros(6))


def test_top_p_masks_the_tail_and_renormalises() -> None:
    """With probs .5/.3/.15/.05 and top_p=.7, only the first two survive, renormalised."""
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    lp = filtered_logprobs(probs.log(), RowParams.of([1.0], top_p=[0.7]))
    torch.testing.assert_close(lp.exp(), torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # top_p exactly at a boundary keeps the token that reaches it (mass before it is .5).
    lp = filtered_logprobs(probs.log(), RowParams.of([1.0], top_p=[0.8]))
    assert (lp.exp() > 0).tolist() == [[True, True, False, False]]
    draws = set(_draws(probs.log(), RowParams.of([1.0], top_p=[0.7]), seed=7, n=300))
    assert draws == {0, 1}


def test_top_k_keeps_exactly_k_tokens() -> None:
    """top_k=k leaves the k most likely tokens (the filtered support has size k)."""
    logits = _logits(3, seed=2)
    lp = filtered_logprobs(logits, RowParams.of([1.0] * 3, top_k=[1, 5, 20]))
    assert (lp > -math.inf).sum(-1).tolist() == [1, 5, 20]
    top5 = set(logits[1].topk(5).indices.tolist())
    assert set((lp[1] > -math.inf).nonzero().flatten().tolist()) == top5


@settings(max_examples=60, deadline=None)
@given(
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 60),
    top_p=st.floats(0.01, 1.0),
    seed=st.integers(0, 1000),
)
def test_filtered_distribution_sums_to_one(
    temperature: float, top_k: int, top_p: float, seed: int
) -> None:
    """Whatever the parameters, the distribution sampled from is a distribution."""
    logits = _logits(2, seed=seed)
    lp = filtered_logprobs(logits, RowParams.of([temperature] * 2, [top_k] * 2, [top_p] * 2))
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(2))
    kept = (lp > -math.inf).sum(-1)
    assert (kept >= 1).all()
    if top_k:
        assert (kept <= top_k).all()


def test_sampled_frequencies_follow_the_filtered_distribution() -> None:
    """The inverse-CDF draw picks each token with its filtered probability, over one
    request's steps and over many requests' seeds alike."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    params = RowParams.of([1.3], top_k=[4])
    expected = filtered_logprobs(logits, params).exp()[0]
    n = 4000
    for draws in (
        _draws(logits, params, seed=3, n=n),  # one stream, n steps
        sample(logits.expand(n, -1), RowParams.of([1.3] * n, top_k=[4] * n), _u(list(range(n))),
               filtered=True)[0].tolist(),  # n seeds, step 0
    ):  # fmt: skip
        counts = torch.bincount(torch.tensor(draws), minlength=5).float()
        assert counts[4] == 0  # outside top_k
        assert torch.allclose(counts / n, expected, atol=0.03)


def test_uniform_draws_are_uniform_and_a_pure_function_of_seed_and_step() -> None:
    """The counter-based stream: same (seed, step) -> same draw; draws over seeds and over
    steps look uniform on [0, 1) (mean, variance, and every tenth of the range used)."""
    steps = np.arange(5000, dtype=np.uint64)
    one = uniforms(row_keys([12345] * 5000), steps)
    many = uniforms(row_keys(list(range(5000))), np.zeros(5000, dtype=np.uint64))
    for u in (one, many):
        assert u.min() >= 0 and u.max() < 1
        assert abs(u.mean() - 0.5) < 0.02 and abs(u.var() - 1 / 12) < 0.005
        assert np.histogram(u, bins=10, range=(0, 1))[0].min() > 400
    again = uniforms(row_keys([12345] * 5000), steps)
    assert (again == one).all()
    assert uniforms(row_keys([2**64 + 7]), steps[:1]) == uniforms(row_keys([7]), steps[:1])


def test_same_seed_same_draws_regardless_of_batch_position() -> None:
    """A request's draws depend on its seed, step and logits only, not on its batch row."""
    logits = _logits(1, vocab=80, seed=4, scale=1.0)  # flat: every draw is a real choice
    p1 = RowParams.of([1.0])
    alone = _draws(logits, p1, seed=11, n=20)

    def in_batch(seed: int, row: int, step: int) -> int:
        others = _logits(3, vocab=80, seed=9)
        batch = torch.cat([others[:row], logits, others[row:]])
        params = RowParams.of([0.7] * row + [1.0] + [0.7] * (3 - row))
        seeds = [100, 101, 102, 103]
        seeds[row] = seed
        steps = [5, 6, 7, 8]
        steps[row] = step
        return int(sample(batch, params, _u(seeds, steps), filtered=False)[0][row])

    assert alone == _draws(logits, p1, seed=11, n=20)
    assert alone != _draws(logits, p1, seed=12, n=20)
    assert (
        [in_batch(11, 0, t) for t in range(20)] == alone == [in_batch(11, 2, t) for t in range(20)]
    )


def test_rows_with_different_params_match_rows_sampled_alone() -> None:
    """One batch mixing greedy, top-k, top-p and plain rows equals each row on its own,
    with or without the filtering pass (the engine skips it when no row filters)."""
    logits = _logits(4, seed=5, scale=1.5)
    temps, ks, ps = [0.0, 0.7, 1.0, 1.5], [0, 5, 0, 0], [1.0, 1.0, 0.6, 1.0]
    params = RowParams.of(temps, ks, ps)
    ids, lps = sample(logits, params, _u([0, 1, 2, 3]), filtered=True)
    batch_lp = filtered_logprobs(logits, params)
    for r in range(4):
        one = RowParams.of([temps[r]], [ks[r]], [ps[r]])
        id1, lp1 = sample(logits[r : r + 1], one, _u([r]), filtered=True)
        assert int(id1) == int(ids[r])
        torch.testing.assert_close(lp1[0], lps[r])
        torch.testing.assert_close(filtered_logprobs(logits[r : r + 1], one)[0], batch_lp[r])
    plain = RowParams.of([0.0, 0.7, 1.5])
    rows = logits[[0, 1, 3]]
    torch.testing.assert_close(
        sample(rows, plain, _u([4, 5, 6]), filtered=False)[1],
        sample(rows, plain, _u([4, 5, 6]), filtered=True)[1],
    )


def test_a_draw_never_lands_on_a_token_of_zero_probability() -> None:
    """u is at most 1 - 2^-52, so u * total stays below the row's mass: even the largest
    draw picks a token the filter kept (never one with logprob -inf)."""
    logits = torch.tensor([[3.0, 2.0, 1.0, -2.0, -4.0]] * 2)
    params = RowParams.of([1.0, 1.0], top_k=[2, 0], top_p=[1.0, 0.3])
    top = torch.full((2, 1), 1 - 2.0**-52, dtype=torch.float64)
    ids, lps = sample(logits, params, top, filtered=True)
    assert ids.tolist() == [1, 0] and torch.isfinite(lps).all()


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p", "ok"),
    [(0.0, 0, 1.0, True), (-0.1, 0, 1.0, False), (1.0, -1, 1.0, False), (1.0, 0, 0.0, False),
     (1.0, 0, 1.5, False), (float("nan"), 0, 1.0, False)],
)  # fmt: skip
def test_validate_rejects_impossible_parameters(
    temperature: float, top_k: int, top_p: float, ok: bool
) -> None:
    """Negative temperature/top_k, top_p outside (0, 1] and NaN are refused with a reason."""
    assert (validate(temperature, top_k, top_p) is None) == ok
