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
    for k, (r, n) in enumerate(zip(rows, lengths, strict=True)):
        for name in ("mask", "logprobs", "temperatures", "advantages"):
            if len(r[name]) != n:
                raise ValueError(
                    f"sample {samples[indices[k]].rollout_id}: {name} has {len(r[name])} "
                    f"entries for {n} tokens"
                )
        ids[k, :n] = r["token_ids"]
        if n < 2:
            continue
        mask[k, : n - 1] = r["mask"][1:]
        if "sft_mask" in r:
            sft[k, : n - 1] = r["sft_mask"][1:]
        lp[k, : n - 1] = r["logprobs"][1:]
        temps[k, : n - 1] = r["temperatures"][1:]
        adv[k, : n - 1] = r["advantages"][1:]
    input_ids = torch.from_numpy(ids)
    loss = LossBatch(
        targets=input_ids[:, 1:].clone(),
        mask=torch.from_numpy(mask),
        sft_mask=torch.from_numpy(sft),
        inference_logprobs=torch.from_numpy(lp),
        temperatures=torch.from_numpy(temps),
        advantages=torch.from_numpy(adv),
    )
    return MicroBatch(list(indices), input_ids, loss, lengths)
