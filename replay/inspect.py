"""One rollout and its causation chain, backward and forward through the log.

    rlbus trace <run> <rollout-id | event-id> [--json] [--no-tokens]

``trace_chain(events, rollout_id)`` is pure: from the run's events (log order) it builds
a JSON-able description of one trace. Every event of ``TOPICS`` gives the chain (the
full scan); ``rlbus trace`` passes only the few the lake's index names
(``replay.trace_index``) and gets the same chain. What it holds:

- the trace itself: task, messages (role, content; for sampled messages, per token: id,
  text, sampled mask, logprob, and what each algorithm trains it with: ``advantage``,
  the policy-gradient weight of an algorithm whose sample has an RL channel, and
  ``sft``, the cross-entropy weight of one whose sample has an SFT channel: the warm
  start's ``sft`` algorithm, or tool outputs trained as SFT), reward(s), errors, timings;
- **backward**: the ``task.requested`` that asked for it (``request_id``) and the weights
  that sampled its tokens (each ``weights.published`` with a version in
  ``[policy_min, policy_max]``; version 0 is the run's initial weights);
- **forward**: the ``samples.scored`` of every algorithm that scored it (advantage per
  branch, and the tokens each branch trains with SFT), each ``batch.assembled`` that trained one of its samples (step, phase, which
  algorithm's samples), and the ``weights.published`` that came out of that batch.

``render_chain`` prints it with rich. A rollout id may be given by a unique prefix
(``pick_rollout``).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from bus.subjects import TOPIC_OF
from schemas import (
    BatchAssembled,
    EvalCompleted,
    RunStarted,
    SamplesScored,
    TaskRequested,
    Trace,
    TraceCompleted,
    WeightsPublished,
    arrays,
)

TYPES = (RunStarted, TaskRequested, TraceCompleted, EvalCompleted, SamplesScored,
         BatchAssembled, WeightsPublished)  # fmt: skip
TOPICS = [(TOPIC_OF[t], None) for t in TYPES]  # what ``trace_chain`` needs from the log


class TraceNotFound(LookupError):
    pass


def pick_rollout(prefix: str, rollout_ids: Collection[str]) -> str:
    """The one of ``rollout_ids`` (those starting with ``prefix``) that ``prefix`` names:
    itself, or the only one; ``TraceNotFound`` otherwise. Shared by the log search below
    and the lake index (``replay.trace_index``), so both resolve a prefix alike."""
    if prefix in rollout_ids:
        return prefix
    if len(rollout_ids) == 1:
        return next(iter(rollout_ids))
    if not rollout_ids:
        raise TraceNotFound(f"no trace with rollout id {prefix!r} in this run")
    raise TraceNotFound(f"{len(rollout_ids)} rollouts start with {prefix!r}: {sorted(rollout_ids)[:5]}")  # fmt: skip


def find_trace(events: Sequence[Any], rollout_id: str) -> tuple[Any, Trace]:
    """(the event that recorded it, the trace) for a rollout id or a unique prefix of one."""
    found: dict[str, tuple[Any, Trace]] = {}
    for e in events:
        if not isinstance(e, TraceCompleted | EvalCompleted):
            continue
        for t in [e.trace] if isinstance(e, TraceCompleted) else e.traces:
            if t.rollout_id.startswith(rollout_id):
                found.setdefault(t.rollout_id, (e, t))
    return found[pick_rollout(rollout_id, found.keys())]


def token_positions(trace: Trace) -> dict[int, tuple[int, int]]:
    """message id -> (branch, offset of its first token in that branch's sample): the
    first branch containing the message, where it is trained."""
    by_id = {m.id: m for m in trace.messages}
    out: dict[int, tuple[int, int]] = {}
    for b, branch in enumerate(trace.branches):
        offset = 0
        for mid in branch.messages:
            out.setdefault(mid, (b, offset))
            offset += len(by_id[mid].token_ids) // 4
    return out


def trace_chain(
    events: Sequence[Any],
    rollout_id: str,
    token_text: Callable[[list[int]], list[str]] | None = None,
) -> dict[str, Any]:
    recorder, trace = find_trace(events, rollout_id)
    rid = trace.rollout_id
    started = next((e for e in events if isinstance(e, RunStarted)), None)
    request = next(
        (e for e in events if isinstance(e, TaskRequested) and e.event_id == recorder.request_id),
        None,
    )
    weights = {e.version: e for e in events if isinstance(e, WeightsPublished)}
    scored = [
        e
        for e in events
        if isinstance(e, SamplesScored) and any(s.rollout_id == rid for s in e.samples)
    ]
    advantages, sft = channels(scored, rid)
    source_algorithm = {e.event_id: e.algorithm for e in events if isinstance(e, SamplesScored)}
    batches = []
    for b in (e for e in events if isinstance(e, BatchAssembled)):
        if not any(s.rollout_id == rid for s in b.samples):
            continue
        out = next((w for w in weights.values() if w.batch_id == b.event_id), None)
        algos = sorted(
            {source_algorithm.get(src, "?") for src in b.sources} & {e.algorithm for e in scored}
        )
        batches.append({
            "step": b.step, "event_id": b.event_id, "phase": b.phase, "algorithms": algos,
            "weights": None if out is None else
            {"version": out.version, "digest": out.weights.digest, "event_id": out.event_id},
        })  # fmt: skip
    versions = range(trace.policy_min, trace.policy_max + 1)
    sampled_by = []
    for v in versions:
        if v == 0:
            ref = started.initial_weights if started is not None else None
            sampled_by.append(
                {"version": 0, "initial": True, "digest": ref.digest if ref else None}
            )
        elif v in weights:
            w = weights[v]
            sampled_by.append({"version": v, "digest": w.weights.digest, "batch_id": w.batch_id})
    positions = token_positions(trace)
    messages = []
    for m in trace.messages:
        ids = arrays.i32(m.token_ids).tolist()
        entry: dict[str, Any] = {
            "id": m.id, "role": m.role, "content": m.content, "name": m.name,
            "policy_version": m.policy_version, "finish_reason": m.finish_reason,
            "n_tokens": len(ids), "n_sampled": int(arrays.mask(m.sampled).sum()),
        }  # fmt: skip
        if entry["n_sampled"]:
            branch, offset = positions.get(m.id, (0, 0))
            texts = token_text(ids) if token_text is not None else [None] * len(ids)
            lps = arrays.f32(m.logprobs).tolist()
            mask = arrays.mask(m.sampled).tolist()
            entry["tokens"] = [
                {"id": t, "text": texts[i], "sampled": bool(mask[i]), "logprob": lps[i],
                 "advantage": _at(advantages, branch, offset + i), "sft": _at(sft, branch, offset + i)}
                for i, t in enumerate(ids)
            ]  # fmt: skip
        messages.append(entry)
    return {
        "run": recorder.run, "rollout_id": rid, "env": trace.env, "split": trace.task.split,
        "group_id": trace.group_id, "sample_index": trace.sample_index,
        "task": {"index": trace.task.index, "data": trace.task.data},
        "reward": trace.reward, "rewards": trace.rewards, "metrics": trace.metrics,
        "errors": [{"kind": e.kind, "message": e.message} for e in trace.errors],
        "timings": trace.timings, "truncated": trace.truncated, "num_turns": trace.num_turns,
        "stop_condition": trace.stop_condition or None,
        "policy": {"min": trace.policy_min, "max": trace.policy_max},
        "recorded_by": {"event_id": recorder.event_id, "type": type(recorder).__name__},
        "backward": {
            "request": None if request is None else {
                "event_id": request.event_id, "step": request.step, "phase": request.phase,
                "model": request.model, "policy_version": request.policy_version,
                "group_size": request.group_size, "seed": request.seed},
            "sampled_by": sampled_by,
        },
        "forward": {
            "scored": [{"algorithm": e.algorithm, "event_id": e.event_id, "zero_advantage": e.zero_advantage,
                        "advantage": {s.branch: _scalar(s) for s in e.samples if s.rollout_id == rid},
                        "sft_tokens": _sft_tokens(e, rid)}
                       for e in scored],
            "batches": batches,
        },
        "messages": messages,
    }  # fmt: skip


Channel = dict[str, dict[int, np.ndarray]]  # algorithm -> branch -> a weight per token


def channels(scored: Sequence[SamplesScored], rollout_id: str) -> tuple[Channel, Channel]:
    """(advantages, SFT weights) of ``rollout_id``'s samples, per algorithm and branch.

    An algorithm appears under ``advantages`` when one of its samples trains a token by
    policy gradient (``mask``), under SFT when one carries cross-entropy weights
    (``ce_weights``, else 1 on ``sft_mask``). So the warm start's ``sft`` samples show
    what SFT trained, not a column of zero advantages (their RL channel is empty)."""
    advantages: Channel = {}
    sft: Channel = {}
    for e in scored:
        mine = [s for s in e.samples if s.rollout_id == rollout_id]
        if any(arrays.mask(s.mask).any() for s in mine):
            advantages[e.algorithm] = {s.branch: arrays.f32(s.advantages) for s in mine}
        ce = {s.branch: _ce_weights(s) for s in mine if s.sft_mask is not None or s.ce_weights is not None}  # fmt: skip
        if any(w.any() for w in ce.values()):
            sft[e.algorithm] = ce
    return advantages, sft


def _ce_weights(sample: Any) -> np.ndarray:
    if sample.ce_weights is not None:
        return arrays.f32(sample.ce_weights)
    return arrays.mask(sample.sft_mask).astype(np.float32)


def _at(channel: Channel, branch: int, i: int) -> dict[str, float]:
    """Each algorithm's weight of token ``i`` of ``branch`` (where its sample has one)."""
    return {a: float(w[branch][i]) for a, w in channel.items() if branch in w and i < len(w[branch])}  # fmt: skip


def _sft_tokens(event: SamplesScored, rollout_id: str) -> dict[int, int]:
    """Tokens trained with SFT per branch of ``rollout_id``; empty when none is."""
    n = {s.branch: int(arrays.mask(s.sft_mask).sum()) for s in event.samples
         if s.rollout_id == rollout_id and s.sft_mask is not None}  # fmt: skip
    return n if any(n.values()) else {}


def _scalar(sample: Any) -> float:
    mask = arrays.mask(sample.mask)
    return float(arrays.f32(sample.advantages)[mask][0]) if mask.any() else 0.0


def token_table(tokens: list[dict[str, Any]]) -> Table:
    """One row per token: what each algorithm trains it with. ``adv <algorithm>``: the
    policy-gradient advantage; ``ce <algorithm>``: the SFT (cross-entropy) weight, blank
    on a token SFT does not train."""
    adv = sorted({a for t in tokens for a in t["advantage"]})
    sft = sorted({a for t in tokens for a in t.get("sft", {})})
    table = Table("#", "token", "sampled", "logprob", *[f"adv {a}" for a in adv],
                  *[f"ce {a}" for a in sft])  # fmt: skip
    for i, t in enumerate(tokens):
        text = repr(t["text"]) if t["text"] is not None else str(t["id"])
        weights = [t.get("sft", {}).get(a, 0.0) for a in sft]
        table.add_row(str(i), text, "x" if t["sampled"] else "",
                      f"{t['logprob']:.4f}" if t["sampled"] else "",
                      *[f"{t['advantage'].get(a, 0.0):+.4f}" for a in adv],
                      *[f"{w:.2f}" if w else "" for w in weights])  # fmt: skip
    return table


def render_chain(chain: dict[str, Any], console: Console, tokens: bool = True) -> None:
    c = console
    c.rule(f"[bold]rollout {chain['rollout_id']}[/] ({chain['env']}, {chain['split']})")
    c.print(f"task {chain['task']['index']}: {chain['task']['data']}")
    c.print(f"group {chain['group_id']} sample {chain['sample_index']}, "
            f"turns {chain['num_turns']}, truncated {chain['truncated']}, "
            f"stopped: {chain['stop_condition']}")  # fmt: skip
    c.print(f"[bold]reward[/] {chain['reward']!r} {chain['rewards']}  metrics {chain['metrics']}")
    for e in chain["errors"]:
        c.print(f"[red]error[/] {e['kind']}: {e['message']}")
    c.print("timings " + ", ".join(f"{k}={v:.3f}s" for k, v in chain["timings"].items()))
    for m in chain["messages"]:
        extra = f" (v{m['policy_version']}, {m['finish_reason']})" if m["n_sampled"] else ""
        c.print(f"[bold cyan]{m['role']}[/]{extra}: {m['content']!r}")
        if tokens and m.get("tokens"):
            c.print(token_table(m["tokens"]))
    back, fwd = chain["backward"], chain["forward"]
    c.rule("backward")
    r = back["request"]
    c.print("requested by " + ("(not in the log)" if r is None else
            f"task.requested {r['event_id']} (step {r['step']}, phase {r['phase']}, "
            f"model {r['model']}, policy v{r['policy_version']})"))  # fmt: skip
    for w in back["sampled_by"]:
        what = "initial weights" if w.get("initial") else f"weights v{w['version']}"
        c.print(f"tokens sampled by {what} {w['digest']}")
    c.rule("forward")
    for s in fwd["scored"]:
        trains = []
        if s["sft_tokens"]:  # an SFT sample: what it trains, not its empty RL channel
            trains.append(f"SFT on {s['sft_tokens']} tokens (per branch)")
        if not s["sft_tokens"] or any(s["advantage"].values()):
            trains.append(f"advantage {s['advantage']}")
        c.print(f"scored by {s['algorithm']} ({s['event_id']}): {', '.join(trains)}")
    for b in fwd["batches"]:
        w = b["weights"]
        out = "not trained yet" if w is None else f"-> weights v{w['version']} {w['digest']}"
        c.print(f"trained in batch step {b['step']} ({b['phase']}, {b['algorithms']}) {out}")
    if not fwd["batches"]:
        c.print("never trained (not in any batch)")
