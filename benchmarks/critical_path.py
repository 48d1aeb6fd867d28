"""Where one trainer step's time goes, from a run's events (pure: no bus, no clock).

For each batch (``BatchAssembled`` step s) the log links every hand-off by id:
``sources`` are the ``SamplesScored`` event ids merged into it, each names the
``TaskRequested`` it answers (``request_id``), and every ``TraceCompleted`` of that
group carries the same ``request_id``. The trainer's ``WeightsPublished`` (version =
step = s) is stamped once the step is trained and its weights stored, and its
``MetricsReported`` gives ``step_s`` (the optimizer step) and ``wait_s`` (idle before
the batch arrived); inference logs ``weights.swapped`` when a replica serves a version.
So per step, as wall-clock seconds (``ts_ns`` of events of processes on one host):

    requested    first task of the batch requested
    last_trace   last rollout of those tasks completed
    scored       last of its groups scored by an algorithm worker
    assembled    the batch assembled by the orchestrator
    train_start  published - step_s (it includes storing the weights: not separable)
    published    weights version s announced
    live         first replica serving version s or newer

    rows = step_rows(requests, traces, scored, batches, published, trainer, swaps)
    summary = medians(steady(rows)) | {"account": step_account(steady(rows))}
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from schemas import (
    BatchAssembled,
    MetricsReported,
    SamplesScored,
    TaskRequested,
    TraceCompleted,
    WeightsPublished,
)

SEGMENTS = {  # name: (from, to)
    "request_to_last_trace": ("requested", "last_trace"),
    "last_trace_to_scored": ("last_trace", "scored"),
    "scored_to_assembled": ("scored", "assembled"),
    "assembled_to_train_start": ("assembled", "train_start"),
    "train": ("train_start", "published"),
    "publish_to_live": ("published", "live"),
    "request_to_live": ("requested", "live"),
}


def seconds(ts_ns: int) -> float:
    return ts_ns / 1e9


def step_rows(
    requests: Iterable[TaskRequested],
    traces: Iterable[TraceCompleted],
    scored: Iterable[SamplesScored],
    batches: Iterable[BatchAssembled],
    published: Iterable[WeightsPublished],
    trainer: Iterable[MetricsReported],
    swaps: dict[int, float],
) -> list[dict[str, Any]]:
    """One row per assembled batch, in step order (a missing link leaves None)."""
    requested = {r.event_id: seconds(r.ts_ns) for r in requests}
    trace_done: dict[str, float] = {}
    for t in traces:
        trace_done[t.request_id] = max(trace_done.get(t.request_id, 0.0), seconds(t.ts_ns))
    by_scored = {s.event_id: s for s in scored}
    weights: dict[int, float] = {}
    for w in published:  # a republished step keeps its first announcement
        weights.setdefault(w.step, seconds(w.ts_ns))
    metrics = {m.step: m.values for m in trainer}
    rows = []
    for b in sorted({b.step: b for b in batches}.values(), key=lambda b: b.step):
        groups = [by_scored[i] for i in b.sources if i in by_scored]
        ids = {g.request_id for g in groups}
        values = metrics.get(b.step, {})
        row: dict[str, Any] = {
            "step": b.step,
            "phase": b.phase,
            "samples": len(b.samples),
            "requested": min((requested[i] for i in ids if i in requested), default=None),
            "last_trace": max((trace_done[i] for i in ids if i in trace_done), default=None),
            "scored": max((seconds(g.ts_ns) for g in groups), default=None),
            "assembled": seconds(b.ts_ns),
            "published": weights.get(b.step),
            "step_s": values.get("step_s"),
            "wait_s": values.get("wait_s"),
            "live": min((t for v, t in swaps.items() if v >= b.step), default=None),
        }
        row["train_start"] = (
            row["published"] - row["step_s"]
            if None not in (row["published"], row["step_s"])
            else None
        )
        for name, (a, z) in SEGMENTS.items():
            row[name] = row[z] - row[a] if None not in (row[a], row[z]) else None
        rows.append(row)
    for prev, row in zip(rows, rows[1:], strict=False):
        both = prev["published"] is not None and row["published"] is not None
        row["step_wall"] = row["published"] - prev["published"] if both else None
    if rows:
        rows[0]["step_wall"] = None
    return rows


def steady(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The steady state: RL steps (all steps when none is RL) without the first fifth
    (at least two), where the pipeline is still filling."""
    rl = [r for r in rows if r["phase"] == "rl"] or rows
    return rl[max(2, len(rl) // 5) :] if len(rl) > 4 else rl


def medians(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """The median of every segment (and the step's wall, train and wait) over ``rows``."""
    out: dict[str, float | None] = {}
    for key in [*SEGMENTS, "step_wall", "step_s", "wait_s"]:
        values = [r[key] for r in rows if r.get(key) is not None]
        out[key] = round(statistics.median(values), 4) if values else None
    return out


def step_account(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """Where the trainer's step wall goes, as means (they add up, medians do not):
    ``train`` (the optimizer step), ``wait`` (idle until the batch came) and ``other``
    (the rest: storing and announcing weights, checkpoints, the hand-off)."""
    full = [r for r in rows if None not in (r.get("step_wall"), r["step_s"], r["wait_s"])]
    if not full:
        return {"wall": None, "train": None, "wait": None, "other": None}
    wall = statistics.fmean(r["step_wall"] for r in full)
    train = statistics.fmean(r["step_s"] for r in full)
    wait = statistics.fmean(r["wait_s"] for r in full)
    account = {"wall": wall, "train": train, "wait": wait, "other": wall - train - wait}
    return {k: round(v, 4) for k, v in account.items()}


def throughput(
    rows: list[dict[str, Any]], traces: Iterable[TraceCompleted]
) -> dict[str, float | None]:
    """Steps/s, completions generated/s (train rollouts completed) and trained/s
    (samples of the batches) over ``rows``: from the publish before the first row to
    the last row's publish."""
    stamped = [r for r in rows if r["published"] is not None]
    if len(stamped) < 2:
        return {
            "window_s": None,
            "steps_per_s": None,
            "generated_per_s": None,
            "trained_per_s": None,
        }
    t0, t1 = stamped[0]["published"], stamped[-1]["published"]
    wall = t1 - t0
    generated = sum(
        1 for t in traces if t.trace.task.split == "train" and t0 < seconds(t.ts_ns) <= t1
    )
    trained = sum(r["samples"] for r in stamped[1:])
    return {
        "window_s": round(wall, 3),
        "steps_per_s": round((len(stamped) - 1) / wall, 3),
        "generated_per_s": round(generated / wall, 1),
        "trained_per_s": round(trained / wall, 1),
    }


def swap_times(lines: Iterable[str]) -> dict[int, float]:
    """Version -> wall-clock seconds of its first ``weights.swapped`` in inference log
    lines (structlog JSON, ``timestamp`` in ISO UTC); other lines are skipped."""
    out: dict[int, float] = {}
    for line in lines:
        if '"weights.swapped"' not in line:
            continue
        try:
            rec = json.loads(line)
            t = datetime.fromisoformat(rec["timestamp"]).timestamp()
            version = int(rec["version"])
        except (ValueError, KeyError, TypeError):
            continue
        out[version] = min(out.get(version, t), t)
    return out
