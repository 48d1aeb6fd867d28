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

    groups = pack([len(s) for s in batch.samples], seq_len=2048)
    mbs = [collate(batch.samples, g, pad_id=0) for g in groups]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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


@dataclass
class MicroBatch:
    indices: list[int]  # positions of its samples in the batch
    input_ids: torch.Tensor  # int64 [B, L], right-padded
    loss: LossBatch  # aligned [B, L-1]
    lengths: list[int]  # real tokens of each row

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def collate(samples: Sequence[Sample], indices: Sequence[int], pad_id: int = 0) -> MicroBatch:
    """Right-padded tensors of ``samples[i] for i in indices`` (see the module docstring)."""
    rows = [samples[i].arrays() for i in indices]
    lengths = [len(r["token_ids"]) for r in rows]
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
    for k, (r, n) in enumerate(zip(rows, lengths, strict=True)):
        rollout_id = samples[indices[k]].rollout_id
        for name in _PER_TOKEN:
            if name in r and len(r[name]) != n:
                raise ValueError(
                    f"sample {rollout_id}: {name} has {len(r[name])} entries for {n} tokens"
                )
        if "ref_weights" in r and "ref_logprobs" not in r and bool((r["ref_weights"] > 0).any()):
            raise ValueError(f"sample {rollout_id}: ref_weights without ref_logprobs")
        ids[k, :n] = r["token_ids"]
        if n < 2:
            continue
        mask[k, : n - 1] = r["mask"][1:]
        if "sft_mask" in r:
            sft[k, : n - 1] = r["sft_mask"][1:]
        lp[k, : n - 1] = r["logprobs"][1:]
        temps[k, : n - 1] = r["temperatures"][1:]
        adv[k, : n - 1] = r["advantages"][1:]
        if "ce_weights" in r:
            ce_w[k, : n - 1] = r["ce_weights"][1:]
        elif "sft_mask" in r:
            ce_w[k, : n - 1] = r["sft_mask"][1:]  # no weights: 1 on every ce position
        if "ref_logprobs" in r:
            ref_lp[k, : n - 1] = r["ref_logprobs"][1:]
        if "ref_weights" in r:
            ref_w[k, : n - 1] = r["ref_weights"][1:]
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
