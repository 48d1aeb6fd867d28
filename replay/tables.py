"""Row builders of the lake: one stored event in, rows of each lake table out (pure).

    rows = rows_for(event, seq=42)      # {"events": [...], "rollouts": [...], ...}

``SCHEMAS`` is the column list and type of every table (docs/analytics.md describes
them). Every row carries ``run`` and ``seq`` (the stream sequence of its event), so a
row can always be traced back to the log. Scalars are Python values; per-token arrays
are numpy arrays (``replay.lake`` turns them into Parquet list columns without a
Python loop over tokens). Per-token data lives only in ``rollout_tokens`` and
``sample_tokens``, never in the wide tables, so ordinary queries stay small.

Named rewards appear twice in ``rollouts``: ``rewards`` (a list of {name, value};
a MAP in SQL) and one flattened ``reward_<name>`` column per name (sanitised).
Errors, turn errors and filter verdicts are list columns (``error_kinds``,
``turn_error_kinds``, ``filters`` as {name, value, flagged, enforced} structs,
``flagged_filters``): their names vary per run, so one column each is impossible, and
"per kind" or "per filter" is an UNNEST and a GROUP BY. ``state`` is JSON text.
``stop_condition`` is why the rollout ended (NULL for a trace recorded before it was).
Nothing here reads the clock, the network or the RNG.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import numpy as np
import polars as pl

from bus.subjects import topic_of_subject
from schemas import (
    AlgorithmAttached,
    AlgorithmDetached,
    BatchAssembled,
    DeadLettered,
    EvalCompleted,
    Event,
    MetricsReported,
    RunStarted,
    RunStopped,
    Sample,
    SamplesScored,
    TaskRequested,
    Trace,
    TraceCompleted,
    WeightsPublished,
    WeightsStored,
    arrays,
)

S, I64, F, B = pl.Utf8, pl.Int64, pl.Float64, pl.Boolean
NAMED = pl.List(pl.Struct({"name": pl.Utf8, "value": pl.Float64}))
MODELS = pl.List(pl.Struct({"name": pl.Utf8, "model": pl.Utf8}))  # member -> model key
KINDS = pl.List(pl.Utf8)  # error kinds, filter names
VERDICTS = pl.List(pl.Struct({"name": S, "value": F, "flagged": B, "enforced": B}))
TIMINGS = ("generate_s", "queue_s", "compute_s", "env_s", "total_s")
_BASE = {"run": S, "seq": I64}

SCHEMAS: dict[str, dict[str, pl.DataType | type[pl.DataType]]] = {
    "events": {**_BASE, "subject": S, "topic": S, "type": S, "schema": S, "event_id": S,
               "causation_id": S, "producer": S, "ts_ns": I64, "stored_ns": I64, "size": I64,
               "offloaded": B},
    "runs": {**_BASE, "kind": S, "seed": I64, "model_path": S, "resumed": B, "reason": S,
             "step": I64, "detail": S, "config": S, "ts_ns": I64},
    "tasks": {**_BASE, "event_id": S, "env": S, "split": S, "phase": S, "task_index": I64,
              "group_id": S, "group_size": I64, "step": I64, "policy_version": I64, "model": S,
              "seed": I64, "temperature": F, "max_completion_tokens": I64, "ts_ns": I64},
    "rollouts": {**_BASE, "event_id": S, "split": S, "env": S, "task_index": I64, "group_id": S,
                 "rollout_id": S, "sample_index": I64, "request_id": S, "step": I64,
                 "group_size": I64, "policy_min": I64, "policy_max": I64, "reward": F,
                 "rewards": NAMED, "metrics": NAMED, "num_turns": I64, "num_messages": I64,
                 "num_branches": I64, "prompt_tokens": I64, "completion_tokens": I64,
                 "truncated": B, "stop_condition": S, "finish_reason": S, "error_type": S,
                 "error_message": S,
                 "num_errors": I64, "error_kinds": KINDS, "turn_errors": I64,
                 "turn_error_kinds": KINDS, "is_filtered": B, "filters": VERDICTS,
                 "flagged_filters": KINDS, "from_policy": B, "tool_calls": I64, "state": S,
                 **dict.fromkeys(TIMINGS, F), "seat": S, "seat_reward": F,
                 "member_rewards": NAMED, "member_models": MODELS, "producer": S, "ts_ns": I64},
    "rollout_tokens": {**_BASE, "rollout_id": S, "split": S, "branch": I64, "member": S,
                       "seat": S, "model": S,
                       "n_tokens": I64, "token_ids": pl.List(pl.Int32),
                       "sampled": pl.List(pl.Boolean), "logprobs": pl.List(pl.Float32),
                       "policy_versions": pl.List(pl.Int32)},
    "samples": {**_BASE, "event_id": S, "algorithm": S, "env": S, "group_id": S,
                "request_id": S, "task_index": I64, "step": I64, "rollout_id": S, "branch": I64,
                "reward": F, "adv_mean": F, "adv_min": F, "adv_max": F, "n_tokens": I64,
                "n_masked": I64, "n_sft": I64, "n_ref": I64, "member": S, "policy_min": I64,
                "policy_max": I64, "zero_advantage": B, "group_samples": I64, "group_excluded": I64, "ts_ns": I64},
    "sample_tokens": {**_BASE, "algorithm": S, "rollout_id": S, "branch": I64,
                      "mask": pl.List(pl.Boolean), "advantages": pl.List(pl.Float32),
                      "sft_mask": pl.List(pl.Boolean)},
    "batches": {**_BASE, "event_id": S, "step": I64, "phase": S, "n_samples": I64, "n_tokens": I64,
                "policy_version": I64, "dropped_stale": I64, "skipped_zero_advantage": I64,
                "sources": pl.List(pl.Utf8), "ts_ns": I64},
    "batch_samples": {**_BASE, "step": I64, "phase": S, "position": I64, "rollout_id": S,
                      "branch": I64, "env": S, "group_id": S, "task_index": I64, "reward": F,
                      "policy_min": I64, "policy_max": I64, "staleness": I64, "n_tokens": I64,
                      "n_masked": I64, "algorithms": pl.List(pl.Utf8)},
    "algorithms": {**_BASE, "event_id": S, "kind": S, "algorithm": S, "name": S, "options": S,
                   "envs": pl.List(pl.Utf8), "shadow": B, "from_seq": I64, "reason": S,
                   "ts_ns": I64},
    "metrics": {**_BASE, "role": S, "step": I64, "policy_version": I64, "metric": S, "value": F,
                "producer": S, "ts_ns": I64},
    "eval": {**_BASE, "step": I64, "policy_version": I64, "env": S, "metric": S, "k": I64,
             "value": F, "ts_ns": I64},
    "weights": {**_BASE, "event_id": S, "version": I64, "step": I64, "kind": S, "location": S,
                "bucket": S, "size": I64, "digest": S, "format": S, "batch_id": S, "ts_ns": I64},
    "weights_stored": {**_BASE, "event_id": S, "version": I64, "step": I64, "kind": S,
                       "location": S, "bucket": S, "size": I64, "digest": S, "format": S,
                       "batch_id": S, "ts_ns": I64},
    "dead_letters": {**_BASE, "event_id": S, "role": S, "consumer": S, "subject": S,
                     "stream_seq": I64, "deliveries": I64, "error_type": S, "error": S,
                     "schema": S, "ts_ns": I64},
}  # fmt: skip
TABLES = tuple(SCHEMAS)
DYNAMIC_PREFIX = {"rollouts": "reward_"}  # tables with extra Float64 columns per name
_STOP = ("reason", "step", "detail")  # the runs columns of run.stopped
_UNSAFE = re.compile(r"[^0-9A-Za-z_]")
_K = re.compile(r"@(\d+)$")


def reward_column(name: str) -> str:
    """The flattened column of a named reward: ``reward_<name>``, sanitised for SQL."""
    return "reward_" + _UNSAFE.sub("_", name)


def _named(values: dict[str, float]) -> list[dict[str, Any]]:
    return [{"name": k, "value": float(v)} for k, v in sorted(values.items())]


def rollout_rows(
    run: str, seq: int, trace: Trace, *, event_id: str, request_id: str, step: int,
    group_size: int, producer: str, ts_ns: int,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:  # fmt: skip
    """The ``rollouts`` row of one trace and its ``rollout_tokens`` rows (one per branch)."""
    sampled_total = prompt_total = 0
    finish = None
    for m in trace.messages:
        n_sampled = int(arrays.mask(m.sampled).sum())
        sampled_total += n_sampled
        prompt_total += len(m.token_ids) // 4 - n_sampled
        finish = m.finish_reason or finish
    error = trace.errors[0] if trace.errors else None
    row = {
        "run": run, "seq": seq, "event_id": event_id, "split": trace.task.split, "env": trace.env,
        "task_index": trace.task.index, "group_id": trace.group_id, "rollout_id": trace.rollout_id,
        "sample_index": trace.sample_index, "request_id": request_id, "step": step,
        "group_size": group_size, "policy_min": trace.policy_min, "policy_max": trace.policy_max,
        "reward": float(trace.reward), "rewards": _named(trace.rewards),
        "metrics": _named(trace.metrics), "num_turns": trace.num_turns,
        "num_messages": len(trace.messages), "num_branches": len(trace.branches),
        "prompt_tokens": prompt_total, "completion_tokens": sampled_total,
        "truncated": trace.truncated, "stop_condition": trace.stop_condition or None,
        "finish_reason": finish,
        "error_type": error.kind if error else None, "error_message": error.message if error else None,
        "num_errors": len(trace.errors), "error_kinds": [e.kind for e in trace.errors],
        "turn_errors": len(trace.turn_errors),
        "turn_error_kinds": [e.kind for e in trace.turn_errors], "is_filtered": trace.is_filtered,
        "filters": [_pick(v, "name", "value", "flagged", "enforced") for v in trace.filters],
        "flagged_filters": [v.name for v in trace.filters if v.flagged],
        "from_policy": trace.from_policy,
        "tool_calls": sum(len(m.tool_calls) for m in trace.messages),
        "state": msgspec.json.encode(trace.state, order="sorted").decode(),
        **{t: trace.timings.get(t) for t in TIMINGS},
        "seat": trace.seat, "seat_reward": trace.member_rewards.get(trace.seat or ""),
        "member_rewards": _named(trace.member_rewards),
        "member_models": [{"name": k, "model": v} for k, v in sorted(trace.member_models.items())],
        "producer": producer, "ts_ns": ts_ns,
        **{reward_column(k): float(v) for k, v in trace.rewards.items()},
    }  # fmt: skip
    by_id = {m.id: m for m in trace.messages}
    tokens = []
    for index, branch in enumerate(trace.branches):
        ids, sampled, logprobs, _ = trace.branch_tokens(branch)
        versions = [
            np.full(len(by_id[i].token_ids) // 4, -1 if v is None else v, np.int32)
            for i in branch.messages
            for v in [by_id[i].policy_version]
        ]
        tokens.append(
            {
                "run": run,
                "seq": seq,
                "rollout_id": trace.rollout_id,
                "split": trace.task.split,
                "branch": index,
                "member": branch.member,
                "seat": trace.seat,
                "model": trace.member_models.get(branch.member or ""),
                "n_tokens": len(ids),
                "token_ids": ids,
                "sampled": sampled,
                "logprobs": logprobs,
                # -1 marks tokens no policy sampled (prompt, env, tools): null in the lake
                "policy_versions": np.concatenate(versions) if versions else np.zeros(0, np.int32),
            }  # fmt: skip
        )
    return row, tokens


def _sample_stats(s: Sample) -> dict[str, Any]:
    mask = arrays.mask(s.mask)
    adv = arrays.f32(s.advantages)[mask]
    return {
        "rollout_id": s.rollout_id, "branch": s.branch, "reward": float(s.reward),
        "n_tokens": len(s), "n_masked": int(mask.sum()),
        "adv_mean": float(adv.mean()) if len(adv) else None,
        "adv_min": float(adv.min()) if len(adv) else None,
        "adv_max": float(adv.max()) if len(adv) else None,
        "policy_min": s.policy_min, "policy_max": s.policy_max,
    }  # fmt: skip


def _n_ref(s: Sample) -> int:
    return int((arrays.f32(s.ref_weights) > 0).sum()) if s.ref_weights is not None else 0


def _metric_rows(run: str, seq: int, e: MetricsReported) -> dict[str, list[dict[str, Any]]]:
    base = {"run": run, "seq": seq, "step": e.step, "policy_version": e.policy_version, "ts_ns": e.ts_ns}  # fmt: skip
    out: dict[str, list[dict[str, Any]]] = {
        "metrics": [
            {**base, "role": e.role, "metric": k, "value": float(v), "producer": e.producer}
            for k, v in sorted(e.values.items())
        ]
    }
    # Keys are "<env>/<metric>", e.g. "reverse-text/avg@4"; "eval-adhoc" is `rlbus eval`'s.
    if e.role in ("eval", "eval-adhoc"):
        out["eval"] = []
        for key, v in sorted(e.values.items()):
            env, _, metric = key.rpartition("/")
            k = _K.search(metric)
            out["eval"].append(
                {
                    **base,
                    "env": env or None,
                    "metric": metric,
                    "k": int(k.group(1)) if k else None,
                    "value": float(v),
                }  # fmt: skip
            )
    return out


def _pick(obj: object, *names: str) -> dict[str, Any]:
    return {n: getattr(obj, n) for n in names}


def rows_for(
    event: Event, seq: int, *, subject: str = "", stored_ns: int = 0, schema: str = "",
    size: int = 0, offloaded: bool = False,
) -> dict[str, list[dict[str, Any]]]:  # fmt: skip
    """Every lake row one stored event contributes, by table (``events`` always)."""
    run, tag = event.run, str(type(event).__struct_config__.tag)
    base = {"run": run, "seq": seq, "ts_ns": event.ts_ns}
    out: dict[str, list[dict[str, Any]]] = {"events": [{
        **base, **_pick(event, "event_id", "causation_id", "producer"), "subject": subject,
        "topic": _topic(run, subject), "type": tag.partition("/")[0], "schema": schema or tag,
        "stored_ns": stored_ns, "size": size, "offloaded": offloaded,
    }]}  # fmt: skip
    match event:
        case TraceCompleted() | EvalCompleted():
            traces = [event.trace] if isinstance(event, TraceCompleted) else event.traces
            n = event.group_size if isinstance(event, TraceCompleted) else len(traces)
            out["rollouts"], out["rollout_tokens"] = [], []
            for trace in traces:
                row, tokens = rollout_rows(
                    run, seq, trace, event_id=event.event_id, request_id=event.request_id,
                    step=event.step, group_size=n, producer=event.producer, ts_ns=event.ts_ns,
                )  # fmt: skip
                out["rollouts"].append(row)
                out["rollout_tokens"].extend(tokens)
        case SamplesScored():
            group = {
                **base, **_pick(event, "event_id", "algorithm", "env", "group_id", "request_id",
                                "task_index", "step", "zero_advantage"),
                "group_samples": len(event.samples), "group_excluded": event.excluded,
            }  # fmt: skip
            out["samples"], out["sample_tokens"] = [], []
            for s in event.samples:
                sft = arrays.mask(s.sft_mask) if s.sft_mask is not None else None
                out["samples"].append(
                    {
                        **group,
                        **_sample_stats(s),
                        "n_sft": int(sft.sum()) if sft is not None else 0,
                        "n_ref": _n_ref(s),
                        "member": s.member,
                    }
                )
                out["sample_tokens"].append({
                    "run": run, "seq": seq, "algorithm": event.algorithm, "rollout_id": s.rollout_id,
                    "branch": s.branch, "mask": arrays.mask(s.mask),
                    "advantages": arrays.f32(s.advantages), "sft_mask": sft,
                })  # fmt: skip
        case BatchAssembled():
            out["batches"] = [{
                **base, **_pick(event, "event_id", "step", "phase", "policy_version",
                                "dropped_stale", "skipped_zero_advantage"),
                "n_samples": len(event.samples), "n_tokens": event.num_tokens,
                "sources": list(event.sources),
            }]  # fmt: skip
            out["batch_samples"] = [{
                "run": run, "seq": seq, "step": event.step, "phase": event.phase, "position": i,
                **_pick(s, "env", "group_id", "task_index"), "staleness": event.step - 1 - s.policy_min,
                **{k: v for k, v in _sample_stats(s).items() if not k.startswith("adv_")},
                "algorithms": list(s.algorithms),
            } for i, s in enumerate(event.samples)]  # fmt: skip
        case MetricsReported():
            out.update(_metric_rows(run, seq, event))
        case WeightsPublished() | WeightsStored():
            table = "weights" if isinstance(event, WeightsPublished) else "weights_stored"
            out[table] = [{
                **base, **_pick(event, "event_id", "version", "step", "format", "batch_id"),
                **_pick(event.weights, "kind", "location", "bucket", "size", "digest"),
            }]  # fmt: skip
        case TaskRequested():
            out["tasks"] = [{
                **base, **_pick(event, "event_id", "env", "phase", "group_id", "group_size", "step",
                                "policy_version", "model", "seed"),
                "split": event.task.split, "task_index": event.task.index,
                **_pick(event.sampling, "temperature", "max_completion_tokens"),
            }]  # fmt: skip
        case RunStarted():
            out["runs"] = [{
                **base, **_pick(event, "seed", "model_path", "resumed"), "kind": "started",
                "config": json.dumps(event.config, sort_keys=True), **dict.fromkeys(_STOP),
            }]  # fmt: skip
        case RunStopped():
            out["runs"] = [{
                **base, **_pick(event, *_STOP), "kind": "stopped",
                **dict.fromkeys(("seed", "model_path", "resumed", "config")),
            }]  # fmt: skip
        case DeadLettered():
            out["dead_letters"] = [{
                **base, **_pick(event, "event_id", "role", "consumer", "subject", "stream_seq",
                                "deliveries", "error_type", "error"),
                "schema": event.headers.get("Rl-Schema"),
            }]  # fmt: skip
        case AlgorithmAttached():
            out["algorithms"] = [{
                **base, **_pick(event, "event_id", "algorithm", "name", "shadow", "from_seq"),
                "kind": "attached", "options": json.dumps(event.options, sort_keys=True),
                "envs": list(event.envs), "reason": None,
            }]  # fmt: skip
        case AlgorithmDetached():
            out["algorithms"] = [{
                **base, **_pick(event, "event_id", "algorithm", "reason"), "kind": "detached",
                "name": None, "options": None, "envs": [], "shadow": None, "from_seq": None,
            }]  # fmt: skip
    return out


def _topic(run: str, subject: str) -> str | None:
    """``trace.completed`` from ``rl.<run>.trace.completed.<env>`` (None if no subject)."""
    try:
        return topic_of_subject(run, subject).value
    except ValueError:
        return None
