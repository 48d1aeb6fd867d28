"""Deterministic trainer replay: the recorded batches through a fresh ``TrainerCore``.

    rlbus replay <run> trainer [--until STEP]
    rlbus replay <run> trainer --fork NEW --from STEP trainer.lr=0.01

The trainer is a pure fold (``roles.trainer.core``): its state after step ``s`` depends
only on the config, the initial weights and batches ``1..s``. So replay needs no
inference and no env server: ``run.started`` gives the config and the initial weights
(checked against their recorded digest, restored from the object store when the
directory is gone: ``replay.portable.locate_model_dir``), ``batch.assembled`` the batches,
and every step's deterministic metrics and weights digest are compared bit for bit with
the recorded ``metrics.reported.trainer`` and ``weights.published``. Replay runs on the
CPU whatever the run used (GPU kernels are not bit-exact), with the run's intra-op
thread count (the trainer records it in its metrics, ``threads``: the CPU plan of
``rlbus up`` may have given it more than one).

The config in force for a batch is that of the newest ``run.started`` before it in the
log; a later one (``resumed=True``) changes the config from that point on. A trainer
started before trainers could share prefixes (``trainer.shared_prefix``: its steps report
no ``computed_tokens``) trained whole rows, and is replayed so. A fork uses
exactly that: it replays steps ``1..STEP`` (checked), then trains the recorded batches
after ``STEP`` under the changed config, and records itself as run ``NEW``: the copied
``run.started`` (the original config), the copied batches and orchestrator metrics, a
``run.started`` with ``resumed=True`` and the changed config before step ``STEP + 1``, the
fork's own ``weights.published`` (weights in ``RLOBJ_<NEW>``: the initial ones and the
newest ``trainer.keep_weights`` versions, as the trainer keeps them) and trainer metrics, and a
``run.stopped`` (reason ``fork``) naming the origin. ``rlbus events``/``sql``/``plot`` read
it like any run, and ``rlbus replay NEW trainer`` reproduces it.

A batch the trainer refused (``roles.trainer.core.batch_problem``) is stepped over as the
trainer did (``refuse_step``: a step that trained nothing, ``refused_batch=1``), and a
non-finite step is dropped as it was, so both replay bit for bit.

Reading the log and training take ``on_progress(done, total)``: messages read, then
steps trained of those to train (``rlbus replay`` draws both).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from bus.offload import sha256_digest
from bus.reader import Progress, read_log
from bus.runtime import Bus
from bus.subjects import Topic
from configs import RunConfig, apply_overrides, resolve
from replay.diff import Mismatch, StepRecord, diff_step, first_series_divergence
from roles.lib.threads import THREADS_ENV
from roles.trainer import retention
from schemas import (
    BatchAssembled,
    Event,
    MetricsReported,
    ObjectRef,
    RunStarted,
    RunStopped,
    WeightsPublished,
    WeightsStored,
    derive_id,
)


class ReplayError(Exception):
    """The run cannot be replayed as asked (no run.started, no weights, a gap, a bad step)."""


@dataclass
class TrainerLog:
    """What trainer replay reads: the run's starts, batches and recorded steps."""

    starts: list[tuple[int, RunStarted]]  # (seq, event), log order; [0] started the run
    batches: list[BatchAssembled]  # one per step (the first recorded), in step order
    batch_seq: dict[int, int]  # step -> stream seq of its batch
    recorded: dict[int, StepRecord]  # trainer metrics + weights digest per step
    orchestrator: dict[int, MetricsReported] = field(default_factory=dict)
    _cache: dict[tuple[str, tuple[str, ...]], RunConfig] = field(default_factory=dict)

    @property
    def started(self) -> RunStarted:
        return self.starts[0][1]

    def start_for(self, step: int) -> RunStarted:
        """The newest ``run.started`` before the batch of ``step`` (the last one if none)."""
        seq = self.batch_seq.get(step)
        before = [e for s, e in self.starts if seq is None or s < seq]
        return (before or [self.started])[-1]

    def config(self, step: int = 1, overrides: Sequence[str] = ()) -> RunConfig:
        """The config in force for ``step`` (plus ``overrides``), forced onto the CPU."""
        return self.config_of(self.start_for(step), overrides)

    @property
    def threads(self) -> int | None:
        """The trainer's intra-op threads per rank as recorded (the CPU plan's), None for
        a run recorded before trainers reported them (they ran on one)."""
        first = self.recorded.get(min(self.recorded, default=0))
        threads = first.metrics.get("threads") if first is not None else None
        return int(threads) if threads else None

    @property
    def world_size(self) -> int | None:
        """The trainer's ranks as recorded (``rlbus role trainer --nproc`` may differ from
        the config), None for a run recorded before trainers reported it."""
        first = self.recorded.get(min(self.recorded, default=0))
        size = first.metrics.get("world_size") if first is not None else None
        return int(size) if size else None

    def shared_prefix(self, start: RunStarted) -> bool:
        """Whether the trainer that ``start`` started could share prefixes
        (``trainer.shared_prefix``): not one of before it could, which trained whole rows
        whatever the config said, and reported no ``computed_tokens`` (a refused step
        never reports it)."""
        mine = [r for s, r in self.recorded.items() if self.start_for(s) is start]
        trained = [r for r in mine if "refused_batch" not in r.metrics]
        return not trained or any("computed_tokens" in r.metrics for r in trained)

    def config_of(self, start: RunStarted, overrides: Sequence[str] = ()) -> RunConfig:
        key = (start.event_id, tuple(overrides))
        if key not in self._cache:
            ranks = [f"trainer.world_size={self.world_size}"] if self.world_size else []
            whole = [] if self.shared_prefix(start) else ["trainer.shared_prefix=false"]
            raw = apply_overrides(start.config, [*ranks, *whole, *overrides, "trainer.device=cpu"])
            self._cache[key] = resolve(raw, source=f"run.started {start.event_id} of {start.run}")
        return self._cache[key]


