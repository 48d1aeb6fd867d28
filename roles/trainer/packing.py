"""Packing a batch's samples into padded micro-batches, and turning them into tensors.

``pack`` is deterministic first-fit-decreasing: samples sorted by length (longest
first, ties by their index in the batch), each put into the first micro-batch whose
padded size ``rows x longest row`` stays within ``seq_len`` tokens (and under
``max_rows`` rows when set), else into a new one. Because rows arrive longest first,
a micro-batch's longest row is its first. A sample longer than ``seq_len`` gets a
micro-batch of its own (it is never truncated: truncating would train on a different
sequence than the one that was sampled).

``collate`` builds right-padded ``input_ids [B, L]`` and the aligned ``LossBatch``
``[B, L-1]``: position ``t`` of the loss batch is token ``t+1`` of the sample, predicted
by the logits at ``t``. The first token of a sample is never trained. Right padding
needs no attention mask in a causal model: real tokens never attend to later pads.
The loss channels' arrays (``roles.trainer.loss``) default to "not in the channel":
``ce_weights`` is the sample's own array, else 1 on its ``sft_mask`` positions, else 0;
``ref_logprobs`` and ``ref_weights`` are 0 where the sample has none (a sample with
``ref_weights`` but no ``ref_logprobs`` is an error: it has nothing to be pulled toward).
Every per-token array must have one entry per token.

Shared prefixes (``trainer.shared_prefix``). A GRPO batch holds groups of completions of
one prompt, and a row of each recomputes the same prompt. Let ``f`` be a sample's first
token that any loss channel may train (``first_trained``: a token of ``mask``,
``sft_mask``, ``ce_weights > 0`` or ``ref_weights > 0``, in either phase). Its tokens
``[:f-1]`` carry no loss and only feed later tokens' keys and values; the last token
before ``f`` stays with the rest, since its logits predict ``f``. Samples whose tokens
``[:p]``, ``p = f-1 >= 1``, are the same form a ``PrefixGroup`` (``prefix_groups``),
which ``pack_groups`` packs first-fit-decreasing like ``pack``: a micro-batch of groups
runs ``groups x longest prefix`` prefix tokens and ``rows x longest rest`` row tokens,
and is bounded as its rows would be whole (``rows x longest sample`` within ``seq_len``:
every row keeps its prefix's keys and values for the backward), with at most
``max_rows`` rows (samples). A group too big for one micro-batch is split into parts that fit
(members longest rest first, ties by index), each with its own copy of the prefix; a
part of one member shares nothing and trains alone, like every sample of no group.

``collate_shared`` builds such a micro-batch: its rows are the members from token
``p`` on, right-padded and aligned exactly as ``collate`` aligns whole samples (loss
position ``t`` of a row is token ``p+t+1``), and its ``SharedPrefix`` holds one
left-padded row per prefix, with the attention masks and positions the two forwards
take (``roles.trainer.core`` runs the prefixes once and hands their keys and values to
every row that continues them). The prefix tokens hold no loss position by
construction, so the rows' loss batches have exactly the positions of the whole
samples' and the loss, its denominators and every stat are those of ``collate``'s
rows (up to float rounding in the forward). Left padding keeps the distance between a
row's tokens and its prefix's what it is in the whole sample, which sliding-window
attention reads from the positions in the key sequence.

    groups = pack([len(s) for s in batch.samples], seq_len=2048)
    mbs = [collate(batch.samples, g, pad_id=0) for g in groups]
    mbs = collate_batch(batch.samples, seq_len=2048, share=True)   # with shared prefixes
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np
import torch

from roles.trainer.loss import LossBatch
from schemas import Sample


def pack(lengths: Sequence[int], seq_len: int, max_rows: int | None = None) -> list[list[int]]:
    """Indices of ``lengths`` grouped into micro-batches (first-fit decreasing)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    widths: list[int] = []  # the longest (= first) row of each bin
    for i in order:
        for b, members in enumerate(bins):
            fits = (len(members) + 1) * widths[b] <= seq_len
            if fits and (max_rows is None or len(members) < max_rows):
                members.append(i)
                break
        else:
            bins.append([i])
            widths.append(lengths[i])
    return bins


