"""What a run looks like from the outside: a fold over its metrics, weights and stop events.

The launcher's live view, ``summary.json`` and ``curves.png`` all read this one object,
fed from the run's stream (metrics, weights, stop) and the headers of completed traces
and evals; the launcher's inference pool reads its replicas' busy shares here. Its metric tables are ``roles.lib.curves.MetricCurves``, the same fold as
``rlbus plot``'s.

Counts: ``rollouts`` are train rollouts, one per ``trace.completed`` message;
``eval_rollouts`` are the rollouts of eval tasks, k per ``eval.completed`` message
(``orchestrator.eval.k``), counted apart. Of the train rollouts the orchestrator has
folded, its heartbeat says how many can train, errored or were filtered
(``orchestrator_beat``): the rate and throughput count those that can train alone
(every completed one until the orchestrator first beats), and the errored and filtered
ones are shown beside it, so a run whose every rollout errors reads 0 rollouts/s.

Segments: a run interrupted and resumed (``rlbus up --resume``) is launched more than
once, and each launch's figures are a segment of ``summary.json`` (``Segment``): its
steps, its rollouts, its wall time and its active time (first to last train rollout, by
the server's timestamps), so its throughput is its own, not diluted by the pause or
inflated by the earlier launches' rollouts the follower reads back at start. Which
launch a message belongs to is told by its stream sequence: this launch's begin after
``resume_seq`` (the stream's newest when it started); the earlier launches' segments
come from the previous ``summary.json`` (``earlier``, up to ``covered_seq``), and what
lies between (a launch killed before it wrote a summary) is one segment rebuilt from the
log. The totals add the segments up: rollouts/s over their active time.

The fold takes only what can be true of the run, since anyone who can publish to the
run's subjects could otherwise set its reported steps or final digest (a forged
``weights.published`` at version 10**9 once did): a batch step (the orchestrator's
report of a batch) in 1..max_steps; a weights version in 1..the newest batch step (a
version ahead of it waits for its batch, since the two travel on different connections);
an eval result for a version up to the newest accepted weights. Anything else is
skipped with one log line and counted in the summary's ``rejected``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from bus.log import get_logger
from roles.lib.curves import MetricCurves
from schemas import (
    Event,
    MetricsReported,
    RunStarted,
    RunStopped,
    WeightsPublished,
    run_resumed_id,
    run_stopped_id,
)


@dataclass
class Segment:
    """One launch of a run, as far as the launcher's fold saw it (see the module docstring)."""

    start_step: int = 0
    end_step: int = 0
    rollouts: int = 0  # train rollouts completed in it
    first_rollout_ns: int | None = None  # the server's timestamps of its first and last
    last_rollout_ns: int | None = None
    wall_s: float | None = None  # the launcher's own clock; None: no launcher reported it
    ended: str | None = None  # why it ended: the run's stop reason, "interrupted by SIGINT"
    end_seq: int = 0  # the newest stream sequence it folded

    def rollout(self, n: int, ts_ns: int | None) -> None:
        self.rollouts += n
        if ts_ns is not None:
            self.first_rollout_ns = min(self.first_rollout_ns or ts_ns, ts_ns)
            self.last_rollout_ns = max(self.last_rollout_ns or ts_ns, ts_ns)

    @property
    def active_s(self) -> float | None:
        if self.first_rollout_ns is None or self.last_rollout_ns is None:
            return None
        return (self.last_rollout_ns - self.first_rollout_ns) / 1e9

    def figures(self, tokens_per_s: float | None = None) -> dict[str, Any]:
        """Its entry in ``summary.json``'s ``segments``."""
        active = self.active_s
        return {
            "start_step": self.start_step,
            "end_step": self.end_step,
            "steps": self.end_step - self.start_step,
            "wall_s": _rounded(self.wall_s, 1),
            "active_s": _rounded(active, 1),
            "rollouts": self.rollouts,
            "rollouts_per_s": round(self.rollouts / active, 2) if active else None,
            "trainer_tokens_per_s": _rounded(tokens_per_s, 1),
            "ended": self.ended,
            "end_seq": self.end_seq,
        }


