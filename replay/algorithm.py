"""Algorithm replay: recompute scored samples from the recorded traces with today's code.

    rlbus replay <run> algorithm grpo      # recorded in the run: diff, exact
    rlbus replay <run> algorithm rloo      # not recorded: a shadow table to compare in SQL

An algorithm is a pure fold (``roles.algorithm``): the same traces in the same order
give the same advantages, bit for bit. Replay reads ``trace.completed.*`` in log order
and feeds them to the worker's own pure core (``roles.algorithm.core.ScoringCore``:
route, buffer per group, score, fold the state), built the way the worker builds it:
from the run's config (``orchestrator.algorithms``) or, for a worker attached at
runtime, from its ``algorithm.attached`` event (which also gives the first sequence it
scored and its envs). A distillation algorithm's reference logprobs are the ones it
recorded (replay has no model to ask, so such an algorithm can only be replayed where
it was recorded).

- **Recorded** (``samples.scored.<id>`` exists in the run): every recomputed sample is
  compared with the recorded one of the same (group, rollout, branch): the scalar
  advantage exactly, and every per-token channel array, mask and token ids byte for byte.
- **Not recorded**: the samples are written to
  ``<run_dir>/lake/shadow_samples/<id>.parquet`` with the columns of the lake's
  ``samples`` table, so SQL can put the two side by side.

Reading and recomputing take ``on_progress(done, total)``: messages read, then traces
replayed (``rlbus replay`` draws both).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bus.reader import Progress, read_log
from bus.runtime import Bus
from bus.subjects import Topic, check_token
from configs import RunConfig, resolve
from configs.paths import RunPaths
from replay.diff import ValueDiff, diff_values
from schemas import (
    AlgorithmAttached,
    RunStarted,
    Sample,
    SamplesScored,
    TraceCompleted,
    arrays,
)

if TYPE_CHECKING:
    from roles.algorithm.base import Refs


@dataclass
class AlgorithmLog:
    cfg: RunConfig
    traces: list[tuple[int, TraceCompleted]]  # (stream seq, event), log order
    recorded: dict[str, SamplesScored]  # by group id (first record wins)
    last_scored_seq: int = 0  # stream seq of the newest recorded SamplesScored
    attached: AlgorithmAttached | None = None  # its newest attach event, if attached at runtime


async def read_algorithm_log(
    bus: Bus, algorithm_id: str, on_progress: Progress | None = None
) -> AlgorithmLog:
    check_token(algorithm_id, "algorithm id")
    started: RunStarted | None = None
    traces: list[tuple[int, TraceCompleted]] = []
    recorded: dict[str, SamplesScored] = {}
    last = 0
    attached: AlgorithmAttached | None = None
    topics = [(Topic.RUN_STARTED, None), (Topic.TRACE_COMPLETED, None),
              (Topic.SAMPLES_SCORED, algorithm_id), (Topic.ALGORITHM_ATTACHED, algorithm_id)]  # fmt: skip
    types = (RunStarted, TraceCompleted, SamplesScored, AlgorithmAttached)
    async for seq, event in read_log(bus, topics, types, with_seq=True, on_progress=on_progress):
        match event:
            case RunStarted():
                started = started or event
            case AlgorithmAttached():
                attached = event
            case TraceCompleted():
                traces.append((seq, event))
            case SamplesScored():
                recorded.setdefault(event.group_id, event)
                last = seq
    if started is None:
        raise ValueError(f"run {bus.run!r} has no run.started event")
    return AlgorithmLog(resolve(started.config), traces, recorded, last, attached)


async def recompute(
    algorithm_id: str,
    log: AlgorithmLog,
    options: dict[str, Any] | None = None,
    on_progress: Progress | None = None,
) -> list[tuple[int, SamplesScored]]:
    """(seq of the trace that completed the group, SamplesScored) per group, in order;
    ``on_progress(traces replayed, traces from the worker's first sequence on)``."""
    from roles.algorithm.core import ScoringCore

    core = ScoringCore.for_run(log.cfg, algorithm_id, log.attached, options)

    async def recorded(group: list[TraceCompleted]) -> Refs:
        return recorded_refs(log, algorithm_id, group[0].trace.group_id)

    out = []
    todo = [(seq, event) for seq, event in log.traces if seq >= core.from_seq]
    for done, (seq, event) in enumerate(todo, 1):
        scored = await core.step(event, recorded)
        if scored is not None:
            core.done(scored)
            out.append((seq, scored))
        if on_progress is not None:
            on_progress(done, len(todo))
    return out


def recorded_refs(log: AlgorithmLog, algorithm_id: str, group_id: str) -> Refs:
    """The reference logprobs the worker recorded for a group (replay has no model)."""
    scored = log.recorded.get(group_id)
    if scored is None:
        raise ValueError(
            f"{algorithm_id!r} scores with a model: it can only be replayed where its samples "
            f"were recorded, and group {group_id} has none"
        )
    return {
        (s.rollout_id, s.branch): arrays.f32(s.ref_logprobs)
        for s in scored.samples
        if s.ref_logprobs is not None
    }


# Every per-token field of a Sample, compared byte for byte.
ARRAY_FIELDS = (
    "advantages", "mask", "token_ids", "sft_mask", "ce_weights", "ref_weights", "ref_logprobs",
)  # fmt: skip


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
        for name in (
            "zero_advantage",
            "excluded",
            "excluded_members",
            "rewards",
            "env",
            "task_index",
        ):
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
            for name in ARRAY_FIELDS:
                if getattr(olds[key], name) != getattr(news[key], name):
                    out.arrays.append(f"{key}: {name}")
    out.arrays.sort()
    return out


def shadow_rows(run: str, scored: list[tuple[int, SamplesScored]]) -> list[dict[str, Any]]:
    """Rows of the lake's ``samples`` table, one per sample (the lake's own row builder)."""
    from replay.tables import rows_for

    return [row for seq, event in scored for row in rows_for(event, seq)["samples"]]


def write_shadow(run_dir: Path, algorithm_id: str, rows: list[dict[str, Any]]) -> Path:
    """``<run_dir>/lake/shadow_samples/<id>.parquet`` (written atomically)."""
    from replay.lake import to_frame

    shadow = RunPaths.at(run_dir).shadow_samples
    path = shadow / f"{check_token(algorithm_id, 'algorithm id')}.parquet"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    to_frame("samples", rows).write_parquet(tmp)
    tmp.replace(path)
    return path
