"""The pure core of an algorithm worker: groups of traces in, one ``SamplesScored`` out.

    buffer = GroupBuffer()
    for event in trace_completed_events:          # any order, redeliveries included
        if (group := buffer.add(event)) is not None:
            scored = score_group("grpo", create("grpo"), group, state=None)
            buffer.mark_scored(scored.group_id)

- ``branch_views``: each branch of a trace as flat arrays. ``trainable`` = the actor's
  sampled tokens, except that a message shared by several branches (a common prefix)
  is trained once, in the first branch containing it; in a multi-agent trace a branch
  with a ``member`` trains only that member's messages. A masked message (a reply that
  did not parse: ``Message.masked``, ``Trace.turn_errors``) never trains: it is not
  trainable, and ``build_sample`` zeroes every channel on its tokens, whatever the
  algorithm returned for them; the rest of the trace trains.
- ``env_token_masks``: the content tokens of environment messages (tool outputs,
  optionally user feedback) after the first sampled response, per branch: what
  ``echo`` and the per-env ``sft.on_tool_outputs`` train by cross-entropy. Only the
  recorded ``Message.content_span`` counts, never the chat-template scaffolding.
- ``score_group``: errored traces are left out of the baseline and of training and
  only counted (``excluded``, and the members they would have trained:
  ``excluded_members``, which ``rae`` folds at reward 0). Filtered traces
  (``Trace.is_filtered``: an enforcing rollout filter flagged them) are real rollouts:
  the algorithm sees them and their rewards are in ``rewards`` and in the group's
  baseline, but none of their samples is kept. The group is sorted by ``sample_index``
  first so the result never depends on arrival order. The algorithm's ``Targets``
  become one flat ``Sample`` per branch, carrying its channels (``schemas/training.py``).
- ``GroupBuffer``: the pending-group fold (dedup by rollout id, skip scored groups).

Nothing here reads the clock, the RNG or the network: replay calls the same functions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from roles.algorithm.base import Algorithm, BranchView, Refs, Targets
from schemas import Branch, Sample, SamplesScored, Trace, TraceCompleted, arrays, derive_id


def branch_reward(trace: Trace, branch: Branch) -> float:
    """A branch's own reward, else its member's, else (an env that rewards no member on
    its own: a shared reward) the trace's. A member missing from a trace's member
    rewards is an error, never a fallback."""
    if branch.reward is not None:
        return float(branch.reward)
    if branch.member is not None and trace.member_rewards:
        if branch.member not in trace.member_rewards:
            raise ValueError(
                f"trace {trace.rollout_id} has member rewards for "
                f"{sorted(trace.member_rewards)} but not for {branch.member!r}"
            )
        return float(trace.member_rewards[branch.member])
    return float(trace.reward)


def branch_masks(trace: Trace) -> list[np.ndarray]:
    """The trainable mask of each branch: sampled tokens, shared messages counted once."""
    by_id = {m.id: m for m in trace.messages}
    seen: set[int] = set()
    masks = []
    for branch in trace.branches:
        parts = []
        for mid in branch.messages:
            m = by_id[mid]
            sampled = arrays.mask(m.sampled)
            mine = branch.member is None or m.member == branch.member
            trains = mine and mid not in seen and not m.masked
            parts.append(sampled if trains else np.zeros_like(sampled))
            if mine:
                seen.add(mid)
        masks.append(np.concatenate(parts) if parts else np.zeros(0, bool))
    return masks


def masked_tokens(trace: Trace, branch: Branch) -> np.ndarray:
    """Per token of ``branch``: True on the tokens of masked messages (never trained)."""
    by_id = {m.id: m for m in trace.messages}
    parts = [np.full(len(by_id[i].token_ids) // 4, by_id[i].masked) for i in branch.messages]
    return np.concatenate(parts) if parts else np.zeros(0, bool)


def branch_views(trace: Trace) -> list[BranchView]:
    """Every branch of ``trace`` as aligned flat arrays (lengths checked)."""
    views = []
    for index, (branch, mask) in enumerate(zip(trace.branches, branch_masks(trace), strict=True)):
        ids, _sampled, logprobs, temps = trace.branch_tokens(branch)
        if not (len(ids) == len(logprobs) == len(temps) == len(mask)):
            raise ValueError(
                f"trace {trace.rollout_id} branch {index}: per-token arrays disagree in length "
                f"(ids {len(ids)}, logprobs {len(logprobs)}, mask {len(mask)})"
            )
        views.append(
            BranchView(
                trace, index, branch, ids, mask, logprobs, temps, branch_reward(trace, branch)
            )
        )
    return views


def env_token_masks(
    trace: Trace, roles: Collection[str] = ("tool",), names: Collection[str] | None = None
) -> list[np.ndarray]:
    """Per branch: content tokens of env messages with a role in ``roles`` (tool
    messages only when ``names`` is None or their name is in it) that come after the
    branch's first sampled response. A message shared by branches is marked in the
    first one only. A tool message's name is its own, else its call's (the join on
    ``tool_call_id``; the harness records it resolved, older traces may not)."""
    by_id = {m.id: m for m in trace.messages}
    call_names = {c.id: c.name for m in trace.messages for c in m.tool_calls}
    seen: set[int] = set()
    masks = []
    for branch in trace.branches:
        parts = []
        responded = False
        for mid in branch.messages:
            m = by_id[mid]
            part = np.zeros(len(m.token_ids) // 4, bool)
            # the name allow-list is about tools: user feedback has no tool name
            name = m.name if m.name is not None else call_names.get(m.tool_call_id or "")
            wanted = m.role in roles and (m.role != "tool" or names is None or name in names)
            if responded and wanted and m.content_span is not None and mid not in seen:
                start, end = m.content_span
                part[start:end] = True
                seen.add(mid)
            responded = responded or (m.role == "assistant" and bool(arrays.mask(m.sampled).any()))
            parts.append(part)
        masks.append(np.concatenate(parts) if parts else np.zeros(0, bool))
    return masks


@dataclass(frozen=True)
class ToolSft:
    """The per-env ``[orchestrator.train.env.sft]`` rule, applied by every worker."""

    alpha: float
    tool_names: tuple[str, ...] | None = None


def _per_token(value: float | np.ndarray, view: BranchView, what: str) -> np.ndarray:
    """A scalar broadcast over the trainable tokens, or a per-token array checked."""
    if isinstance(value, (int, float, np.number)):
        return np.where(view.trainable, np.float32(value), np.float32(0.0)).astype(arrays.F32)
    out = np.asarray(value, dtype=arrays.F32)
    if out.shape != (len(view),):
        raise ValueError(f"{what} has shape {out.shape}; branch has {len(view)} tokens")
    return out


def build_sample(view: BranchView, t: Targets, algorithm_id: str) -> Sample:
    """The flat ``Sample`` of one branch carrying the channels of ``t``."""
    trace = view.trace
    n = len(view)
    if t.advantages is not None:
        rl_mask = view.trainable  # rl trains the actor's own tokens only (it needs their logprobs)
        adv = np.where(rl_mask, _per_token(t.advantages, view, "advantages"), 0).astype(arrays.F32)
    else:
        rl_mask, adv = np.zeros(n, bool), np.zeros(n, arrays.F32)
    ce = None if t.ce is None else _per_token(t.ce, view, "ce weights")
    ref_w = ref_lp = None
    if t.ref_weights is not None:
        if t.ref_logprobs is None:
            raise ValueError(f"algorithm {algorithm_id!r}: ref_weights without ref_logprobs")
        ref_w = _per_token(t.ref_weights, view, "ref_weights")
        ref_lp = _per_token(t.ref_logprobs, view, "ref_logprobs")
    values = [adv, ce, ref_w]
    for v in values:
        if v is not None and not np.all(np.isfinite(v)):
            raise ValueError(f"algorithm {algorithm_id!r} returned a non-finite weight")
    if any(m.masked for m in trace.messages):  # a masked reply trains on no channel
        keep = ~masked_tokens(trace, view.branch)
        adv, rl_mask = adv * keep, rl_mask & keep
        ce = None if ce is None else ce * keep
        ref_w = None if ref_w is None else ref_w * keep
    return Sample(
        rollout_id=trace.rollout_id,
        branch=view.index,
        env=trace.env,
        task_index=trace.task.index,
        group_id=trace.group_id,
        token_ids=arrays.pack_i32(view.token_ids),
        mask=arrays.pack_mask(rl_mask),
        logprobs=arrays.pack_f32(view.logprobs),
        temperatures=arrays.pack_f32(view.temperatures),
        advantages=adv.tobytes(),
        sft_mask=None if ce is None else arrays.pack_mask(ce != 0),
        ce_weights=None if ce is None else ce.tobytes(),
        ref_weights=None if ref_w is None else ref_w.tobytes(),
        ref_logprobs=None if ref_lp is None else ref_lp.tobytes(),
        reward=view.reward,
        policy_min=trace.policy_min,
        policy_max=trace.policy_max,
        from_policy=trace.from_policy,
        member=view.member,
        algorithms=[algorithm_id],
    )


def has_signal(sample: Sample) -> bool:
    """True when some channel of ``sample`` has a non-zero weight."""
    return any(
        b is not None and bool(np.any(arrays.f32(b) != 0))
        for b in (sample.advantages, sample.ce_weights, sample.ref_weights)
    )


def trace_samples(trace: Trace, advantage: float, channel: str = "rl") -> list[Sample]:
    """One ``Sample`` per branch of ``trace`` with ``advantage`` on its trainable tokens
    (``channel="ce"``: as cross-entropy weight instead)."""
    views = branch_views(trace)
    if channel == "ce":
        return [build_sample(v, Targets(ce=v.trainable * advantage), "") for v in views]
    return [build_sample(v, Targets(advantages=advantage), "") for v in views]


def group_order(event: TraceCompleted) -> tuple[int, str]:
    return event.trace.sample_index, event.trace.rollout_id


def score_group(
    algorithm_id: str,
    algorithm: Algorithm,
    group: Sequence[TraceCompleted],
    state: Any = None,
    refs: Refs | None = None,
    tool_sft: ToolSft | None = None,
) -> SamplesScored:
    """The one ``SamplesScored`` of a complete group (event id derived from the group).

    ``refs`` are the logprobs the algorithm's ``score_spec`` asked for; ``tool_sft``
    adds the env's tool-output cross-entropy (the larger weight wins per token).
    """
    if not group:
        raise ValueError("score_group needs at least one trace")
    events = sorted(group, key=group_order)
    first = events[0]
    ok = [e.trace for e in events if e.trace.ok]
    views = [branch_views(t) for t in ok]
    targets = algorithm.targets(ok, views, state, refs or {}) if ok else []
    if len(targets) != len(ok) or any(
        len(t) != len(v) for t, v in zip(targets, views, strict=False)
    ):
        raise ValueError(
            f"algorithm {algorithm_id!r} returned targets for {len(targets)} traces "
            f"for {len(ok)} traces of group {first.trace.group_id} (one per branch each)"
        )
    samples = []
    for trace, trace_views, trace_targets in zip(ok, views, targets, strict=True):
        if trace.is_filtered:  # in the baseline above, never in a batch
            continue
        tool = (
            env_token_masks(trace, ("tool",), tool_sft.tool_names) if tool_sft is not None else None
        )
        for view, t in zip(trace_views, trace_targets, strict=True):
            if tool is not None and tool_sft is not None and tool[view.index].any():
                extra = tool[view.index].astype(arrays.F32) * np.float32(tool_sft.alpha)
                ce = extra if t.ce is None else np.maximum(_per_token(t.ce, view, "ce"), extra)
                t = Targets(t.advantages, ce, t.ref_weights, t.ref_logprobs)
            samples.append(build_sample(view, t, algorithm_id))
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
        filtered=sum(t.is_filtered for t in ok),
        filtered_by=dict(
            sorted(Counter(f.name for t in ok for f in t.filters if f.enforced).items())
        ),
        excluded_members=[
            b.member for e in events if not e.trace.ok for b in e.trace.branches if b.member
        ],
        excluded_errors=error_counts(e.trace for e in events),
        zero_advantage=not any(has_signal(s) for s in samples),
    )


def error_counts(traces: Iterable[Trace]) -> dict[str, int]:
    """Each errored trace's first error as ``<kind>: <first line of its message>`` (cut
    to 200 characters), counted: ``SamplesScored.excluded_errors``."""
    out: dict[str, int] = {}
    for t in traces:
        if t.errors:
            e = t.errors[0]
            line = f"{e.kind}: {(e.message.strip().splitlines() or [''])[0]}"[:200]
            out[line] = out.get(line, 0) + 1
    return out


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
