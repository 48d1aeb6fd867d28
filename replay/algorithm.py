"""Algorithm replay: recompute scored samples from the recorded traces with today's code.

    rlbus replay <run> algorithm grpo      # recorded in the run: diff, exact
    rlbus replay <run> algorithm rloo      # not recorded: a shadow table to compare in SQL

An algorithm is a pure fold (``roles.algorithm``): the same traces in the same order
give the same advantages, bit for bit. Replay reads ``trace.completed.*`` in log order,
groups traces by group id exactly as the worker does (``GroupBuffer``: a group is
complete at ``group_size`` distinct rollouts; redeliveries never count twice), scores
each complete group with ``score_group`` and folds a stateful algorithm's state in the
order the groups complete. The options come from the run's config
(``orchestrator.algorithms``), as the worker's did.

- **Recorded** (``samples.scored.<id>`` exists in the run): every recomputed sample is
  compared with the recorded one of the same (group, rollout, branch): the scalar
  advantage exactly, and the per-token advantages, mask and token ids byte for byte.
- **Not recorded**: the samples are written to
  ``<run_dir>/lake/shadow_samples/<id>.parquet`` with the columns of the lake's
  ``samples`` table, so SQL can put the two side by side.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bus.reader import read_log
from bus.runtime import Bus
from bus.subjects import Topic, check_token
from configs import RunConfig, resolve
from replay.diff import ValueDiff, diff_values
from schemas import RunStarted, Sample, SamplesScored, TraceCompleted, arrays

SHADOW_DIR = Path("lake") / "shadow_samples"


@dataclass
class AlgorithmLog:
    cfg: RunConfig
    traces: list[tuple[int, TraceCompleted]]  # (stream seq, event), log order
    recorded: dict[str, SamplesScored]  # by group id (first record wins)
    last_scored_seq: int = 0  # stream seq of the newest recorded SamplesScored


async def read_algorithm_log(bus: Bus, algorithm_id: str) -> AlgorithmLog:
    check_token(algorithm_id, "algorithm id")
    started: RunStarted | None = None
    traces: list[tuple[int, TraceCompleted]] = []
    recorded: dict[str, SamplesScored] = {}
    last = 0
    topics = [(Topic.RUN_STARTED, None), (Topic.TRACE_COMPLETED, None),
              (Topic.SAMPLES_SCORED, algorithm_id)]  # fmt: skip
    types = (RunStarted, TraceCompleted, SamplesScored)
    async for seq, event in read_log(bus, topics, types, with_seq=True):
        match event:
            case RunStarted():
                started = started or event
            case TraceCompleted():
                traces.append((seq, event))
            case SamplesScored():
                recorded.setdefault(event.group_id, event)
                last = seq
    if started is None:
        raise ValueError(f"run {bus.run!r} has no run.started event")
    return AlgorithmLog(resolve(started.config), traces, recorded, last)


def recompute(
    algorithm_id: str, log: AlgorithmLog, options: dict[str, Any] | None = None
) -> list[tuple[int, SamplesScored]]:
    """(seq of the trace that completed the group, SamplesScored) per group, in order."""
    from roles.algorithm.registry import create
    from roles.algorithm.samples import GroupBuffer, score_group
    from roles.algorithm.worker import algorithm_spec

    name, spec_options = algorithm_spec(log.cfg, algorithm_id)
    algorithm = create(name, spec_options if options is None else options)
    buffer = GroupBuffer()
    state = algorithm.initial_state()
    out = []
    for seq, event in log.traces:
        group = buffer.add(event)
        if group is None:
            continue
        scored = score_group(algorithm_id, algorithm, group, state)
        buffer.mark_scored(scored.group_id)
        if algorithm.stateful:
            state = algorithm.fold(state, scored)
        out.append((seq, scored))
    return out


def sample_key(group_id: str, s: Sample) -> str:
    return f"{group_id}/{s.rollout_id}#{s.branch}"


def scalar_advantage(s: Sample) -> float:
    """The advantage a sample's trainable tokens carry (0.0 when none is trainable)."""
    mask = arrays.mask(s.mask)
    adv = arrays.f32(s.advantages)
    return float(adv[mask][0]) if mask.any() else 0.0


@dataclass
class AlgorithmDiff:
    advantages: ValueDiff = field(default_factory=ValueDiff)
    arrays: list[str] = field(default_factory=list)  # "key: field" whose bytes differ
    groups: list[str] = field(default_factory=list)  # group-level differences
    groups_compared: int = 0
    unscored_tail: int = 0  # groups completed after the worker's last output (run ended)

    @property
    def ok(self) -> bool:
        return self.advantages.ok and not self.arrays and not self.groups


