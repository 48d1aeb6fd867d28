"""Packing samples into micro-batches: bounds, coverage, determinism, and aligned collation."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from roles.trainer.loss import loss_denominators
from roles.trainer.packing import (
    PrefixGroup,
    collate,
    collate_batch,
    collate_shared,
    first_trained,
    pack,
    pack_groups,
    prefix_groups,
)
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


# -- shared prefixes ---------------------------------------------------------------------


def _turns(*parts: tuple[list[int], bool], ref: bool = False) -> Sample:
    """A sample of ``parts`` (tokens, trained?): a prompt, a completion, a tool's or a
    user's turn, another completion...; trained parts are in ``mask`` (and, with ``ref``,
    the ref_kl channel)."""
    ids = [t for tokens, _ in parts for t in tokens]
    trained = [on for tokens, on in parts for _ in tokens]
    n = len(ids)
    return Sample(
        rollout_id=f"r{ids}", branch=0, env="e", task_index=0, group_id="g",
        token_ids=pack_i32(ids), mask=pack_mask(trained),
        logprobs=pack_f32([-0.01 * (i + 1) if on else 0.0 for i, on in enumerate(trained)]),
        temperatures=pack_f32([1.0] * n), advantages=pack_f32([0.5 if on else 0.0 for on in trained]),
        ref_logprobs=pack_f32([-1.0] * n) if ref else None,
        ref_weights=pack_f32([0.1 if on else 0.0 for on in trained]) if ref else None,
    )  # fmt: skip


PROMPT, OTHER = [1, 5, 6, 7, 8, 9], [1, 5, 6, 7, 3]


def _grpo() -> list[Sample]:
    """Two groups of completions of two prompts, interleaved, and a prompt of its own."""
    return [
        _turns((PROMPT, False), ([20, 21, 2], True)),
        _turns((OTHER, False), ([30, 2], True)),
        _turns((PROMPT, False), ([22, 2], True)),
        _turns(([4, 4, 4], False), ([40, 41, 2], True)),
        _turns((OTHER, False), ([31, 32, 33, 2], True)),
        _turns((PROMPT, False), ([23, 24, 25, 26, 2], True)),
    ]


def test_first_trained_is_the_first_token_any_channel_trains() -> None:
    """mask, sft_mask, ce_weights > 0 and ref_weights > 0 all count; token 0 never does."""
    ones = np.ones(6, dtype=bool)
    none = np.zeros(6, dtype=bool)
    assert first_trained({"mask": none}) is None
    assert first_trained({"mask": ones}) == 1  # token 0 is never trained
    at = {name: np.arange(6) >= k for name, k in (("mask", 5), ("sft_mask", 4))}
    assert first_trained(at) == 4
    assert first_trained({**at, "ce_weights": np.where(np.arange(6) >= 3, 0.5, 0.0)}) == 3
    assert first_trained({**at, "ref_weights": np.array([0, 0, 0.1, 0, 0, 0])}) == 2


def test_samples_share_their_prompt_but_its_last_token() -> None:
    """Groups of equal prefixes (the prompt less its last token, whose logits predict the
    first completion token), in order of their first members; a prompt of its own and a
    prompt that is only a prefix of another's share nothing."""
    samples = _grpo()
    assert prefix_groups(samples) == [
        PrefixGroup(len(PROMPT) - 1, [0, 2, 5]),
        PrefixGroup(len(OTHER) - 1, [1, 4]),
    ]
    alike = [
        _turns(([1, 5, 6, 7], False), ([9], True)),
        _turns(([1, 5, 6, 7, 8], False), ([9], True)),
    ]
    assert prefix_groups(alike) == []  # [1, 5, 6] vs [1, 5, 6, 7]: different prefixes
    assert prefix_groups([_turns(([1], False), ([2, 3], True))] * 2) == []  # nothing to share


def test_multi_turn_samples_share_only_up_to_their_first_trained_token() -> None:
    """A trained first turn ends the shared prefix there, wherever later turns differ; a
    tool's turn in the ce channel (sft_mask, mask 0) or a ref_kl token ends it too."""
    turn, tool = ([20, 21], True), ([50, 51], False)
    a = _turns((PROMPT, False), turn, tool, ([60, 2], True))
    b = _turns((PROMPT, False), turn, tool, ([61, 62, 2], True))
    assert prefix_groups([a, b]) == [PrefixGroup(len(PROMPT) - 1, [0, 1])]
    # Replayed first turns that are not trained: the prefix runs on to the second turn.
    a2, b2 = (_turns((PROMPT, False), (t, False), tool, ([60, 2], True)) for t in ([20, 21],) * 2)
    assert prefix_groups([a2, b2]) == [PrefixGroup(len(PROMPT) + 3, [0, 1])]
    tool_ce = np.zeros(len(a2), dtype=bool)
    tool_ce[len(PROMPT) + 2] = True  # the tool's first token, in the ce channel
    c = msgspec.structs.replace(a2, sft_mask=pack_mask(tool_ce.tolist()))
    assert prefix_groups([c, b2]) == []  # c shares fewer tokens than b2: other prefixes
    assert prefix_groups([c, c]) == [PrefixGroup(len(PROMPT) + 1, [0, 1])]
    r1, r2 = (
        _turns((PROMPT, False), ([20, 2], True), ref=True),
        _turns((PROMPT, False), ([21, 2], True), ref=True),
    )
    assert prefix_groups([r1, r2]) == [PrefixGroup(len(PROMPT) - 1, [0, 1])]


