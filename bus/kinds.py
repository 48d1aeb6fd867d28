"""The role registry: every kind of client of a run's bus, and every role process, once.

A **kind** is an identity on the bus (one user and password per run, ``bus.auth``): what
its processes may publish, whether they own durable consumers, store objects, write
heartbeats, and ask or answer inference. A **role** is a process kind: what
``rlbus role <name>`` runs (``entry``, imported lazily), under which identity, and
whether it computes (the CPU plan gives the compute roles their own cores). A process's
name starts with its role's name (``inference-policy-0``, ``env-reverse-text-1``), its
heartbeats carry it, and the launcher starts, places and stops processes by it.

What derives from here: the server's permissions and ``python -m bus.auth``'s table
(``bus.auth``), who may publish each topic (``producers``, shown by ``rlbus topology``),
the CPU plan's compute roles (``roles.up.cpu_plan``), and the target of every
``rlbus role`` command (``roles.cli.role``; a test checks the commands and ``ROLES``
agree).

    KINDS["env"].publishes        # (Topic.TRACE_COMPLETED, Topic.EVAL_COMPLETED, ...)
    ROLES["lake"].kind            # "monitor": it only reads the log and heartbeats
    producers(Topic.SAMPLES_SCORED)   # ("orchestrator", "algorithm", "attach")
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from bus.subjects import Topic


@dataclass(frozen=True)
class Kind:
    """An identity on a run's bus."""

    name: str
    what: str  # who connects as it, in words
    publishes: tuple[Topic, ...] = ()  # the topics it may publish (the launcher: every one)
    durables: bool = False  # owns durable pull consumers: creates, fetches, acks, deletes
    # stores objects, in an object store of its own (``bus.subjects.objects_bucket``):
    # offloaded bodies, weights; and any kind that dead-letters (a dead letter of a
    # message near the size limit is offloaded like any large event)
    objects: bool = False
    # the registry role names of its processes: the heartbeats it writes and the dead
    # letters it may publish (``dead.lettered.<role>``)
    heartbeats: tuple[str, ...] = ()
    infer: Literal["asks", "answers"] | None = None  # inference requests, core NATS


_T = Topic
KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind("launcher", "rlbus up, rollout, import: the admin of its run", objects=True),
        Kind(
            "orchestrator", "the orchestrator",
            (_T.RUN_STARTED, _T.RUN_STOPPED, _T.TASK_REQUESTED, _T.BATCH_ASSEMBLED,
             _T.SAMPLES_SCORED, _T.ALGORITHM_DETACHED, _T.METRICS_REPORTED, _T.DEAD_LETTERED),
            objects=True, heartbeats=("orchestrator",),
        ),
        Kind(
            "trainer", "the trainer (rank 0)",
            (_T.WEIGHTS_PUBLISHED, _T.WEIGHTS_STORED, _T.METRICS_REPORTED, _T.DEAD_LETTERED),
            durables=True, objects=True, heartbeats=("trainer",),
        ),
        Kind(
            "inference", "inference replicas",
            (_T.METRICS_REPORTED, _T.DEAD_LETTERED),
            objects=True, heartbeats=("inference",), infer="answers",
        ),
        Kind("teacher", "the scripted teacher", heartbeats=("teacher",), infer="answers"),
        Kind(
            "env", "env servers",
            (_T.TRACE_COMPLETED, _T.EVAL_COMPLETED, _T.METRICS_REPORTED, _T.DEAD_LETTERED),
            durables=True, objects=True, heartbeats=("env",), infer="asks",
        ),
        Kind(
            "algorithm", "algorithm workers",
            (_T.SAMPLES_SCORED, _T.METRICS_REPORTED, _T.DEAD_LETTERED),
            durables=True, objects=True, heartbeats=("algorithm",), infer="asks",
        ),
        Kind(
            "attach", "rlbus algorithm attach/detach and the workers it starts",
            (_T.SAMPLES_SCORED, _T.ALGORITHM_ATTACHED, _T.ALGORITHM_DETACHED,
             _T.METRICS_REPORTED, _T.DEAD_LETTERED),
            durables=True, objects=True, heartbeats=("algorithm",), infer="asks",
        ),
        Kind(
            "monitor", "the metric sinks and the live lake",
            (_T.DEAD_LETTERED,), objects=True, heartbeats=("monitor", "lake"),
        ),
        Kind("reader", "the read commands: status, events, lake, trace, replay"),
        Kind("gateway", "the OpenAI endpoint (asks inference, publishes no event)",
             heartbeats=("gateway",), infer="asks"),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Role:
    """A process kind: ``rlbus role <name>``."""

    name: str
    kind: str  # the identity it connects as
    entry: str  # "module:function" it runs (``function(ctx, **options)``)
    compute: bool = False  # gets its own CPUs and threads in the CPU plan


ROLES: dict[str, Role] = {
    r.name: r
    for r in (
        Role("orchestrator", "orchestrator", "roles.orchestrator.role:main"),
        Role("trainer", "trainer", "roles.trainer.role:main", compute=True),
        Role("inference", "inference", "roles.inference.role:main", compute=True),
        Role("teacher", "teacher", "roles.teacher.role:main"),
        Role("env", "env", "roles.env_server.role:main"),
        Role("algorithm", "algorithm", "roles.algorithm.role:main"),
        Role("monitor", "monitor", "roles.monitor.role:main"),
        Role("lake", "monitor", "roles.lake.role:main"),  # reads the log, writes Parquet
        Role("gateway", "gateway", "roles.gateway.role:main"),
    )
}


def producers(topic: Topic) -> tuple[str, ...]:
    """The kinds that may publish ``topic`` (the launcher, admin of its run, not listed)."""
    return tuple(k.name for k in KINDS.values() if topic in k.publishes)


def object_kinds() -> tuple[str, ...]:
    """The kinds with an object store of their own (``Kind.objects``)."""
    return tuple(k.name for k in KINDS.values() if k.objects)


def kinds_that(infer: Literal["asks", "answers"]) -> tuple[str, ...]:
    """The kinds that send inference requests (``"asks"``) or answer them."""
    return tuple(k.name for k in KINDS.values() if k.infer == infer)


def check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown role kind {kind!r} (one of {', '.join(KINDS)})")
    return kind


def kind_of_role(role: str) -> str:
    """The kind a role (``rlbus role <role>``) runs as; a kind is its own kind."""
    if role in KINDS:
        return role
    if role not in ROLES:
        raise ValueError(f"no identity for role {role!r} (roles: {', '.join(ROLES)})")
    return ROLES[role].kind


def role_of_process(name: str) -> str:
    """``inference-policy-0`` -> ``inference``, ``env-reverse-text-1`` -> ``env``."""
    return name.split("-", 1)[0]
