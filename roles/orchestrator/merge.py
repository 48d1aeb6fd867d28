"""Merging the samples several algorithms scored from the same branch into one.

When an env trains on more than one algorithm, every algorithm's ``SamplesScored`` for
a group arrives separately; the orchestrator trains each branch once, on one merged
``Sample`` whose channels combine theirs (``docs/algorithms.md``, "Several algorithms"):

- ``rl``: positions are the union; advantages add (each algorithm's is 0 off its own
  positions), so the policy-gradient terms add up as separate losses would;
- ``ce``: positions are the union; per token the largest weight wins (so a rule every
  worker applies, like the env's tool-output SFT, counts once);
- ``ref_kl``: coefficients add and the target is their weighted mean of the reference
  logprobs: sum_i b_i (lp - ref_i) = (sum_i b_i) (lp - ref_bar), the same gradient as
  the separate terms.

Pure and order-free: the events are taken in algorithm-id order.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from schemas import Sample, SamplesScored, arrays


def ce_weights(s: Sample) -> np.ndarray | None:
    """The ce weight of each token (None: no ce channel); weight 1 on ``sft_mask`` when
    the sample predates per-token weights."""
    if s.ce_weights is not None:
        return arrays.f32(s.ce_weights)
    if s.sft_mask is not None:
        return arrays.mask(s.sft_mask).astype(arrays.F32)
    return None


def merge_two(a: Sample, b: Sample) -> Sample:
    """One sample carrying the channels of ``a`` and ``b`` (the same branch)."""
    if a.token_ids != b.token_ids:
        raise ValueError(f"cannot merge samples of different tokens ({a.rollout_id}/{a.branch})")
    mask = arrays.mask(a.mask) | arrays.mask(b.mask)
    adv = arrays.f32(a.advantages) + arrays.f32(b.advantages)
    ce_a, ce_b = ce_weights(a), ce_weights(b)
    ce = ce_a if ce_b is None else ce_b if ce_a is None else np.maximum(ce_a, ce_b)
    ref_w = ref_lp = None
    refs = [(arrays.f32(s.ref_weights), arrays.f32(s.ref_logprobs)) for s in (a, b)
            if s.ref_weights is not None and s.ref_logprobs is not None]  # fmt: skip
    if refs:
        ref_w = np.sum([w for w, _ in refs], axis=0, dtype=arrays.F32)
        weighted = sum(w * lp for w, lp in refs)
        ref_lp = np.where(ref_w > 0, weighted / np.where(ref_w > 0, ref_w, 1), 0).astype(arrays.F32)
    return msgspec.structs.replace(
        a,
        mask=arrays.pack_mask(mask),
        advantages=adv.astype(arrays.F32).tobytes(),
        sft_mask=None if ce is None else arrays.pack_mask(ce != 0),
        ce_weights=None if ce is None else ce.astype(arrays.F32).tobytes(),
        ref_weights=None if ref_w is None else ref_w.tobytes(),
        ref_logprobs=None if ref_lp is None else ref_lp.tobytes(),
        algorithms=[*a.algorithms, *b.algorithms],
    )


def merge_scored(events: Sequence[SamplesScored]) -> list[Sample]:
    """The merged samples of one group, one per (rollout, branch), in the first event's order."""
    ordered = sorted(events, key=lambda e: e.algorithm)
    if len(ordered) == 1:
        return list(ordered[0].samples)
    merged: dict[tuple[str, int], Sample] = {}
    for event in ordered:
        for s in event.samples:
            key = (s.rollout_id, s.branch)
            merged[key] = merge_two(merged[key], s) if key in merged else s
    return list(merged.values())