# Sample.arrays() keys with one entry per token (the optional ones checked when present).
_PER_TOKEN = (
    "mask", "logprobs", "temperatures", "advantages",
    "sft_mask", "ce_weights", "ref_logprobs", "ref_weights",
)  # fmt: skip
# The per-token arrays that can put a token into a loss channel in some phase
# (``roles.trainer.loss.positions``): rl on ``mask``, ce on ``sft_mask`` (and in the sft
# phase on ``mask``), ref on ``ref_weights > 0``; a ``ce_weights`` entry counts too.
_TRAINED = ("mask", "sft_mask", "ce_weights", "ref_weights")


def first_trained(arrays: Mapping[str, np.ndarray]) -> int | None:
    """The first token of a sample (``Sample.arrays()``) that a loss channel may train,
    or None; never token 0, which nothing predicts."""
    firsts = [np.flatnonzero(arrays[name][1:] > 0) for name in _TRAINED if name in arrays]
    return min((int(f[0]) + 1 for f in firsts if len(f)), default=None)


@dataclass(frozen=True)
class PrefixGroup:
    """Samples of a batch (``members``: indices, in batch order) whose first ``length``
    tokens are the same and train nothing."""

    length: int
    members: list[int]


def prefix_groups(samples: Sequence[Sample]) -> list[PrefixGroup]:
    """The groups of two or more samples that share a prefix (see the module docstring),
    in the order of their first members."""
    found: dict[tuple[int, ...], list[int]] = {}
    for i, sample in enumerate(samples):
        r = sample.arrays()
        f = first_trained(r)
        if f is not None and f >= 2:
            found.setdefault(tuple(r["token_ids"][: f - 1].tolist()), []).append(i)
    return [PrefixGroup(len(key), members) for key, members in found.items() if len(members) > 1]


def _padded(groups: Sequence[PrefixGroup], lengths: Sequence[int]) -> int:
    """The bound ``seq_len`` keeps on a micro-batch of ``groups``: its rows as whole rows,
    padded (rows x its longest sample), as ``pack`` bounds whole samples. Each row keeps
    its prefix's keys and values for the backward, so memory grows with whole rows even
    though the prefix is computed once; counting a prefix once would let a long prompt
    pack many times the rows and keys and values ``seq_len`` was sized for."""
    return sum(len(g.members) for g in groups) * max(lengths[i] for g in groups for i in g.members)


def pack_groups(
    groups: Sequence[PrefixGroup],
    lengths: Sequence[int],
    seq_len: int,
    max_rows: int | None = None,
) -> list[list[PrefixGroup]]:
    """``groups`` (or parts of them) packed into micro-batches, first-fit decreasing by
    padded tokens (ties by first member). A member that fits no part with another one
    is left out: it trains alone (see the module docstring)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")

    def fits(bin_: Sequence[PrefixGroup]) -> bool:
        rows = sum(len(g.members) for g in bin_)
        return _padded(bin_, lengths) <= seq_len and (max_rows is None or rows <= max_rows)

    parts: list[PrefixGroup] = []
    for g in groups:
        chunks: list[list[int]] = []
        for i in sorted(g.members, key=lambda i: (-lengths[i], i)):
            if chunks and fits([PrefixGroup(g.length, [*chunks[-1], i])]):
                chunks[-1].append(i)
            else:
                chunks.append([i])
        parts += [PrefixGroup(g.length, sorted(c)) for c in chunks if len(c) > 1]
    order = sorted(parts, key=lambda g: (-_padded([g], lengths), g.members[0]))
    bins: list[list[PrefixGroup]] = []
    for g in order:
        for members in bins:
            if fits([*members, g]):
                members.append(g)
                break
        else:
            bins.append([g])
    return bins


@dataclass
class SharedPrefix:
    """The prefixes a shared micro-batch's rows continue (``collate_shared``): one
    forward over ``input_ids`` gives their keys and values, which row ``k`` reads from
    prefix ``rows[k]``; then the rows' forward, with ``row_attention_mask`` over
    [prefix ; row] and ``row_position_ids`` going on from each row's prefix."""

    input_ids: torch.Tensor  # int64 [G, P]: one row per prefix, left-padded
    attention_mask: torch.Tensor  # int64 [G, P]: 1 on the prefix's tokens
    position_ids: torch.Tensor  # int64 [G, P]: 0.. on the prefix's tokens (0 on pads)
    lengths: list[int]  # tokens of each prefix
    rows: torch.Tensor  # int64 [B]: the prefix each row continues
    row_attention_mask: torch.Tensor  # int64 [B, P + L]
    row_position_ids: torch.Tensor  # int64 [B, L]

    def to(self, device: str | torch.device) -> SharedPrefix:
        """Its tensors on ``device``."""
        return SharedPrefix(**{f.name: _to(getattr(self, f.name), device) for f in fields(self)})