def test_collate_shared_rows_are_whole_samples_from_the_prefix_on() -> None:
    """Each row is its sample from token p on, with the loss arrays ``collate`` gives the
    whole sample from position p on; prefixes are left-padded, one per group; the masks
    cover [prefix ; row] and positions go on from each prefix; the loss denominators are
    the whole samples'."""
    samples = _grpo()
    groups = prefix_groups(samples)
    mb = collate_shared(samples, groups, pad_id=0)
    assert mb.indices == [0, 2, 5, 1, 4]
    pre = mb.prefix
    assert pre is not None and pre.lengths == [5, 4]
    assert pre.input_ids.tolist() == [PROMPT[:5], [0, *OTHER[:4]]]
    assert pre.attention_mask.tolist() == [[1] * 5, [0, 1, 1, 1, 1]]
    assert pre.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 0, 1, 2, 3]]
    assert pre.rows.tolist() == [0, 0, 0, 1, 1]
    width = mb.input_ids.shape[1]
    assert width == max(
        len(samples[i]) - p for i, p in zip(mb.indices, [5, 5, 5, 4, 4], strict=True)
    )
    for k, (i, p) in enumerate(zip(mb.indices, [5, 5, 5, 4, 4], strict=True)):
        whole = collate(samples, [i])
        n = len(samples[i]) - p
        assert mb.lengths[k] == n
        assert mb.input_ids[k, :n].tolist() == whole.input_ids[0, p:].tolist()
        assert not mb.input_ids[k, n:].any()
        for name in vars(mb.loss):
            got, want = getattr(mb.loss, name)[k], getattr(whole.loss, name)[0, p:]
            assert torch.equal(got[: n - 1], want), name
        assert pre.row_attention_mask[k].tolist() == (
            pre.attention_mask[pre.rows[k]].tolist() + [1] * n + [0] * (width - n)
        )
        # Real tokens go on from the prefix; pads stay at its end, never past the sample.
        assert pre.row_position_ids[k].tolist() == [*range(p, p + n), *[p] * (width - n)]
        assert max(pre.row_position_ids[k].tolist()) < len(samples[i])
    assert mb.num_tokens == 5 + 4 + sum(mb.lengths)
    plain = [collate(samples, mb.indices).loss]
    for phase, normalize in (("rl", "tokens"), ("rl", "sequences"), ("sft", "tokens")):
        assert loss_denominators([mb.loss], phase, normalize) == loss_denominators(
            plain, phase, normalize
        )


def test_collate_batch_shares_groups_and_trains_the_rest_as_before() -> None:
    """Groups go to shared micro-batches, every other sample to ``pack`` and ``collate``'s;
    a batch without groups, or ``share=False``, is exactly ``pack`` and ``collate``."""
    samples = _grpo()
    mbs = collate_batch(samples, seq_len=64, share=True)
    assert [mb.indices for mb in mbs] == [[0, 2, 5, 1, 4], [3]]
    assert mbs[0].prefix is not None and mbs[1].prefix is None
    lengths = [len(s) for s in samples]
    for share, batch in ((False, samples), (True, [samples[i] for i in (0, 1, 3)])):
        got = collate_batch(batch, seq_len=24, max_rows=2, share=share)
        bins = pack([len(s) for s in batch], 24, 2)
        assert [mb.indices for mb in got] == bins
        for mb, bin_ in zip(got, bins, strict=True):
            want = collate(batch, bin_)
            assert mb.prefix is None and torch.equal(mb.input_ids, want.input_ids)
            assert all(torch.equal(getattr(mb.loss, k), v) for k, v in vars(want.loss).items())
    assert (
        sum(lengths)
        == sum(mb.num_tokens for mb in collate_batch(samples, 64))
        > sum(mb.num_tokens for mb in mbs)
    )


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(1, 40), st.lists(st.integers(1, 30), min_size=2, max_size=12)),
        max_size=8,
    ),
    st.integers(min_value=1, max_value=400),
    st.one_of(st.none(), st.integers(min_value=1, max_value=8)),
)
def test_pack_groups_bounds_and_coverage(
    spec: list[tuple[int, list[int]]], seq_len: int, max_rows: int | None
) -> None:
    """Rows, padded as whole samples, stay within seq_len, rows within max_rows; every
    part shares its prefix among 2+ members; a member is in one part at most, and left
    out (to train alone) when it is too wide to share a part with a shorter one, or is
    the last of its group; the same input packs the same."""
    lengths: list[int] = []
    groups = []
    for p, rests in spec:
        groups.append(PrefixGroup(p, list(range(len(lengths), len(lengths) + len(rests)))))
        lengths += [p + r for r in rests]
    bins = pack_groups(groups, lengths, seq_len, max_rows)
    assert bins == pack_groups(groups, lengths, seq_len, max_rows)
    placed = [i for b in bins for g in b for i in g.members]
    assert len(placed) == len(set(placed))
    for b in bins:
        rows = sum(len(g.members) for g in b)
        assert rows * max(lengths[i] for g in b for i in g.members) <= seq_len  # as whole rows
        assert max_rows is None or rows <= max_rows
        assert all(len(g.members) >= 2 and g.members == sorted(g.members) for g in b)
    for g in groups:  # left out: too wide to pair with a shorter member, but for one at most
        out = [i for i in g.members if i not in placed]
        pairable = [i for i in out if 2 * lengths[i] <= seq_len]
        assert len(pairable) <= (1 if max_rows is None or max_rows >= 2 else len(out))
