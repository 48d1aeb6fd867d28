"""Packing samples into micro-batches: bounds, coverage, determinism, and aligned collation."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roles.trainer.packing import collate, pack
from schemas import Sample
from schemas.arrays import pack_f32, pack_i32, pack_mask


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=300), max_size=60),
    st.integers(min_value=1, max_value=512),
    st.one_of(st.none(), st.integers(min_value=1, max_value=8)),
)
def test_pack_bounds_and_coverage(lengths: list[int], seq_len: int, max_rows: int | None) -> None:
    """Every sample lands in exactly one micro-batch; rows x longest <= seq_len unless a lone oversize sample."""
    bins = pack(lengths, seq_len, max_rows)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert b
        padded = len(b) * max(lengths[i] for i in b)
        assert padded <= seq_len or (len(b) == 1 and lengths[b[0]] > seq_len)
        if max_rows is not None:
            assert len(b) <= max_rows


def test_pack_is_first_fit_decreasing_with_stable_ties() -> None:
    """Longest first, ties by index, each into the first micro-batch with room."""
    lengths = [3, 5, 3, 10, 5, 2]
    assert pack(lengths, seq_len=10) == [[3], [1, 4], [0, 2, 5]]
    assert pack(lengths, seq_len=10, max_rows=2) == [[3], [1, 4], [0, 2], [5]]
    assert pack([20, 4, 4], seq_len=8) == [[0], [1, 2]]  # oversize alone, never truncated


def test_pack_is_deterministic_across_calls() -> None:
    """The same lengths always pack the same way (no dict/set or hash ordering)."""
    rng = random.Random(0)
    lengths = [rng.randint(1, 80) for _ in range(100)]
    first = pack(lengths, 256)
    assert all(pack(list(lengths), 256) == first for _ in range(5))


def _sample(ids: list[int], sft: bool = False) -> Sample:
    n = len(ids)
    return Sample(
        rollout_id=f"r{ids[0]}", branch=0, env="e", task_index=0, group_id="g",
        token_ids=pack_i32(ids), mask=pack_mask([i >= 2 for i in range(n)]),
        logprobs=pack_f32([-0.1 * i for i in range(n)]), temperatures=pack_f32([0.5] * n),
        advantages=pack_f32([float(ids[0])] * n), sft_mask=pack_mask([1] * n) if sft else None,
    )  # fmt: skip


def test_collate_shifts_targets_and_per_token_arrays_by_one() -> None:
    """Loss position t holds token t+1 and its arrays; padding is masked out."""
    samples = [_sample([10, 11, 12, 13]), _sample([20, 21], sft=True)]
    mb = collate(samples, [0, 1], pad_id=0)
    assert mb.input_ids.tolist() == [[10, 11, 12, 13], [20, 21, 0, 0]]
    assert mb.lengths == [4, 2] and mb.num_tokens == 6
    loss = mb.loss
    assert loss.targets.tolist() == [[11, 12, 13], [21, 0, 0]]
    assert loss.mask.tolist() == [[False, True, True], [False, False, False]]
    assert loss.sft_mask.tolist() == [[False, False, False], [True, False, False]]
    np.testing.assert_allclose(loss.inference_logprobs[0].numpy(), [-0.1, -0.2, -0.3], rtol=1e-6)
    assert loss.advantages[1, 0] == 20.0 and loss.advantages[1, 1] == 0.0
    assert loss.temperatures.dtype == torch.float32
    # channel defaults: ce weight 1 on the sample's sft_mask, nothing in the ref channel
    assert loss.ce_weights.tolist() == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert not loss.ref_weights.any() and not loss.ref_logprobs.any()
    assert loss.ce_weights.dtype == loss.ref_weights.dtype == torch.float32


def test_collate_aligns_channel_arrays_like_the_others() -> None:
    """ce_weights, ref_logprobs and ref_weights are shifted by one and zero-padded."""
    with_channels = msgspec.structs.replace(
        _sample([30, 31, 32, 33], sft=True),
        ce_weights=pack_f32([9.0, 0.5, 0.25, 0.125]),
        ref_logprobs=pack_f32([-9.0, -1.0, -2.0, -3.0]),
        ref_weights=pack_f32([9.0, 0.0, 0.1, 0.2]),
    )
    plain = _sample([40, 41])
    loss = collate([with_channels, plain], [0, 1]).loss
    assert loss.ce_weights.tolist() == [[0.5, 0.25, 0.125], [0.0, 0.0, 0.0]]
    assert loss.ref_logprobs.tolist() == [[-1.0, -2.0, -3.0], [0.0, 0.0, 0.0]]
    np.testing.assert_allclose(loss.ref_weights.numpy(), [[0.0, 0.1, 0.2], [0, 0, 0]], rtol=1e-6)


def test_collate_rejects_misaligned_arrays() -> None:
    """A sample whose per-token arrays disagree in length is an error, not silent garbage."""
    bad = Sample(
        rollout_id="bad", branch=0, env="e", task_index=0, group_id="g",
        token_ids=pack_i32([1, 2, 3]), mask=pack_mask([1, 1]), logprobs=pack_f32([0, 0, 0]),
        temperatures=pack_f32([1, 1, 1]), advantages=pack_f32([0, 0, 0]),
    )  # fmt: skip
    with pytest.raises(ValueError, match="mask has 2 entries for 3 tokens"):
        collate([bad], [0])


@pytest.mark.parametrize("name", ["sft_mask", "ce_weights", "ref_logprobs", "ref_weights"])
def test_collate_rejects_misaligned_channel_arrays(name: str) -> None:
    """The optional channel arrays are length-checked too."""
    value = pack_mask([1, 1]) if name == "sft_mask" else pack_f32([0.5, 0.5])
    bad = msgspec.structs.replace(_sample([1, 2, 3]), **{name: value})
    if name == "ref_weights":
        bad = msgspec.structs.replace(bad, ref_logprobs=pack_f32([0, 0, 0]))
    with pytest.raises(ValueError, match=f"{name} has 2 entries for 3 tokens"):
        collate([bad], [0])


def test_collate_rejects_ref_weights_without_reference_logprobs() -> None:
    """A ref_kl weight with nothing to pull toward is an error, not a pull toward logprob 0."""
    bad = msgspec.structs.replace(_sample([1, 2, 3]), ref_weights=pack_f32([0, 0.1, 0.1]))
    with pytest.raises(ValueError, match="ref_weights without ref_logprobs"):
        collate([bad], [0])
