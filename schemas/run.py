"""Run lifecycle events: the first and last events of every run."""

from __future__ import annotations

from typing import Any

from schemas.base import Event, Record, derive_id


class ObjectRef(Record, frozen=True):
    """Where a body lives outside the stream: an object-store object or a shared path."""

    # "object" (JetStream Object Store) | "path" (shared filesystem) | "shm" (a file under
    # /dev/shm on the writer's host)
    kind: str
    location: str  # object name, or filesystem path
    bucket: str | None = None  # object-store bucket for kind == "object"
    size: int = 0
    digest: str = ""  # "sha256:<hex>" of the bytes


class RunStarted(Event, frozen=True, tag="run_started/1"):
    config: dict[str, Any]  # the fully resolved config (configs.RunConfig, JSON mode)
    seed: int
    model_path: str
    initial_weights: ObjectRef | None = None  # weights of policy version 0
    # A later start: the config in force from here on (``rlbus up --resume`` with changed
    # keys: id ``run_resumed_id``; a replay's fork).
    resumed: bool = False


def run_started_id(run: str) -> str:
    """The id of the orchestrator's ``run.started`` (the first ``run.started`` of a run is
    its start, whatever its id: a fork or an import writes its own;
    ``roles.runtime.context.read_run_started``)."""
    return derive_id(run, "started")


def run_resumed_id(run: str, segment: int) -> str:
    """The id of the orchestrator's ``run.started`` with ``resumed=True`` that opens
    segment ``segment`` (1, 2, ...) of a run: ``rlbus up --resume`` with changed keys."""
    return derive_id(run, "started", segment)


def run_stopped_id(run: str, segment: int = 0) -> str:
    """The id of the orchestrator's ``run.stopped`` (a run stops once per segment: its
    start, then each ``run_resumed_id``): the orchestrator and the launcher take no other.
    Segment 0's is the run's stop as it always was."""
    return derive_id(run, "stopped", segment) if segment else derive_id(run, "stopped")


class RunStopped(Event, frozen=True, tag="run_stopped/1"):
    # "max_steps" | "no_learning_signal" | "env_error" | "stalled" | "rollout_errors" |
    # "rollouts_filtered" (the orchestrator's: roles/orchestrator) | "user" | "error"
    reason: str
    step: int = 0
    detail: str = ""