def _trained(
    found: list[tuple[int, BatchAssembled]], weights: WeightsPublished | None
) -> tuple[int, BatchAssembled]:
    named = weights.batch_id if weights is not None else None
    return next((x for x in found if x[1].event_id == named), found[0])


async def read_trainer_log(bus: Bus, on_progress: Progress | None = None) -> TrainerLog:
    starts: list[tuple[int, RunStarted]] = []
    candidates: dict[int, list[tuple[int, BatchAssembled]]] = {}
    metrics: dict[int, MetricsReported] = {}
    orch: dict[int, MetricsReported] = {}
    weights: dict[int, WeightsPublished] = {}
    stored: dict[int, str] = {}  # a version's bytes stored after its announcement: digest
    topics = [(Topic.RUN_STARTED, None), (Topic.BATCH_ASSEMBLED, None),
              (Topic.WEIGHTS_PUBLISHED, None), (Topic.WEIGHTS_STORED, None),
              (Topic.METRICS_REPORTED, "trainer"), (Topic.METRICS_REPORTED, "orchestrator")]  # fmt: skip
    types = (RunStarted, BatchAssembled, WeightsPublished, WeightsStored, MetricsReported)
    async for seq, event in read_log(bus, topics, types, with_seq=True, on_progress=on_progress):
        # The first record of a step wins: a republished one (a restarted role) is a copy.
        match event:
            case RunStarted():
                starts.append((seq, event))
            case BatchAssembled():
                candidates.setdefault(event.step, []).append((seq, event))
            case WeightsPublished():
                weights.setdefault(event.step, event)
            case WeightsStored():
                stored.setdefault(event.step, event.weights.digest)
            case MetricsReported(role="trainer"):
                metrics.setdefault(event.step, event)
            case MetricsReported(role="orchestrator"):
                orch.setdefault(event.step, event)
    if not starts:
        raise ReplayError(f"run {bus.run!r} has no run.started event: nothing to replay from")
    # A step's batch is the one its weights name (what the trainer trained; a forged batch
    # of the same step, dead-lettered live, is not), else the first recorded one.
    batches = {s: _trained(found, weights.get(s)) for s, found in candidates.items()}
    weights = {s: w for s, w in weights.items() if s in batches}  # no batch: not a step
    recorded = {
        s: StepRecord(
            s,
            dict(metrics[s].values) if s in metrics else {},
            weights[s].weights.digest if s in weights else None,
            stored.get(s) if s in weights else None,
        )
        for s in sorted(set(metrics) | set(weights))
    }
    steps = sorted(batches)
    return TrainerLog(
        starts, [batches[s][1] for s in steps], {s: batches[s][0] for s in steps}, recorded, orch
    )


