"""Unit tests for roles.inference.sampling: filtering, logprobs and seeded draws."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roles.inference.sampling import (
    RowParams,
    filtered_logprobs,
    make_generator,
    sample,
    validate,
)


def _logits(rows: int, vocab: int = 50, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def test_greedy_is_argmax_and_reports_plain_log_softmax() -> None:
    """Temperature 0 picks the argmax and reports log_softmax at temperature 1."""
    logits = _logits(4)
    params = RowParams.of([0.0] * 4, top_k=[0, 3, 0, 1], top_p=[1.0, 1.0, 0.5, 1.0])
    ids, lps = sample(logits, params, [None] * 4)
    assert ids.tolist() == logits.argmax(-1).tolist()
    expected = logits.log_softmax(-1).gather(-1, ids[:, None]).squeeze(-1)
    torch.testing.assert_close(lps, expected)


def test_top_k_one_equals_greedy_at_any_temperature() -> None:
    """top_k=1 leaves one token: the argmax, with probability 1 (logprob 0)."""
    logits = _logits(6, seed=1)
    params = RowParams.of([2.0] * 6, top_k=[1] * 6)
    ids, lps = sample(logits, params, [make_generator(i) for i in range(6)])
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
    g = make_generator(7)
    draws = {int(sample(probs.log(), RowParams.of([1.0], top_p=[0.7]), [g])[0]) for _ in range(300)}
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
    """The exponential-race draw picks each token with its filtered probability."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    params = RowParams.of([1.3], top_k=[4])
    expected = filtered_logprobs(logits, params).exp()[0]
    g = make_generator(3)
    n = 4000
    counts = torch.zeros(5)
    for _ in range(n):
        counts[int(sample(logits, params, [g])[0])] += 1
    assert counts[4] == 0  # outside top_k
    assert torch.allclose(counts / n, expected, atol=0.03)


def test_same_seed_same_draws_regardless_of_batch_position() -> None:
    """A request's draws depend on its seed and logits only, not on its batch row."""
    logits = _logits(1, vocab=80, seed=4, scale=1.0)  # flat: every draw is a real choice
    p1 = RowParams.of([1.0])

    def alone(seed: int) -> list[int]:
        g = make_generator(seed)
        return [int(sample(logits, p1, [g])[0][0]) for _ in range(20)]

    def in_batch(seed: int, row: int) -> list[int]:
        others = _logits(3, vocab=80, seed=9)
        batch = torch.cat([others[:row], logits, others[row:]])
        params = RowParams(
            temperature=torch.tensor([0.7] * row + [1.0] + [0.7] * (3 - row)),
            top_k=torch.zeros(4, dtype=torch.long),
            top_p=torch.ones(4),
        )
        gens = [make_generator(100 + i) for i in range(4)]
        gens[row] = make_generator(seed)
        return [int(sample(batch, params, gens)[0][row]) for _ in range(20)]

    assert alone(11) == alone(11)
    assert alone(11) != alone(12)
    assert in_batch(11, 0) == alone(11) == in_batch(11, 2)


def test_rows_with_different_params_match_rows_sampled_alone() -> None:
    """One batch mixing greedy, top-k, top-p and plain rows equals each row on its own."""
    logits = _logits(4, seed=5, scale=1.5)
    temps, ks, ps = [0.0, 0.7, 1.0, 1.5], [0, 5, 0, 0], [1.0, 1.0, 0.6, 1.0]
    params = RowParams.of(temps, ks, ps)
    ids, lps = sample(logits, params, [make_generator(s) for s in range(4)])
    batch_lp = filtered_logprobs(logits, params)
    for r in range(4):
        one = RowParams.of([temps[r]], [ks[r]], [ps[r]])
        id1, lp1 = sample(logits[r : r + 1], one, [make_generator(r)])
        assert int(id1) == int(ids[r])
        torch.testing.assert_close(lp1[0], lps[r])
        torch.testing.assert_close(filtered_logprobs(logits[r : r + 1], one)[0], batch_lp[r])


def test_sampling_row_without_generator_is_an_error() -> None:
    """A non-greedy row must bring its own random stream (no silent global RNG)."""
    with pytest.raises(ValueError, match="no generator"):
        sample(_logits(1), RowParams.of([1.0]), [None])


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