def _to(value: Any, device: str | torch.device) -> Any:
    return value.to(device) if isinstance(value, torch.Tensor) else value


@dataclass
class MicroBatch:
    indices: list[int]  # positions of its samples in the batch
    # int64 [B, L], right-padded: whole samples, or (with ``prefix``) what follows each prefix
    input_ids: torch.Tensor
    loss: LossBatch  # aligned [B, L-1]
    lengths: list[int]  # real tokens of each row
    prefix: SharedPrefix | None = None  # the prefixes its rows continue (collate_shared)

    @property
    def num_tokens(self) -> int:
        """Tokens the model runs (padding aside): the rows', and each shared prefix once."""
        return sum(self.lengths) + (sum(self.prefix.lengths) if self.prefix else 0)

    def to(self, device: str | torch.device) -> MicroBatch:
        """Its tensors on ``device``."""
        prefix = self.prefix.to(device) if self.prefix is not None else None
        return replace(
            self, input_ids=self.input_ids.to(device), loss=self.loss.to(device), prefix=prefix
        )


def collate(samples: Sequence[Sample], indices: Sequence[int], pad_id: int = 0) -> MicroBatch:
    """Right-padded tensors of ``samples[i] for i in indices`` (see the module docstring)."""
    return _rows(samples, indices, [0] * len(indices), pad_id)


def collate_shared(
    samples: Sequence[Sample], groups: Sequence[PrefixGroup], pad_id: int = 0
) -> MicroBatch:
    """One micro-batch of prefix groups: each group's prefix once, and its members from
    the prefix's end on (see the module docstring)."""
    indices = [i for g in groups for i in g.members]
    mb = _rows(samples, indices, [g.length for g in groups for _ in g.members], pad_id)
    lengths = np.array([g.length for g in groups], dtype=np.int64)
    width = int(lengths.max())
    ids = np.full((len(groups), width), pad_id, dtype=np.int64)
    for k, g in enumerate(groups):
        ids[k, width - g.length :] = samples[g.members[0]].arrays()["token_ids"][: g.length]
    # Position of each prefix slot in its own prefix: negative on the left pads.
    at = np.arange(width) - (width - lengths[:, None])
    rows = np.repeat(np.arange(len(groups), dtype=np.int64), [len(g.members) for g in groups])
    row_width = mb.input_ids.shape[1]
    row_real = np.arange(row_width) < np.array(mb.lengths)[:, None]
    return replace(
        mb,
        prefix=SharedPrefix(
            input_ids=torch.from_numpy(ids),
            attention_mask=torch.from_numpy((at >= 0).astype(np.int64)),
            position_ids=torch.from_numpy(np.maximum(at, 0)),
            lengths=lengths.tolist(),
            rows=torch.from_numpy(rows),
            row_attention_mask=torch.from_numpy(
                np.concatenate([at[rows] >= 0, row_real], axis=1).astype(np.int64)
            ),
            # A pad slot sits at its row's prefix end, not past the row: a row of a long
            # prefix beside a long rest would otherwise give its pads positions no
            # sample reaches (out of range for learned positions; dynamic RoPE scalings
            # read the largest position id).
            row_position_ids=torch.from_numpy(
                lengths[rows][:, None] + np.where(row_real, np.arange(row_width), 0)
            ),
        ),
    )