@dataclass
class ReplayResult:
    steps: list[StepRecord] = field(default_factory=list)  # replayed, in order
    divergence: list[Mismatch] | None = None  # mismatches of the first differing step
    stopped: str = ""  # why the replay ended before the last batch, if it did
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.divergence is None


StepCallback = Callable[[StepRecord, list[Mismatch]], None]


def make_core(cfg: RunConfig, model_dir: Path, threads: int | None = None) -> Any:
    """A fresh trainer on the CPU, on ``trainer.world_size`` ranks (gloo) like the run,
    each with the run's ``threads`` (float sums depend on the split; None: the
    environment's ``RLBUS_TORCH_THREADS``); the caller closes it. Torch loads here."""
    from roles.trainer.group import make_trainer, start_ranks

    with _torch_threads(threads):  # read by the core and inherited by rank processes
        return make_trainer(cfg, model_dir, start_ranks(cfg, model_dir, "cpu"), device="cpu")


@contextlib.contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    if threads is None:
        yield
        return
    before = os.environ.get(THREADS_ENV)
    os.environ[THREADS_ENV] = str(threads)
    try:
        yield
    finally:
        if before is None:
            del os.environ[THREADS_ENV]
        else:
            os.environ[THREADS_ENV] = before


def replay_steps(
    core: Any,
    batches: Sequence[BatchAssembled],
    recorded: dict[int, StepRecord] | None,
    until: int | None = None,
    on_step: StepCallback | None = None,
    keep: dict[int, bytes] | None = None,
    config_for: Callable[[int], RunConfig] | None = None,
    on_progress: Progress | None = None,
) -> ReplayResult:
    """Train ``batches`` in order from ``core``'s step; compare with ``recorded`` if given.

    With ``recorded`` it stops at the first step that differs, and before a batch the
    original trainer never announced (assembled after the run's last step). ``keep``
    collects each step's weights; ``config_for(step)`` switches the config when it changes.
    ``on_progress(steps trained, batches after core's step up to ``until``)``.
    """
    from roles.trainer.core import take_step  # torch loads with the core

    result = ReplayResult()
    start = time.perf_counter()
    todo = sum(1 for b in batches if b.step > core.step and (until is None or b.step <= until))
    for batch in batches:
        if batch.step <= core.step:
            continue
        if until is not None and batch.step > until:
            break
        if batch.step != core.step + 1:
            raise ReplayError(f"the log has no batch for step {core.step + 1} (next: {batch.step})")
        if recorded is not None and batch.step not in recorded:
            result.stopped = f"batch {batch.step} was never trained in the recorded run"
            break
        if config_for is not None and (cfg := config_for(batch.step)) is not core.cfg:
            core.reconfigure(cfg)
        metrics, _ = take_step(core, batch)  # the role's own step (a refused batch too)
        data = core.weights_bytes()
        was = recorded.get(batch.step) if recorded is not None else None
        stored = was is not None and was.stored_digest is not None
        rec = StepRecord(
            batch.step, metrics, _digest(core, data, recorded, batch.step),
            sha256_digest(data) if stored else None,
        )  # fmt: skip
        if keep is not None:
            keep[batch.step] = data
        result.steps.append(rec)
        found = diff_step(recorded[batch.step], rec) if recorded is not None else []
        if on_step is not None:
            on_step(rec, found)
        if on_progress is not None:
            on_progress(len(result.steps), todo)
        if found:
            result.divergence = found
            break
    result.wall_s = time.perf_counter() - start
    return result