def segment_totals(segments: list[dict[str, Any]], trainable: int | None = None) -> dict[str, Any]:
    """The run's times over ``segments``, added up without the pauses between them (a
    time no launcher reported counts as none), and its rollouts/s over the active time
    alone: the run's ``trainable`` rollouts (the orchestrator's count, which its fold
    rebuilds over every segment) over all of it, as a single launch's rate counts; without
    that count, the completed rollouts of the segments whose active time is known."""
    known = [s for s in segments if s.get("active_s")]
    active = sum(s["active_s"] for s in known)
    every = sum(s.get("active_s") or 0.0 for s in segments)
    if trainable is not None:
        rate = round(trainable / every, 2) if every else 0.0
    else:
        rate = round(sum(s["rollouts"] for s in known) / active, 2) if active else 0.0
    return {
        "wall_s": round(sum(s.get("wall_s") or 0.0 for s in segments), 1),
        "active_s": round(active, 1),
        "rollouts_per_s": rate,
    }


def earlier_segments(summary: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The segments a previous ``summary.json`` of the run recorded: its ``segments``, or
    one made of its totals (a summary written before rlbus kept segments); none without
    one."""
    if not summary:
        return []
    if isinstance(summary.get("segments"), list):
        return [dict(s) for s in summary["segments"]]
    stopped = summary.get("stopped") or {}
    interrupted = summary.get("interrupted")
    return [
        {
            "start_step": 0, "end_step": summary.get("steps") or 0,
            "steps": summary.get("steps") or 0, "wall_s": summary.get("wall_s"),
            "active_s": None, "rollouts": summary.get("rollouts") or 0,
            "rollouts_per_s": summary.get("rollouts_per_s"), "trainer_tokens_per_s": None,
            "ended": stopped.get("reason") or (f"interrupted by {interrupted}" if interrupted else None),
            "end_seq": None,
        }
    ]  # fmt: skip


@dataclass(kw_only=True)
class RunMonitor(MetricCurves):
    # The view and the summary report avg@k (``rlbus plot`` draws pass@k as well).
    eval_kinds: ClassVar[tuple[str, ...]] = ("avg@",)

    max_steps: int
    eval_k: int = 1  # rollouts per eval task (orchestrator.eval.k)
    started_at: float = field(default_factory=time.monotonic)
    policy_version: int = 0
    assembled: int = 0
    phase: str | None = None  # of the newest assembled batch: "sft" or "rl"
    rollouts: int = 0  # train rollouts: trace.completed messages
    eval_tasks: int = 0  # eval.completed messages, k rollouts each
    rollout_times: list[tuple[float, int]] = field(
        default_factory=list
    )  # (t, cumulative) for rates
    first_rollout_at: float | None = None
    stopped: RunStopped | None = None
    started: RunStarted | None = None
    segment: int = 0  # resumed starts folded (``rlbus up --resume`` with changed keys)
    final_digest: str | None = None
    announced: dict[int, str] = field(default_factory=dict)  # version -> its weights' event id
    rejected: int = 0  # events that cannot be true of the run (``why_rejected``), skipped
    undecodable: int = 0  # messages that are no readable event, skipped
    waiting: list[WeightsPublished] = field(default_factory=list)  # ahead of their batch
    # The orchestrator's rollout counts (its heartbeat's info; trainable None until it
    # first beats), (t, trainable) at each beat for the rate, and while it has them:
    # the most frequent error of rollouts that only error, and a stall's news.
    trainable: int | None = None
    errored: int = 0
    filtered: int = 0
    trainable_times: list[tuple[float, int]] = field(default_factory=list)
    trainable_last: float | None = None  # when the count last grew
    erroring: str = ""
    stall: str = ""  # "no batch for N s; waiting for: ..." while the run is stalled
    # Each inference replica's last busy share: producer -> (ts_ns, busy_frac). The
    # launcher's inference pool reads it (roles.up.pools); nothing else does.
    busy: dict[str, tuple[int, float]] = field(default_factory=dict)
    # Segments (see the module docstring): this launch's messages come after resume_seq;
    # ``earlier`` cover the log up to covered_seq; ``unrecorded`` is what lies between.
    resume_seq: int = 0
    covered_seq: int = 0
    earlier: list[dict[str, Any]] = field(default_factory=list)
    unrecorded: Segment = field(default_factory=Segment)
    current: Segment = field(default_factory=Segment)
    resumed_at_step: int | None = None  # the steps trained before this launch's first event

    def apply(self, event: Event) -> None:
        """Fold ``event`` if it can be true of the run (see the module docstring)."""
        if isinstance(event, WeightsPublished) and self.assembled < event.version <= self.max_steps:
            self.waiting.append(event)  # its batch report is on its way
            return
        if why := self.why_rejected(event):
            self.reject(event, why)
            return
        super().apply(event)  # the metric tables
        match event:
            case RunStarted():
                if self.started is not None:  # a resumed segment: the run goes on
                    self.segment += 1
                    self.stopped = None
                self.started = event
            case RunStopped(reason="max_steps", step=step) if step < self.max_steps:
                pass  # an earlier segment's: this launch trains on to a higher max_steps
            case RunStopped():
                self.stopped = event
            case WeightsPublished():
                self.announced[event.version] = event.event_id  # once: the orchestrator's rule
                self.policy_version = max(self.policy_version, event.version)
                if event.version >= self.policy_version:
                    self.final_digest = event.weights.digest
            case MetricsReported(role="inference") if "busy_frac" in event.values:
                self.busy[event.producer] = (event.ts_ns, event.values["busy_frac"])
            case MetricsReported(role="orchestrator") if event.step >= self.assembled:
                self.assembled = event.step
                self.phase = "sft" if event.values.get("sft") else "rl"
                for weights in [w for w in self.waiting if w.version <= self.assembled]:
                    self.waiting.remove(weights)
                    self.apply(weights)

    def why_rejected(self, event: Event) -> str | None:
        """Why ``event`` cannot be true of this run, given what was folded so far."""
        match event:
            case RunStarted() if self.started is not None and not (
                event.resumed and event.event_id == run_resumed_id(event.run, self.segment + 1)
            ):
                return "a second run.started"
            case RunStopped() if event.event_id != run_stopped_id(event.run, self.segment):
                return "a run.stopped that is not the orchestrator's"
            case WeightsPublished(version=v) if not 1 <= v <= min(self.assembled, self.max_steps):
                return f"weights version {v}, newest batch step {self.assembled}"
            case WeightsPublished(version=v) if v != event.step:
                return f"weights version {v} says it was trained at step {event.step}"
            case WeightsPublished(version=v) if (
                self.announced.get(v, event.event_id) != event.event_id
            ):
                return (
                    f"a second weights.published for version {v} (the first: {self.announced[v]})"
                )
            case MetricsReported(role="orchestrator", step=s) if not 1 <= s <= self.max_steps:
                return f"batch step {s}, max_steps {self.max_steps}"
            case MetricsReported(role="eval", step=v) if not 0 <= v <= self.policy_version:
                return f"eval of version {v}, newest weights version {self.policy_version}"
        return None

    def reject(self, event: Event, why: str) -> None:
        self.rejected += 1
        get_logger(run=self.run, role="launcher").warning(
            "monitor.rejected", type=type(event).__name__, event_id=event.event_id,
            producer=event.producer, why=why,
        )  # fmt: skip

    def unreadable(self, seq: int, subject: str, error: Exception) -> None:
        """A message that is no readable event: skipped (its durable owner dead-letters
        it; the launcher only watches)."""
        self.undecodable += 1
        get_logger(run=self.run, role="launcher").warning(
            "monitor.undecodable", seq=seq, subject=subject, error=repr(error)
        )

    def finish(self, ended: str | None = None, end_seq: int = 0) -> None:
        """The run is over (``ended``: why this launch ended; ``end_seq``: the newest
        sequence it folded): weights still waiting for their batch never had one."""
        waiting, self.waiting = self.waiting, []
        for weights in waiting:
            self.reject(weights, f"weights version {weights.version}, no batch step reported")
        if self.resumed_at_step is None:  # nothing of this launch reached the log
            self.resumed_at_step = self.policy_version
        self.current.ended = ended
        self.current.end_seq = max(end_seq, self.resume_seq)

    def passed(self, seq: int) -> None:
        """The fold of full events reached stream sequence ``seq``: the steps trained
        before this launch are known at its first message."""
        if self.resumed_at_step is None and seq > self.resume_seq:
            self.resumed_at_step = self.policy_version

    def segments(self) -> list[dict[str, Any]]:
        """The run's segments, first to last: the earlier summaries', a launch that left
        none (when it trained or rolled out), then this one."""
        start = self.resumed_at_step if self.resumed_at_step is not None else self.policy_version
        out = list(self.earlier)
        gap = self.unrecorded
        gap.start_step = min(start, out[-1]["end_step"] if out else 0)
        gap.end_step, gap.end_seq = start, self.resume_seq
        if gap.rollouts or gap.end_step > gap.start_step:
            out.append(gap.figures(self._tokens_per_s(gap)))
        now = self.current
        now.start_step, now.end_step = start, self.policy_version
        now.wall_s = time.monotonic() - self.started_at
        out.append(now.figures(self._tokens_per_s(now)))
        return out

    def _tokens_per_s(self, segment: Segment) -> float | None:
        """The trainer's tokens/s averaged over the segment's steps."""
        values = [
            v for step, v in self.series(self.trainer, "tokens_per_s")
            if segment.start_step < step <= segment.end_step
        ]  # fmt: skip
        return sum(values) / len(values) if values else None

    def trace_completed(self, n: int = 1, seq: int | None = None, ts_ns: int | None = None) -> None:
        """Count ``n`` train rollouts (``trace.completed`` messages; ``seq`` and ``ts_ns``:
        the stream sequence and the server's timestamp, for the segments)."""
        if seq is not None and seq <= self.resume_seq:  # an earlier launch's, read back
            if seq > self.covered_seq:
                self.unrecorded.rollout(n, ts_ns)
            self.rollouts += n  # in the total, not in this launch's rates
            return
        self.current.rollout(n, ts_ns)
        now = time.monotonic()
        if self.first_rollout_at is None:
            self.first_rollout_at = now
        self.rollouts += n
        self.rollout_times.append((now, self.rollouts))
        if len(self.rollout_times) > 200:
            del self.rollout_times[:100]

    def orchestrator_beat(self, info: Mapping[str, str], now: float | None = None) -> None:
        """Take the rollout counts and stall of the orchestrator's heartbeat ``info``
        (strings; counts that do not parse leave the last ones). Counts only grow: a
        restarted orchestrator counts again from 0 while it folds the log back."""
        now = time.monotonic() if now is None else now
        counts = {}
        for key in ("trainable_rollouts", "errored_rollouts", "filtered_rollouts"):
            try:
                counts[key] = int(info[key])
            except (KeyError, ValueError):
                return
        trainable = max(self.trainable or 0, counts["trainable_rollouts"])
        if trainable > (self.trainable or 0):
            self.trainable_last = now
        self.trainable = trainable
        self.errored = max(self.errored, counts["errored_rollouts"])
        self.filtered = max(self.filtered, counts["filtered_rollouts"])
        self.trainable_times.append((now, trainable))
        if len(self.trainable_times) > 200:
            del self.trainable_times[:100]
        self.erroring = info.get("erroring", "")
        stalled = info.get("stalled_s")
        self.stall = (
            f"no batch for {stalled} s; waiting for: {info.get('waiting_for') or '?'}"
            if stalled
            else ""
        )

    def eval_completed(self, n: int = 1) -> None:
        """Count ``n`` finished eval tasks (``eval.completed`` messages, k rollouts each)."""
        self.eval_tasks += n

    # -- derived views ------------------------------------------------------------------

    @property
    def eval_rollouts(self) -> int:
        return self.eval_tasks * self.eval_k

    def phase_label(self) -> str:
        """What the run is doing: starting (roles loading, no ``run.started`` yet), the
        warm start, RL, or stopped."""
        if self.stopped is not None:
            return f"stopped ({self.stopped.reason})"
        if self.started is None:
            return "starting"
        phase = self.phase or ("sft" if self.warmup_steps > 0 else "rl")
        return "warm start (sft)" if phase == "sft" else "rl"

    def mean_rollouts_per_s(self) -> float:
        """Train rollouts per second from the first one to the last one: those that can
        train once the orchestrator has said how many (see the module docstring)."""
        if self.first_rollout_at is None or not self.rollout_times:
            return 0.0
        if self.trainable is not None:
            if not self.trainable or self.trainable_last is None:
                return 0.0
            span = self.trainable_last - self.first_rollout_at
            return self.trainable / span if span > 0 else 0.0
        span = self.rollout_times[-1][0] - self.first_rollout_at
        return self.rollouts / span if span > 0 else 0.0

    def mean_tokens_per_s(self) -> float | None:
        """The trainer's tokens/s, averaged over its steps."""
        values = [v for _, v in self.series(self.trainer, "tokens_per_s")]
        return sum(values) / len(values) if values else None

    def rollouts_per_s(self, window: float = 20.0) -> float:
        """Train rollouts per second over the last ``window`` seconds (those that can
        train, once the orchestrator has said how many)."""
        now = time.monotonic()
        times = self.rollout_times if self.trainable is None else self.trainable_times
        recent = [(t, n) for t, n in times if now - t <= window]
        if len(recent) < 2:
            return 0.0
        (t0, n0), (t1, n1) = recent[0], recent[-1]
        return (n1 - n0) / max(1e-6, t1 - t0)

    def last(self, table: dict[int, dict[str, float]], key: str) -> float | None:
        s = self.series(table, key)
        return s[-1][1] if s else None

    def summary(self) -> dict[str, Any]:
        warm = self.warmup_steps
        evals = {k: self.series(self.eval, k) for k in self.eval_keys()}
        out: dict[str, Any] = {
            "run": self.run,
            "stopped": None
            if self.stopped is None
            else {"reason": self.stopped.reason, "detail": self.stopped.detail},
            "steps": self.policy_version,
            "wall_s": round(time.monotonic() - self.started_at, 1),
            "rollouts": self.rollouts,
            "eval_rollouts": self.eval_rollouts,
            "rollouts_per_s": round(self.mean_rollouts_per_s(), 2),
            # None: the orchestrator never said (rollouts_per_s then counts every one)
            "trainable_rollouts": self.trainable,
            "errored_rollouts": self.errored if self.trainable is not None else None,
            "filtered_rollouts": self.filtered if self.trainable is not None else None,
            "trainer_tokens_per_s": _rounded(self.mean_tokens_per_s(), 1),
            "warmup_steps": warm,
            "final_weights_digest": self.final_digest,
            "rejected": self.rejected + len(self.waiting),
            "undecodable": self.undecodable,
            "eval": {str(v): m for v, m in sorted(self.eval.items())},
            "train_reward": dict(self.series(self.train, "reward_mean")),
            "loss": dict(self.series(self.trainer, "loss")),
        }
        out["segments"] = segments = self.segments()
        if len(segments) > 1:  # resumed: the run's totals, over its launches' own times
            out.update(segment_totals(segments, self.trainable))
        for key, points in evals.items():
            at = dict(points)
            after_warm = at.get(warm) if warm else at.get(0)
            final = points[-1][1] if points else None
            out[f"{key}:start"] = at.get(0)
            out[f"{key}:after_warm_start"] = after_warm
            out[f"{key}:final"] = final
            if after_warm is not None and final is not None:
                out[f"{key}:gain"] = round(final - after_warm, 4)
        return out


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(
    values: list[float], width: int = 30, lo: float | None = None, hi: float | None = None
) -> str:
    """The last ``width`` values as bars from ``lo`` to ``hi`` (default: their range)."""
    values = values[-width:]
    if not values:
        return ""
    lo = min(values) if lo is None else lo
    hi = max(values) if hi is None else hi
    span = hi - lo or 1.0
    return "".join(
        SPARKS[max(0, min(len(SPARKS) - 1, int((v - lo) / span * (len(SPARKS) - 1))))]
        for v in values
    )


def score_sparkline(values: list[float], width: int = 30) -> str:
    """A sparkline of rewards or eval scores on a fixed 0..1 scale when every value lies
    in it (0.000 -> 0.016 is two low bars, not a leap to the top); else their range."""
    in_unit = all(0.0 <= v <= 1.0 for v in values[-width:])
    return sparkline(values, width, *((0.0, 1.0) if in_unit else (None, None)))