def collate_batch(
    samples: Sequence[Sample],
    seq_len: int,
    max_rows: int | None = None,
    pad_id: int = 0,
    share: bool = False,
) -> list[MicroBatch]:
    """All of ``samples`` in micro-batches: with ``share``, the prefix groups first
    (``pack_groups``, ``collate_shared``), then every other sample as ``pack`` and
    ``collate`` put it (without groups, exactly as they put the whole batch)."""
    lengths = [len(s) for s in samples]
    shared = pack_groups(prefix_groups(samples), lengths, seq_len, max_rows) if share else []
    grouped = {i for bin_ in shared for g in bin_ for i in g.members}
    alone = [i for i in range(len(samples)) if i not in grouped]
    plain = pack([lengths[i] for i in alone], seq_len, max_rows)
    return [collate_shared(samples, bin_, pad_id) for bin_ in shared] + [
        collate(samples, [alone[k] for k in bin_], pad_id) for bin_ in plain
    ]


def _rows(
    samples: Sequence[Sample], indices: Sequence[int], starts: Sequence[int], pad_id: int
) -> MicroBatch:
    """Right-padded rows: row ``k`` is ``samples[indices[k]]`` from token ``starts[k]`` on,
    with its loss arrays aligned to it (loss position ``t``: token ``starts[k] + t + 1``)."""
    rows = [samples[i].arrays() for i in indices]
    lengths = [len(r["token_ids"]) - s for r, s in zip(rows, starts, strict=True)]
    width = max(lengths, default=0)
    b, t = len(rows), max(width - 1, 0)
    ids = np.full((b, width), pad_id, dtype=np.int64)
    mask = np.zeros((b, t), dtype=bool)
    sft = np.zeros((b, t), dtype=bool)
    lp = np.zeros((b, t), dtype=np.float32)
    temps = np.ones((b, t), dtype=np.float32)
    adv = np.zeros((b, t), dtype=np.float32)
    ce_w = np.zeros((b, t), dtype=np.float32)
    ref_lp = np.zeros((b, t), dtype=np.float32)
    ref_w = np.zeros((b, t), dtype=np.float32)
    for k, (r, n, s) in enumerate(zip(rows, lengths, starts, strict=True)):
        rollout_id = samples[indices[k]].rollout_id
        for name in _PER_TOKEN:
            if name in r and len(r[name]) != n + s:
                raise ValueError(
                    f"sample {rollout_id}: {name} has {len(r[name])} entries for {n + s} tokens"
                )
        if "ref_weights" in r and "ref_logprobs" not in r and bool((r["ref_weights"] > 0).any()):
            raise ValueError(f"sample {rollout_id}: ref_weights without ref_logprobs")
        ids[k, :n] = r["token_ids"][s:]
        if n < 2:
            continue
        at = slice(s + 1, None)  # the tokens this row's loss positions predict
        mask[k, : n - 1] = r["mask"][at]
        if "sft_mask" in r:
            sft[k, : n - 1] = r["sft_mask"][at]
        lp[k, : n - 1] = r["logprobs"][at]
        temps[k, : n - 1] = r["temperatures"][at]
        adv[k, : n - 1] = r["advantages"][at]
        if "ce_weights" in r:
            ce_w[k, : n - 1] = r["ce_weights"][at]
        elif "sft_mask" in r:
            ce_w[k, : n - 1] = r["sft_mask"][at]  # no weights: 1 on every ce position
        if "ref_logprobs" in r:
            ref_lp[k, : n - 1] = r["ref_logprobs"][at]
        if "ref_weights" in r:
            ref_w[k, : n - 1] = r["ref_weights"][at]
    input_ids = torch.from_numpy(ids)
    loss = LossBatch(
        targets=input_ids[:, 1:].clone(),
        mask=torch.from_numpy(mask),
        sft_mask=torch.from_numpy(sft),
        inference_logprobs=torch.from_numpy(lp),
        temperatures=torch.from_numpy(temps),
        advantages=torch.from_numpy(adv),
        ce_weights=torch.from_numpy(ce_w),
        ref_logprobs=torch.from_numpy(ref_lp),
        ref_weights=torch.from_numpy(ref_w),
    )
    return MicroBatch(list(indices), input_ids, loss, lengths)