def _digest(core: Any, data: bytes, recorded: dict[int, StepRecord] | None, step: int) -> str:
    """The replayed weights' digest, of the kind recorded: of the bytes, or of the
    shared device ring's copy for a version only shared (``trainer.weights_via = "ipc"``:
    "dev:<dtype>:...")."""
    was = recorded[step].digest if recorded is not None and step in recorded else None
    if was is not None and was.startswith("dev:"):
        from roles.lib.model.shared_weights import state_digest

        return state_digest(core.model.state_dict(), was)
    return sha256_digest(data)


def replay_run(
    log: TrainerLog,
    model_dir: Path,
    until: int | None = None,
    on_step: StepCallback | None = None,
    on_progress: Progress | None = None,
) -> ReplayResult:
    """The whole check: a fresh core, every recorded step compared."""
    core = make_core(log.config(1), model_dir, log.threads)
    try:
        return replay_steps(
            core, log.batches, log.recorded, until, on_step, config_for=log.config,
            on_progress=on_progress,
        )  # fmt: skip
    finally:
        core.close()


# -- forks ------------------------------------------------------------------------------


@dataclass
class ForkResult:
    prefix: ReplayResult  # the exact replay of steps 1..from
    fork: ReplayResult  # the changed steps after it
    config: RunConfig  # the fork's config after ``from``
    first_difference: list[Mismatch] | None = None  # first fork step differing from the original
    first_loss_difference: list[Mismatch] | None = None
    weights: dict[int, bytes] = field(default_factory=dict)  # weights after each step

    @property
    def steps(self) -> list[StepRecord]:
        return self.prefix.steps + self.fork.steps


def run_fork(
    log: TrainerLog,
    model_dir: Path,
    from_step: int,
    overrides: Sequence[str],
    until: int | None = None,
    on_step: StepCallback | None = None,
    on_fork_step: StepCallback | None = None,
    on_progress: Progress | None = None,
) -> ForkResult:
    """Replay steps ``1..from_step`` exactly, then the later batches under ``overrides``
    (``on_progress`` counts the steps of both)."""
    if not 0 <= from_step <= len(log.batches):
        raise ReplayError(f"--from {from_step} is outside the run's steps 0..{len(log.batches)}")
    cfg = log.config(from_step + 1, overrides)
    core = make_core(log.config(1), model_dir, log.threads)
    try:
        return _fork(log, core, cfg, from_step, until, on_step, on_fork_step, on_progress)
    finally:
        core.close()


def _fork(
    log: TrainerLog, core: Any, cfg: RunConfig, from_step: int, until: int | None,
    on_step: StepCallback | None, on_fork_step: StepCallback | None,
    on_progress: Progress | None,
) -> ForkResult:  # fmt: skip
    kept: dict[int, bytes] = {}
    total = sum(1 for b in log.batches if until is None or b.step <= until)

    def steps_of_both(offset: int) -> Progress | None:
        return None if on_progress is None else lambda done, _: on_progress(offset + done, total)

    prefix = replay_steps(
        core, log.batches, log.recorded, from_step, on_step, kept, log.config, steps_of_both(0)
    )
    if not prefix.ok or core.step != from_step:
        return ForkResult(prefix, ReplayResult(), cfg, weights=kept)
    core.reconfigure(cfg)
    fork = replay_steps(
        core, log.batches, None, until, on_fork_step, kept,
        on_progress=steps_of_both(len(prefix.steps)),
    )  # fmt: skip
    return ForkResult(
        prefix, fork, cfg, first_series_divergence(log.recorded, fork.steps),
        first_series_divergence(log.recorded, fork.steps, "loss"), kept,
    )  # fmt: skip


