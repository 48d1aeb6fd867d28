"""Every message rlbus exchanges, as msgspec Structs (msgpack on the wire).

``EVENT_TYPES`` lists every stored event; ``bus.subjects`` maps each one to its topic.

- ``base``: the event envelope every stored message shares (``Event``), and the id rules
- ``run``: run lifecycle events, the first and last of every run (``RunStarted``,
  ``RunStopped``)
- ``rollout``: the request an env server runs (``TaskRequested``) and the ``Trace`` it
  records
- ``training``: scored samples, assembled batches, published weights, algorithm
  attach/detach
- ``inference``: inference request/reply messages (core NATS, not stored)
- ``ops``: operational messages: metrics, dead letters, heartbeats, offloaded bodies
- ``arrays``: per-token arrays on the wire, as raw little-endian bytes
- ``legacy``: old versions of events and their pure upcasters, so old logs still replay
"""

from __future__ import annotations

import msgspec

from schemas.base import Event, Record, derive_id, new_id, stable_seed
from schemas.inference import (
    GenerateRequest,
    GenerateResult,
    InferenceFailed,
    InferenceReply,
    InferenceRequest,
    ScoreRequest,
    ScoreResult,
)
from schemas.ops import BodyRef, DeadLettered, MetricsReported, RoleHeartbeat
from schemas.rollout import (
    Branch,
    EvalCompleted,
    FilterVerdict,
    Message,
    SamplingParams,
    Seating,
    TaskRef,
    TaskRequested,
    ToolCall,
    Trace,
    TraceCompleted,
    TraceError,
)
from schemas.run import (
    ObjectRef,
    RunStarted,
    RunStopped,
    run_resumed_id,
    run_started_id,
    run_stopped_id,
)
from schemas.training import (
    BROADCAST_KIND,
    IPC_KIND,
    AlgorithmAttached,
    AlgorithmDetached,
    BatchAssembled,
    Sample,
    SamplesScored,
    WeightsPublished,
    WeightsStored,
    batch_id,
)

EVENT_TYPES: tuple[type[Event], ...] = (
    RunStarted,
    RunStopped,
    TaskRequested,
    TraceCompleted,
    EvalCompleted,
    SamplesScored,
    BatchAssembled,
    WeightsPublished,
    WeightsStored,
    MetricsReported,
    DeadLettered,
    AlgorithmAttached,
    AlgorithmDetached,
)


def schema_of(cls: type[msgspec.Struct]) -> tuple[str, int]:
    """(name, version) of a tagged Struct, read from its tag ``name/version``."""
    tag = cls.__struct_config__.tag
    if not isinstance(tag, str) or "/" not in tag:
        raise TypeError(f"{cls.__name__} has no versioned tag")
    name, version = tag.rsplit("/", 1)
    return name, int(version)


__all__ = [
    "batch_id",
    "run_resumed_id",
    "run_started_id",
    "run_stopped_id",
    "EVENT_TYPES",
    "AlgorithmAttached",
    "AlgorithmDetached",
    "BatchAssembled",
    "BodyRef",
    "Branch",
    "DeadLettered",
    "EvalCompleted",
    "Event",
    "GenerateRequest",
    "GenerateResult",
    "InferenceFailed",
    "InferenceReply",
    "InferenceRequest",
    "Message",
    "MetricsReported",
    "ObjectRef",
    "Record",
    "RoleHeartbeat",
    "RunStarted",
    "RunStopped",
    "Sample",
    "SamplesScored",
    "SamplingParams",
    "Seating",
    "ScoreRequest",
    "ScoreResult",
    "TaskRef",
    "TaskRequested",
    "Trace",
    "TraceCompleted",
    "TraceError",
    "ToolCall",
    "FilterVerdict",
    "WeightsPublished",
    "WeightsStored",
    "IPC_KIND",
    "BROADCAST_KIND",
    "derive_id",
    "new_id",
    "schema_of",
    "stable_seed",
]
