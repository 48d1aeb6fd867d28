"""The orchestrator's state: a fold over the run's events, nothing else.

``OrchestratorState.apply(event)`` is the only way state changes. The orchestrator
applies its own decisions the moment it makes them and recognises them by id when they
come back on the stream, so replaying the log from sequence 1 rebuilds exactly the
state, and the decisions, of the original run (see ``roles/orchestrator/role.py``).

``check(event)`` runs before ``apply`` on everything read from the log and says why an
event is impossible (the role dead-letters it; a restart or replay refuses the same
ones, since the check is a function of the fold so far). The rule that catches most
forgeries: the orchestrator's own decisions are always folded before they are read back
(live, applied when made; on a restart, re-made from the same prefix of the log), so a
batch, a train or eval dispatch or an eval report it has not made is not its own.

A run resumed with changed keys (``rlbus up --resume max_steps=600``) has a later start
on its log, ``resumed=True`` with the id ``run_resumed_id``: it opens the run's next
segment, in which an earlier stop no longer holds. The role decides under the config of
the newest start folded, so the log before it is re-decided exactly as it was.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

import msgspec

from bus.subjects import is_token
from roles.orchestrator.merge import merge_scored
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
    WeightsPublished,
    run_resumed_id,
    run_stopped_id,
)


@dataclass
class Group:
    """A train group dispatched and not yet fully scored."""

    request: TaskRequested
    waiting_for: set[str]  # algorithm ids whose samples this group still needs
    received: dict[str, SamplesScored] = field(default_factory=dict)  # by algorithm id
    failed: list[str] = field(default_factory=list)  # "<algorithm>: <reason>"


@dataclass
class Queued:
    sample: Sample
    group_id: str
    sources: tuple[str, ...]  # the SamplesScored event ids merged into it
    group_reward: float  # mean reward of its group (for metrics)


@dataclass
class EvalRound:
    version: int
    expected: int  # eval requests dispatched
    results: list[EvalCompleted] = field(default_factory=list)
    reported: bool = False
    dead: int = 0  # requests an env server dead-lettered (never answered)

    @property
    def answered(self) -> int:
        return len(self.results) + self.dead


@dataclass
class OrchestratorState:
    # which algorithms' samples train an env's groups: {"rl": {env: {...}}, "sft": {env: {...}}};
    # starts from the config, then algorithm.attached/detached events change it
    trains_on: dict[str, dict[str, set[str]]]
    started: RunStarted | None = None  # the newest of the run's starts: its config is in force
    stopped: RunStopped | None = None
    # Resumed starts folded (``run_resumed_id``): each opens a segment that goes on after a
    # stop (``rlbus up --resume max_steps=...`` trains a finished run on), whose own stop
    # has the segment's id (``run_stopped_id``).
    segment: int = 0
    trainer_version: int = 0  # newest WeightsPublished version
    assembled: int = 0  # step of the newest batch
    batches: dict[int, str] = field(default_factory=dict)  # step -> its batch's event id
    announced: dict[int, str] = field(default_factory=dict)  # version -> its weights' event id
    dispatched: int = 0  # train groups dispatched so far (the group counter)
    groups: dict[str, Group] = field(default_factory=dict)  # in flight, by group id
    queues: dict[str, deque[Queued]] = field(
        default_factory=lambda: {"sft": deque(), "rl": deque()}
    )
    eval_rounds: dict[int, EvalRound] = field(default_factory=dict)
    eval_requests: dict[str, int] = field(default_factory=dict)  # request id -> policy version
    seen: set[tuple[str, str]] = field(default_factory=set)  # (event type, event id)
    # counters since the last batch (reported in it), and over the run
    dropped_stale: int = 0
    skipped_zero: int = 0
    total_dropped_stale: int = 0
    total_skipped_zero: int = 0
    no_signal_streak: int = 0  # consecutive RL groups without learning signal
    errored_rollouts: int = 0
    filtered_rollouts: int = 0  # kept out of training by an enforcing rollout filter
    trainable_rollouts: int = 0  # neither errored nor filtered (zero-advantage ones too)
    # Errored rollouts since the last group with a trainable one, and what they said
    # (``SamplesScored.excluded_errors``) with the env and model of the newest: what the
    # error stop names (``policy.error_stop``).
    error_streak: int = 0
    streak_errors: Counter[str] = field(default_factory=Counter)
    streak_source: str = ""  # "env <key>, model <key>" of the newest errored group
    filtered_groups: int = 0  # RL groups whose every rollout was filtered
    # RL groups in a row whose every rollout was filtered, and the filters that flagged
    # them (``SamplesScored.filtered_by``): what the filter stop names (``policy.stop``).
    filtered_streak: int = 0
    streak_filters: Counter[str] = field(default_factory=Counter)
    # Since the last RL batch: rollouts scored, those that could train, and the filters
    # that kept the others out (``policy.trainable_share``).
    batch_rollouts: int = 0
    batch_trainable: int = 0
    batch_filters: Counter[str] = field(default_factory=Counter)
    released: int = 0  # groups closed without training (an algorithm failed, a deadline)
    last_release: str = ""  # why the newest one was released
    # Own task requests an env server dead-lettered (env code raised, or it could not
    # take them): each releases its group or closes its eval request; enough stop the run.
    env_failures: list[DeadLettered] = field(default_factory=list)

    def inflight(self, phase: str) -> int:
        return sum(1 for g in self.groups.values() if g.request.phase == phase)

    def check(self, event: Event) -> str | None:
        """Why ``event``, read from the log, cannot be folded (None: it can)."""
        if self.has_seen(event):
            return None  # our own decision coming back, or a duplicate: apply skips it
        match event:
            case RunStarted() if self.started is not None and not self.resumes(event):
                return f"a second run.started (the run started with {self.started.event_id})"
            case AlgorithmAttached() if not event.name or not is_token(event.algorithm):
                return f"algorithm.attached with no algorithm name or a bad id {event.algorithm!r}"
            case RunStopped() if event.event_id != run_stopped_id(event.run, self.segment):
                return "a run.stopped that is not the orchestrator's"
            case TaskRequested(phase="rl" | "sft" | "eval"):
                return f"a {event.phase} task.requested this run's orchestrator did not dispatch"
            case BatchAssembled():
                return f"batch.assembled step {event.step} this run's orchestrator did not assemble"
            case MetricsReported(role="eval"):
                return f"an eval report for version {event.step} this orchestrator did not make"
            case WeightsPublished():
                return self._not_the_trainers(event)
            case SamplesScored():  # expected or not (a shadow's): bad samples never pass
                return next(
                    (
                        f"sample {i} of group {event.group_id}: {problem}"
                        for i, x in enumerate(event.samples)
                        if (problem := x.problem() or _foreign(x, event)) is not None
                    ),
                    None,
                )
        return None

    def _not_the_trainers(self, event: WeightsPublished) -> str | None:
        """Why ``event`` is not the trainer's one announcement of its version: a version
        is trained on the batch this orchestrator assembled as that step, and announced
        once (a second announcement, e.g. with other bytes, would make two versions v)."""
        v = event.version
        if not 1 <= v <= self.assembled:
            return f"weights.published version {v}, but the newest batch is step {self.assembled}"
        if event.step != v:
            return f"weights.published version {v} says it was trained at step {event.step}"
        if event.batch_id != (ours := self.batches.get(v)):
            return f"weights.published version {v} names batch {event.batch_id}, not step {v}'s ({ours})"
        if (first := self.announced.get(v)) is not None:
            return f"a second weights.published for version {v} (the first: {first})"
        return None

    def resumes(self, event: RunStarted) -> bool:
        """Whether ``event`` is the orchestrator's start of the run's next segment."""
        return event.resumed and event.event_id == run_resumed_id(event.run, self.segment + 1)

    def has_seen(self, event: Event) -> bool:
        return (type(event).__name__, event.event_id) in self.seen

    def fail_group(self, event: SamplesScored, reason: str) -> None:
        """``event``'s algorithm cannot score its group (its samples were refused): the
        group stops waiting for it and is released once nothing else is pending."""
        self.apply(msgspec.structs.replace(event, samples=[], failed=reason))

    def apply(self, event: Event, *, skip_zero: bool = True) -> None:
        """Fold one event into the state (idempotent by event type and id)."""
        if self.has_seen(event):
            return
        self.seen.add((type(event).__name__, event.event_id))
        match event:
            case RunStarted():
                if self.started is not None:  # a resumed segment (``check`` let it in)
                    self.segment += 1
                    self.stopped = None  # the run goes on under the new config
                self.started = event
            case RunStopped():
                self.stopped = event
            # Only its own requests: `rlbus rollout`/`rlbus eval` put "adhoc" ones on a live
            # run's log, which must not become groups to train or eval rounds to report.
            case TaskRequested(task=task, phase="rl" | "sft") if task.split == "train":
                self.dispatched += 1
                algorithms = set(event.algorithms) or set(
                    self.trains_on[event.phase].get(event.env, ())
                )
                self.groups[event.group_id] = Group(event, waiting_for=algorithms)
            case TaskRequested(phase="eval"):
                round_ = self.eval_rounds.setdefault(
                    event.policy_version, EvalRound(event.policy_version, 0)
                )
                round_.expected += 1
                self.eval_requests[event.event_id] = event.policy_version
            case SamplesScored():
                self._on_scored(event, skip_zero)
            case AlgorithmAttached(shadow=False):
                for env, ids in self.trains_on["rl"].items():
                    if not event.envs or env in event.envs:
                        ids.add(event.algorithm)
            case AlgorithmDetached():
                for ids in self.trains_on["rl"].values():
                    ids.discard(event.algorithm)
                for gid, group in list(self.groups.items()):
                    if event.algorithm in group.waiting_for and group.request.phase == "rl":
                        group.waiting_for.discard(event.algorithm)
                        if not group.waiting_for:
                            self._complete(gid, skip_zero)
            case BatchAssembled():
                self.assembled = max(self.assembled, event.step)
                self.batches[event.step] = event.event_id
                self.dropped_stale = self.skipped_zero = 0  # counters are "since the last batch"
                used = {(s.rollout_id, s.branch) for s in event.samples}
                q = self.queues[event.phase]
                self.queues[event.phase] = deque(
                    x for x in q if (x.sample.rollout_id, x.sample.branch) not in used
                )
            case WeightsPublished():
                self.trainer_version = max(self.trainer_version, event.version)
                self.announced[event.version] = event.event_id
            case MetricsReported(role="eval", step=version) if version in self.eval_rounds:
                self.eval_rounds[version].reported = True
            case EvalCompleted():
                asked = self.eval_requests.pop(event.request_id, None)
                if asked is not None:  # None: a duplicate answer to a request already counted
                    self.eval_rounds[asked].results.append(event)
            case DeadLettered(role="env"):
                self._on_env_dead_letter(event)

    def _on_env_dead_letter(self, event: DeadLettered) -> None:
        """An env server dead-lettered a task: its group is released (nothing of it
        trains), an eval request counts as answered with nothing; only the orchestrator's
        own requests count (the causation id is the request's event id)."""
        request_id = event.causation_id
        group = next((g for g in self.groups.values() if g.request.event_id == request_id), None)
        version = self.eval_requests.pop(request_id or "", None)
        if group is None and version is None:
            return  # not ours (an adhoc request, a forgery), or already closed
        self.env_failures.append(event)
        if group is not None:
            self.groups.pop(group.request.group_id)
            self.released += 1
            self.last_release = f"group {group.request.group_id}: env server: {event.error_type}"
        if version is not None:
            self.eval_rounds[version].dead += 1

    def expects(self, event: SamplesScored) -> bool:
        """Whether ``event`` answers one of its groups: its group, through the request
        this orchestrator made for it (an adhoc request may reuse a group's id)."""
        group = self.groups.get(event.group_id)
        return (
            group is not None
            and event.request_id == group.request.event_id
            and event.algorithm in group.waiting_for
        )

    def _on_scored(self, event: SamplesScored, skip_zero: bool) -> None:
        if not self.expects(event):
            return  # a shadow algorithm, or a group that is not ours to train
        group = self.groups[event.group_id]
        group.waiting_for.discard(event.algorithm)
        if event.failed:
            group.failed.append(f"{event.algorithm}: {event.failed}")
        else:
            group.received[event.algorithm] = event
        if not group.waiting_for:
            self._complete(event.group_id, skip_zero)

    def _count_errors(self, request: TaskRequested, scored: SamplesScored) -> None:
        """A group with a rollout that can train ends the error streak; one whose
        rollouts only errored (or were filtered) extends it with what they said."""
        trainable = len(scored.rewards) - scored.filtered
        self.trainable_rollouts += trainable
        if trainable > 0:
            self.error_streak = 0
            self.streak_errors.clear()
        elif scored.excluded:
            self.error_streak += scored.excluded
            # An algorithm from before ``excluded_errors`` says only how many.
            self.streak_errors.update(scored.excluded_errors or {"unknown error": scored.excluded})
            self.streak_source = f"env {request.env}, model {request.model}"

    def _complete(self, group_id: str, skip_zero: bool) -> None:
        """Every algorithm the group waited for has answered: queue its merged samples,
        or release it when one of them failed on it (nothing of it trains)."""
        group = self.groups.pop(group_id)
        if group.failed:
            self.released += 1
            self.last_release = f"group {group_id}: " + "; ".join(group.failed)
            return
        events = [group.received[a] for a in sorted(group.received)]
        if not events:
            return  # its only algorithm was detached before scoring it
        first = events[0]  # every algorithm saw the same traces
        self.errored_rollouts += first.excluded
        self.filtered_rollouts += first.filtered
        if group.request.phase == "rl":
            self.batch_rollouts += first.excluded + len(first.rewards)
            self.batch_trainable += len(first.rewards) - first.filtered
            self.batch_filters.update(first.filtered_by)
        self._count_errors(group.request, first)
        if not first.rewards:
            return  # every rollout errored: nothing to train, and no verdict on the rewards
        phase = group.request.phase
        if phase == "rl" and first.rewards and first.filtered == len(first.rewards):
            self.filtered_groups += 1  # every rollout filtered: nothing to train, and not
            self.filtered_streak += 1  # the rewards' fault, so it does not count toward
            self.streak_filters.update(first.filtered_by)  # no_learning_signal
            return
        if phase == "rl":
            self.filtered_streak = 0
            self.streak_filters.clear()
        if phase == "rl" and skip_zero and all(e.zero_advantage for e in events):
            self.skipped_zero += 1
            self.total_skipped_zero += 1
            self.no_signal_streak += 1
            return
        if phase == "rl":
            self.no_signal_streak = 0
        mean = sum(first.rewards) / len(first.rewards) if first.rewards else 0.0
        sources = tuple(e.event_id for e in events)
        for s in merge_scored(events):
            self.queues[phase].append(Queued(s, group_id, sources, mean))


def _foreign(sample: object, event: SamplesScored) -> str | None:
    group = getattr(sample, "group_id", None)
    return None if group == event.group_id else f"belongs to group {group}"
