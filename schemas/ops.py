"""Operational messages: metrics, dead letters, heartbeats, offloaded bodies."""

from __future__ import annotations

import msgspec

from schemas.base import Event, Record


class MetricsReported(Event, frozen=True, tag="metrics_reported/1"):
    role: str
    step: int
    values: dict[str, float]
    policy_version: int | None = None


class DeadLettered(Event, frozen=True, tag="dead_lettered/1"):
    """A message a role could not decode or handle, kept with the error."""

    role: str
    consumer: str
    subject: str
    stream_seq: int
    deliveries: int
    error_type: str
    error: str
    payload: bytes
    headers: dict[str, str] = msgspec.field(default_factory=dict)

    @property
    def headline(self) -> str:
        """``<error_type>: <the error's first line>`` (a traceback follows it, if any)."""
        return f"{self.error_type}: {(self.error.strip().splitlines() or [''])[0]}"


class RoleHeartbeat(Record, frozen=True):
    """The value of a role's key in the role registry (a KV bucket, not the stream)."""

    run: str
    role: str
    instance: str
    host: str
    pid: int
    started_ns: int
    last_seen_ns: int
    consumer: str | None = None
    policy_version: int | None = None
    status: str = "running"  # "running" | "draining" | "stopped"
    pending: int | None = None  # messages waiting on its consumer (lag)
    info: dict[str, str] = msgspec.field(default_factory=dict)


class BodyRef(Record, frozen=True, tag="body_ref/1", tag_field="type"):
    """The on-stream stand-in for an event whose encoded body went to the object store."""

    bucket: str
    name: str
    size: int
    digest: str  # "sha256:<hex>" of the encoded event bytes
    schema: str  # tag of the offloaded event, e.g. "batch_assembled/1"
