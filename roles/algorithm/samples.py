"""The pure core of an algorithm worker: groups of traces in, one ``SamplesScored`` out.

    buffer = GroupBuffer()
    for event in trace_completed_events:          # any order, redeliveries included
        if (group := buffer.add(event)) is not None:
            scored = score_group("grpo", create("grpo"), group, state=None)
            buffer.mark_scored(scored.group_id)

- ``trace_samples``: one flat ``Sample`` per branch of a trace. ``mask`` = the actor's
  sampled tokens, except that a message shared by several branches (a common prefix,
  a multi-agent turn) is trained once, in the first branch containing it; the
  trace's advantage sits on masked tokens, 0 elsewhere.
- ``score_group``: errored traces are left out of the baseline and of training and
  only counted (``excluded``); the group is sorted by ``sample_index`` first so the
  result never depends on arrival order.
- ``GroupBuffer``: the pending-group fold (dedup by rollout id, skip scored groups).

Nothing here reads the clock, the RNG or the network: replay calls the same functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from roles.algorithm.base import Algorithm
from schemas import Sample, SamplesScored, Trace, TraceCompleted, arrays, derive_id


def branch_masks(trace: Trace) -> list[np.ndarray]:
    """The trainable mask of each branch: sampled tokens, shared messages counted once."""
    by_id = {m.id: m for m in trace.messages}
    seen: set[int] = set()
    masks = []
    for branch in trace.branches:
        parts = []
        for mid in branch.messages:
            sampled = arrays.mask(by_id[mid].sampled)
            parts.append(np.zeros_like(sampled) if mid in seen else sampled)
            seen.add(mid)
        masks.append(np.concatenate(parts) if parts else np.zeros(0, bool))
    return masks


def trace_samples(trace: Trace, advantage: float, channel: str = "rl") -> list[Sample]:
    """One ``Sample`` per branch of ``trace``, with ``advantage`` on its trainable tokens.

    ``channel="ce"`` also sets ``sft_mask`` = ``mask`` (train those tokens by
    cross-entropy, as the ``sft`` algorithm asks).
    """
    out = []
    for index, (branch, mask) in enumerate(zip(trace.branches, branch_masks(trace), strict=True)):
        ids, sampled, logprobs, temps = trace.branch_tokens(branch)
        if not (len(ids) == len(sampled) == len(logprobs) == len(temps) == len(mask)):
            raise ValueError(
                f"trace {trace.rollout_id} branch {index}: per-token arrays disagree in length "
                f"(ids {len(ids)}, sampled {len(sampled)}, logprobs {len(logprobs)})"
            )
        adv = np.where(mask, np.float32(advantage), np.float32(0.0)).astype(arrays.F32)
        packed_mask = arrays.pack_mask(mask)
        out.append(
            Sample(
                rollout_id=trace.rollout_id,
                branch=index,
                env=trace.env,
                task_index=trace.task.index,
                group_id=trace.group_id,
                token_ids=arrays.pack_i32(ids),
                mask=packed_mask,
                logprobs=arrays.pack_f32(logprobs),
                temperatures=arrays.pack_f32(temps),
                advantages=adv.tobytes(),
                sft_mask=packed_mask if channel == "ce" else None,
                reward=float(trace.reward if branch.reward is None else branch.reward),
                policy_min=trace.policy_min,
                policy_max=trace.policy_max,
            )
        )
    return out


def group_order(event: TraceCompleted) -> tuple[int, str]:
    return event.trace.sample_index, event.trace.rollout_id


def score_group(
    algorithm_id: str, algorithm: Algorithm, group: Sequence[TraceCompleted], state: Any = None
) -> SamplesScored:
    """The one ``SamplesScored`` of a complete group (event id derived from the group)."""
    if not group:
        raise ValueError("score_group needs at least one trace")
    events = sorted(group, key=group_order)
    first = events[0]
    ok = [e.trace for e in events if e.trace.ok]
    advantages = [float(a) for a in algorithm.advantages(ok, state)] if ok else []
    if len(advantages) != len(ok):
        raise ValueError(
            f"algorithm {algorithm_id!r} returned {len(advantages)} advantages "
            f"for {len(ok)} traces of group {first.trace.group_id}"
        )
    if not all(math.isfinite(a) for a in advantages):
        raise ValueError(
            f"algorithm {algorithm_id!r} returned a non-finite advantage for group "
            f"{first.trace.group_id}: {advantages}"
        )
    samples = [
        s
        for t, a in zip(ok, advantages, strict=True)
        for s in trace_samples(t, a, algorithm.channel)
    ]
    signal = any(np.any(arrays.f32(s.advantages) != 0) for s in samples)
    return SamplesScored(
        run=first.run,
        event_id=derive_id("scored", algorithm_id, first.trace.group_id),
        causation_id=first.request_id,
        algorithm=algorithm_id,
        env=first.env,
        group_id=first.trace.group_id,
        request_id=first.request_id,
        task_index=first.trace.task.index,
        step=first.step,
        samples=samples,
        rewards=[float(t.reward) for t in ok],
        excluded=len(events) - len(ok),
        zero_advantage=not signal,
    )


class GroupBuffer:
    """Traces of groups not scored yet, keyed by group id then rollout id.

    ``add`` returns the group (sorted) once ``group_size`` distinct rollouts arrived and
    the group is not scored yet; it keeps returning it for every later delivery until
    ``mark_scored`` is called, so a failed publish is retried by the redelivery.
    """

    def __init__(self) -> None:
        self.pending: dict[str, dict[str, TraceCompleted]] = {}
        self.scored: set[str] = set()

    def add(self, event: TraceCompleted) -> list[TraceCompleted] | None:
        gid = event.trace.group_id
        if gid in self.scored:
            return None
        group = self.pending.setdefault(gid, {})
        group.setdefault(event.trace.rollout_id, event)  # a redelivery never counts twice
        if len(group) < event.group_size:
            return None
        return sorted(group.values(), key=group_order)

    def mark_scored(self, group_id: str) -> None:
        self.scored.add(group_id)
        self.pending.pop(group_id, None)

    def __len__(self) -> int:
        return len(self.pending)