def diff_scored(log: AlgorithmLog, recomputed: list[tuple[int, SamplesScored]]) -> AlgorithmDiff:
    """Recomputed vs recorded, group by group and sample by sample (exact).

    A group completed after the worker's last recorded output was most likely still
    unscored when the run stopped: counted in ``unscored_tail``, not a difference.
    """
    out = AlgorithmDiff()
    recorded = log.recorded
    mine = {s.group_id: s for _, s in recomputed}
    for gid in sorted(recorded.keys() - mine.keys()):
        out.groups.append(f"{gid}: recorded but not recomputed (incomplete group in the log?)")
    for seq, s in recomputed:
        if s.group_id in recorded:
            continue
        if seq > log.last_scored_seq:
            out.unscored_tail += 1
        else:
            out.groups.append(
                f"{s.group_id}: recomputed but never recorded (skipped by the worker?)"
            )
    for gid, new in mine.items():
        old = recorded.get(gid)
        if old is None:
            continue
        out.groups_compared += 1
        for name in ("zero_advantage", "excluded", "rewards", "env", "task_index"):
            if getattr(old, name) != getattr(new, name):
                out.groups.append(f"{gid}: {name} {getattr(old, name)!r} -> {getattr(new, name)!r}")
        olds = {sample_key(gid, s): s for s in old.samples}
        news = {sample_key(gid, s): s for s in new.samples}
        out.advantages.merge(
            diff_values(
                {k: scalar_advantage(s) for k, s in olds.items()},
                {k: scalar_advantage(s) for k, s in news.items()},
            )
        )
        for key in olds.keys() & news.keys():
            for name in ("advantages", "mask", "token_ids", "sft_mask"):
                if getattr(olds[key], name) != getattr(news[key], name):
                    out.arrays.append(f"{key}: {name}")
    out.arrays.sort()
    return out


def shadow_rows(run: str, scored: list[tuple[int, SamplesScored]]) -> list[dict[str, Any]]:
    """Rows shaped like the lake's ``samples`` table, one per sample."""
    rows = []
    for seq, event in scored:
        for s in event.samples:
            mask = arrays.mask(s.mask)
            adv = arrays.f32(s.advantages)[mask]
            sft = arrays.mask(s.sft_mask) if s.sft_mask is not None else None
            rows.append({
                "run": run, "seq": seq, "event_id": event.event_id,
                "algorithm": event.algorithm, "env": event.env, "group_id": event.group_id,
                "request_id": event.request_id, "task_index": event.task_index,
                "step": event.step, "rollout_id": s.rollout_id, "branch": s.branch,
                "reward": float(s.reward),
                "adv_mean": float(adv.mean()) if len(adv) else None,
                "adv_min": float(adv.min()) if len(adv) else None,
                "adv_max": float(adv.max()) if len(adv) else None,
                "n_tokens": len(s), "n_masked": int(mask.sum()),
                "n_sft": int(sft.sum()) if sft is not None else 0,
                "policy_min": s.policy_min, "policy_max": s.policy_max,
                "zero_advantage": event.zero_advantage, "group_samples": len(event.samples),
                "group_excluded": event.excluded, "ts_ns": None,
            })  # fmt: skip
    return rows


def write_shadow(run_dir: Path, algorithm_id: str, rows: list[dict[str, Any]]) -> Path:
    """``<run_dir>/lake/shadow_samples/<id>.parquet`` (written atomically)."""
    import polars as pl

    i64, f64 = pl.Int64, pl.Float64
    schema = {
        "run": pl.Utf8, "seq": i64, "event_id": pl.Utf8, "algorithm": pl.Utf8, "env": pl.Utf8,
        "group_id": pl.Utf8, "request_id": pl.Utf8, "task_index": i64, "step": i64,
        "rollout_id": pl.Utf8, "branch": i64, "reward": f64, "adv_mean": f64, "adv_min": f64,
        "adv_max": f64, "n_tokens": i64, "n_masked": i64, "n_sft": i64, "policy_min": i64,
        "policy_max": i64, "zero_advantage": pl.Boolean, "group_samples": i64,
        "group_excluded": i64, "ts_ns": i64,
    }  # fmt: skip
    path = run_dir / SHADOW_DIR / f"{check_token(algorithm_id, 'algorithm id')}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pl.DataFrame(rows, schema=schema).write_parquet(tmp)
    tmp.replace(path)
    return path
