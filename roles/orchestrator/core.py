"""The orchestrator's transition: one event read from the log in, the decisions it causes out.

    core = OrchestratorCore(cfg)                  # cfg.run set: ids derive from it
    t = core.step(event)                          # fold, then decide
    t.outputs                                     # events to publish (already folded)
    t.rejected                                    # why the event was refused, if it was

It is the whole of what the orchestrator decides, and nothing else reads or writes its
state: the role (``roles/orchestrator/role.py``) feeds it the events its follower reads
and publishes what comes out (a refused event is dead-lettered, with what the refusal
caused); a restarted orchestrator feeds it the log from sequence 1 and re-makes its
decisions with the same ids; ``rlbus replay <run> orchestrator`` (``replay.orchestrator``)
feeds it the recorded log and diffs what comes out against what the run recorded. The
clock never enters: what depends on time (deadline releases, stall reports and stops) is
the role's watch, whose events are on the log and come back in as inputs.

A run resumed with changed keys decides each part of its log under the config that was
in force then (``config_in_force``): the newest ``run.started`` folded so far.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from bus.subjects import Topic
from configs import RunConfig, resolve
from roles.orchestrator.policy import decide, trains_on
from roles.orchestrator.state import OrchestratorState
from schemas import Event, RunStarted, SamplesScored, run_resumed_id

# What the orchestrator reads, from sequence 1: the topics it folds, the eval reports
# (its own, read back), and the tasks env servers dead-lettered (each releases a group).
INPUTS: list[tuple[Topic, str | None]] = [
    (Topic.RUN_STARTED, None), (Topic.RUN_STOPPED, None), (Topic.TASK_REQUESTED, None),
    (Topic.SAMPLES_SCORED, None), (Topic.BATCH_ASSEMBLED, None),
    (Topic.WEIGHTS_PUBLISHED, None), (Topic.EVAL_COMPLETED, None),
    (Topic.ALGORITHM_ATTACHED, None), (Topic.ALGORITHM_DETACHED, None),
    (Topic.METRICS_REPORTED, "eval"), (Topic.DEAD_LETTERED, "env"),
]  # fmt: skip


@dataclass(frozen=True)
class Transition:
    """What one input caused: the events to publish, and why the input was refused (None:
    it was folded). A refused input is dead-lettered; a refused ``samples.scored`` of a
    group in flight still releases that group, and what that frees is in ``outputs``."""

    outputs: list[Event] = field(default_factory=list)
    rejected: str | None = None


class OrchestratorCore:
    """The fold (``OrchestratorState``) and the decisions (``policy.decide``) behind one
    ``step``: a pure function of the config and the events stepped so far."""

    def __init__(self, cfg: RunConfig):
        if not cfg.run:
            raise ValueError("the orchestrator's config names no run (ids derive from it)")
        self.cfg = cfg
        self.run = cfg.run
        self.state = OrchestratorState(trains_on=trains_on(cfg))
        self._configs: dict[str, RunConfig] = {}  # by run.started id (``config_in_force``)

    def step(self, event: Event) -> Transition:
        """Fold ``event`` (read from the log), then decide."""
        reason = self.state.check(event)
        if reason is not None:
            if not isinstance(event, SamplesScored) or not self.state.expects(event):
                return Transition(rejected=reason)
            # Scores that cannot be trained: the group will never get this algorithm's
            # samples, so it is released now, and what that frees is decided at once.
            self.state.fail_group(event, reason)
            return Transition(self._decide(event), rejected=reason)
        skip_zero = self.config_in_force().orchestrator.skip_zero_advantage_groups
        self.state.apply(event, skip_zero=skip_zero)
        return Transition(self._decide(event))

    def _decide(self, cause: Event) -> list[Event]:
        return decide(self.state, self.config_in_force(), cause=cause.event_id)

    def config_in_force(self) -> RunConfig:
        """The config of the newest start folded so far (``state.started``): a resumed
        run's log is re-decided under the config each part of it was decided with, so its
        decisions come out the same, with the same ids."""
        started = self.state.started
        if started is None:
            return self.cfg
        if started.event_id not in self._configs:
            self._configs[started.event_id] = self.config_of(started)
        return self._configs[started.event_id]

    def config_of(self, started: RunStarted) -> RunConfig:
        """``started``'s config; this core's own (the same object) when they agree but
        for where the run lives."""
        cfg = resolve(started.config, source=f"run.started {started.event_id} of {self.run}")
        if decisive(cfg) == decisive(self.cfg):
            return self.cfg
        cfg.run = self.run
        return cfg


def segment_starts(run: str, starts: Iterable[RunStarted]) -> list[RunStarted]:
    """The starts of ``run``'s segments among its ``run.started`` events (log order): the
    first (whoever wrote it: the orchestrator, a fork, an import), then each resumed
    segment's, which the orchestrator publishes as ``run_resumed_id(run, k)``; any other
    is not a start. The last one's config is the one in force at the log's end."""
    out: list[RunStarted] = []
    for e in starts:
        if not out or (e.resumed and e.event_id == run_resumed_id(run, len(out))):
            out.append(e)
    return out


def decisive(cfg: RunConfig) -> dict[str, Any]:
    """``cfg`` as JSON without what says where the run lives (its id, data directory and
    server), which a resume may spell differently without changing anything."""
    return cfg.model_dump(mode="json", exclude={"run": True, "bus": {"data_dir", "url"}})


def changed_keys(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two configs (as JSON), for the log."""
    out = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_keys(a, b, f"{prefix}{key}.")
        elif a != b:
            out.append(f"{prefix}{key}")
    return out