async def publish_fork(
    bus: Bus, log: TrainerLog, result: ForkResult, from_step: int, overrides: Sequence[str],
    model_dir: Path, initial: bytes | None,
) -> int:  # fmt: skip
    """Record ``result`` as the new run ``bus.run``; returns the number of events.

    ``initial`` is the bytes of the initial weights (the fork's ``weights.v0``)."""
    state = await bus.stream_state()
    if state is not None and state.messages:
        raise ReplayError(f"run {bus.run!r} already exists: choose another --fork name")
    await bus.ensure_stream()
    dropped = retention.collectable(
        result.weights, max(result.weights, default=0), result.config.trainer.keep_weights
    )
    refs = {
        step: await _store(bus, retention.object_name(step), data, put=step not in dropped)
        for step, data in sorted(result.weights.items())
    }
    start_ref = (
        await _store(bus, retention.object_name(0), initial) if initial is not None else None
    )
    events = fork_events(bus.run, log, result, from_step, overrides, refs, start_ref, model_dir)
    await bus.publish_many(events)
    return len(events)


async def _store(bus: Bus, name: str, data: bytes, put: bool = True) -> ObjectRef:
    """The reference to ``data`` as object ``name``; stored unless ``put`` is False (a
    version the trainer would already have collected: announced, digest recorded)."""
    digest = await bus.objects.put(name, data) if put else sha256_digest(data)
    return ObjectRef(kind="object", location=name, bucket=bus.objects.bucket, size=len(data), digest=digest)  # fmt: skip


def fork_events(
    new: str, log: TrainerLog, result: ForkResult, from_step: int, overrides: Sequence[str],
    refs: dict[int, ObjectRef], initial: ObjectRef | None, model_dir: Path,
) -> list[Event]:  # fmt: skip
    """The fork's log: the original's starts and batches up to ``from_step``, the fork's
    start, then per step the batch, orchestrator metrics, weights and trainer metrics."""

    def start(cfg: RunConfig, event_id: str, cause: str, resumed: bool) -> RunStarted:
        raw = {**cfg.model_dump(mode="json"), "run": new}
        return RunStarted(
            run=new, event_id=event_id, causation_id=cause, config=raw, seed=cfg.seed,
            model_path=str(model_dir), initial_weights=initial, resumed=resumed,
            producer="replay-fork",
        )  # fmt: skip

    out: list[Event] = []
    emitted: set[str] = set()
    by_step = {b.step: b for b in log.batches}
    for rec in result.steps:
        if rec.step <= from_step:  # the original's config changes, as they happened
            for seq, e in log.starts:
                if e.event_id not in emitted and seq < log.batch_seq[rec.step]:
                    emitted.add(e.event_id)
                    out.append(start(log.config_of(e), derive_id(new, e.event_id), e.event_id, bool(emitted - {e.event_id})))  # fmt: skip
        elif "fork" not in emitted:
            emitted.add("fork")
            cause = log.start_for(rec.step).event_id
            out.append(start(result.config, derive_id(new, "fork", from_step), cause, len(emitted) > 1))  # fmt: skip
        batch = msgspec.structs.replace(by_step[rec.step], run=new)
        out.append(batch)
        if (orch := log.orchestrator.get(rec.step)) is not None:
            out.append(msgspec.structs.replace(orch, run=new))
        out.append(WeightsPublished(
            run=new, event_id=derive_id(new, batch.event_id, "weights"), causation_id=batch.event_id,
            version=rec.step, step=rec.step, weights=refs[rec.step], batch_id=batch.event_id,
            producer="replay-fork",
        ))  # fmt: skip
        out.append(MetricsReported(
            run=new, event_id=derive_id(new, batch.event_id, "metrics"), causation_id=batch.event_id,
            role="trainer", step=rec.step, values=dict(rec.metrics), policy_version=rec.step,
            producer="replay-fork",
        ))  # fmt: skip
    last = result.steps[-1].step if result.steps else 0
    out.append(RunStopped(
        run=new, event_id=derive_id(new, "stopped"), reason="fork", step=last, producer="replay-fork",
        detail=f"fork of run {log.started.run} from step {from_step} with {list(overrides)}: "
        f"steps 1..{last} trained on the original's recorded batches",
    ))  # fmt: skip
    return out
