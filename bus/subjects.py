"""The one registry of topics, subjects, streams, buckets and consumers.

Nothing else in rlbus spells a subject string. A topic names a fact in the past tense;
its subject is ``rl.<run>.<topic>`` plus ``.<key>`` for keyed topics (the env, the
algorithm, the role). One JetStream stream per run (``RL_<run>``) stores every topic in
one total order; inference request/reply (``rl.<run>.infer.<model>``) is core NATS and
deliberately not captured by the stream.

    python -m bus.subjects        # prints the topology table
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum

from bus.errors import WrongSchema
from schemas import (
    EVENT_TYPES,
    AlgorithmAttached,
    AlgorithmDetached,
    BatchAssembled,
    DeadLettered,
    EvalCompleted,
    Event,
    MetricsReported,
    RunStarted,
    RunStopped,
    SamplesScored,
    TaskRequested,
    TraceCompleted,
    WeightsPublished,
    WeightsStored,
)

_TOKEN = re.compile(r"[A-Za-z0-9_-]+")


class Topic(StrEnum):
    RUN_STARTED = "run.started"
    RUN_STOPPED = "run.stopped"
    TASK_REQUESTED = "task.requested"
    TRACE_COMPLETED = "trace.completed"
    EVAL_COMPLETED = "eval.completed"
    SAMPLES_SCORED = "samples.scored"
    BATCH_ASSEMBLED = "batch.assembled"
    WEIGHTS_PUBLISHED = "weights.published"
    WEIGHTS_STORED = "weights.stored"
    METRICS_REPORTED = "metrics.reported"
    DEAD_LETTERED = "dead.lettered"
    ALGORITHM_ATTACHED = "algorithm.attached"
    ALGORITHM_DETACHED = "algorithm.detached"


@dataclass(frozen=True)
class TopicSpec:
    topic: Topic
    schema: type[Event]
    key_field: str | None  # event attribute that becomes the subject's last token
    producer: str  # who publishes it, in words (the topology table)
    consumers: str
    # Which identities may publish it is the role registry's (``bus.kinds.producers``).


TOPICS: dict[Topic, TopicSpec] = {
    s.topic: s
    for s in (
        TopicSpec(
            Topic.RUN_STARTED,
            RunStarted,
            None,
            "orchestrator",
            "all roles, replay",
        ),
        TopicSpec(
            Topic.RUN_STOPPED,
            RunStopped,
            None,
            "orchestrator",
            "all roles, replay",
        ),
        TopicSpec(
            Topic.TASK_REQUESTED,
            TaskRequested,
            "env",
            "orchestrator",
            "env servers (shared durable per env)",
        ),
        TopicSpec(
            Topic.TRACE_COMPLETED,
            TraceCompleted,
            "env",
            "env server",
            "algorithm workers, lake",
        ),
        TopicSpec(
            Topic.EVAL_COMPLETED,
            EvalCompleted,
            "env",
            "env server",
            "orchestrator, lake",
        ),
        TopicSpec(
            Topic.SAMPLES_SCORED,
            SamplesScored,
            "algorithm",
            "algorithm worker (orchestrator: a group past its deadline)",
            "orchestrator, lake",
        ),
        TopicSpec(
            Topic.BATCH_ASSEMBLED,
            BatchAssembled,
            None,
            "orchestrator",
            "trainer",
        ),
        TopicSpec(
            Topic.WEIGHTS_PUBLISHED,
            WeightsPublished,
            None,
            "trainer",
            "inference, orchestrator",
        ),
        TopicSpec(
            Topic.WEIGHTS_STORED,
            WeightsStored,
            None,
            "trainer (a version announced on the device, stored later)",
            "inference (bytes when a device copy is gone), trainer catch-up, lake, export",
        ),
        TopicSpec(
            Topic.METRICS_REPORTED,
            MetricsReported,
            "role",
            "every role",
            "lake, status",
        ),
        TopicSpec(
            Topic.DEAD_LETTERED,
            DeadLettered,
            "role",
            "bus runtime",
            "operators, lake",
        ),
        TopicSpec(
            Topic.ALGORITHM_ATTACHED,
            AlgorithmAttached,
            "algorithm",
            "rlbus algorithm attach",
            "orchestrator, the worker, status",
        ),
        TopicSpec(
            Topic.ALGORITHM_DETACHED,
            AlgorithmDetached,
            "algorithm",
            "rlbus algorithm detach; orchestrator (an attach with no worker)",
            "orchestrator, the worker, status",
        ),
    )
}

TOPIC_OF: dict[type[Event], Topic] = {spec.schema: t for t, spec in TOPICS.items()}

# Core NATS (not stored): inference request/reply per model, in a queue group (who asks
# and who answers: ``bus.kinds``).
INFER = "infer"


def is_token(value: str) -> bool:
    """Whether ``value`` may be a subject token (a run, a key, a model name)."""
    return bool(_TOKEN.fullmatch(value))


def check_token(value: str, what: str = "name") -> str:
    """Subject tokens must be plain: a dot or wildcard would change the subject's meaning."""
    if not _TOKEN.fullmatch(value):
        raise ValueError(f"invalid {what} {value!r}: use letters, digits, '-' and '_' only")
    return value


def token_for(name: str) -> str:
    """A subject-safe token for a free-form name (an env import path ``pkg.mod:make``):
    anything but letters, digits, ``-`` and ``_`` becomes ``-``; at most 40 characters."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in name)[:40]


STREAM_PREFIX = "RL_"


def stream_name(run: str) -> str:
    return f"{STREAM_PREFIX}{check_token(run, 'run id')}"


def run_of_stream(name: str) -> str | None:
    """The run whose stream is ``name`` (None: not a run's stream)."""
    return name.removeprefix(STREAM_PREFIX) if name.startswith(STREAM_PREFIX) else None


def objects_bucket(run: str, kind: str | None = None) -> str:
    """The object store ``kind``'s identity writes in ``run`` (offloaded bodies; the
    trainer's: weights): one per kind, so no identity can overwrite or purge another's
    objects (``bus.auth``). ``kind`` None: the one shared store of an anonymous bus (a
    server without identities). The kind leads (``RLOBJENV_<run>``): kinds hold no ``_``,
    so no run id, whatever it holds, makes one kind's name another's."""
    run = check_token(run, "run id")
    return f"RLOBJ_{run}" if kind is None else f"RLOBJ{check_token(kind, 'kind').upper()}_{run}"


def kind_of_bucket(run: str, bucket: str) -> str | None:
    """The kind whose object store of ``run`` is ``bucket`` (None: the shared one);
    ``ValueError`` for a bucket of no kind of ``run``."""
    if bucket == objects_bucket(run):
        return None
    head, _, rest = bucket.partition("_")
    if rest != run or not head.startswith("RLOBJ") or not head[5:].isalpha():
        raise ValueError(f"{bucket!r} is no object store of run {run!r}")
    return head[5:].lower()


def roles_bucket_name(run: str) -> str:
    """The run's live role registry (KV): keys ``<run>.<role>.<instance>``. One bucket
    per run, so a run's identities can be confined to their own (``bus.auth``)."""
    return f"RLROLES_{check_token(run, 'run id')}"


def stream_subjects(run: str) -> list[str]:
    """What the run's stream captures: every topic, and nothing else (not inference)."""
    return [filter_subject(run, t) for t in Topic]


def subject(run: str, topic: Topic, key: str | None = None) -> str:
    spec = TOPICS[topic]
    base = f"rl.{check_token(run, 'run id')}.{topic.value}"
    if spec.key_field is None:
        if key is not None:
            raise ValueError(f"topic {topic.value} takes no key")
        return base
    if key is None:
        raise ValueError(f"topic {topic.value} needs a {spec.key_field}")
    return f"{base}.{check_token(key, spec.key_field)}"


def moved_subject(subj: str, old_run: str, new_run: str) -> str:
    """``subj`` of run ``old_run`` as the same topic and key in run ``new_run`` (an
    import under a new run id)."""
    topic = topic_of_subject(old_run, subj)
    key = relative_subject(old_run, subj).removeprefix(topic.value).removeprefix(".")
    return subject(new_run, topic, key or None)


def filter_subject(run: str, topic: Topic, key: str | None = None) -> str:
    """A consumer filter: one key, or every key (``*``) of a keyed topic."""
    if TOPICS[topic].key_field is not None and key is None:
        return f"rl.{check_token(run, 'run id')}.{topic.value}.*"
    return subject(run, topic, key)


def subject_for(event: Event) -> str:
    """The subject an event is published on, from its type and key field."""
    topic = TOPIC_OF[type(event)]
    field = TOPICS[topic].key_field
    return subject(event.run, topic, getattr(event, field) if field else None)


def relative_subject(run: str, subj: str) -> str:
    """A subject without its ``rl.<run>.`` prefix (``trace.completed.reverse-text``)."""
    return subj.removeprefix(f"rl.{run}.")


def declared_schema(subj: str) -> type[Event] | None:
    """The schema a run subject (``rl.<run>.<topic>[.<key>]``) declares, or None for a
    subject outside the topic table. A run id is one token, so the topic follows it."""
    parts = subj.split(".", 2)
    if len(parts) < 3 or parts[0] != "rl":
        return None
    rest = parts[2]
    for t, spec in TOPICS.items():
        if rest == t.value or rest.startswith(t.value + "."):
            return spec.schema
    return None


def check_schema(subj: str, event: Event) -> Event:
    """``event`` if it is of the type its subject declares; else ``WrongSchema``. Every
    reader of the log calls it (durables, followers, folds, replay, the lake), so an
    event of another type on a subject is refused the same way live, on restart and in
    a replay (docs/architecture.md, the runtime's failure rules)."""
    schema = declared_schema(subj)
    if schema is not None and not isinstance(event, schema):
        raise WrongSchema(
            f"a {type(event).__name__} on {subj.split('.', 2)[-1]}, "
            f"which carries {schema.__name__} only"
        )
    return event


def topic_of_subject(run: str, subj: str) -> Topic:
    prefix = f"rl.{run}."
    if not subj.startswith(prefix):
        raise ValueError(f"subject {subj!r} is not in run {run!r}")
    rest = subj[len(prefix) :]
    for t in Topic:
        if rest == t.value or rest.startswith(t.value + "."):
            return t
    raise ValueError(f"subject {subj!r} names no known topic")


def infer_subject(run: str, model: str) -> str:
    return f"rl.{check_token(run, 'run id')}.{INFER}.{check_token(model, 'model')}"


def infer_replica_subject(run: str, model: str, instance: str) -> str:
    """One replica's own subject (``<infer_subject>.<instance>``): a conversation kept on
    one replica reuses its cached prompt prefix (the gateway's ``X-Session-ID``)."""
    return f"{infer_subject(run, model)}.{check_token(instance, 'instance')}"


def infer_queue(model: str) -> str:
    return f"infer-{check_token(model, 'model')}"


def durable_name(role: str, *parts: str) -> str:
    """Durable consumer name: role plus what distinguishes it (env, algorithm...)."""
    return "-".join(check_token(p, "consumer part") for p in (role, *parts))


def role_key(run: str, role: str, instance: str) -> str:
    return f"{check_token(run, 'run id')}.{check_token(role, 'role')}.{check_token(instance, 'instance')}"


# -- patterns: what a server permission names (``bus.auth``) -------------------------------


def run_pattern(run: str) -> str:
    """Every subject of ``run``'s scheme: its topics and its inference."""
    return f"rl.{check_token(run, 'run id')}.>"


def infer_patterns(run: str) -> list[str]:
    """Every inference subject of ``run``: a model's, and one replica's of a model."""
    base = f"rl.{check_token(run, 'run id')}.{INFER}"
    return [f"{base}.*", f"{base}.*.*"]


def role_keys_pattern(run: str, role: str) -> str:
    """Every registry key of ``role``'s instances in ``run`` (``role_key``)."""
    return f"{check_token(run, 'run id')}.{check_token(role, 'role')}.*"


def topology() -> list[tuple[str, str, str, str]]:
    """(subject pattern, schema, producer, consumers) for every topic plus inference."""
    rows = []
    for t, spec in TOPICS.items():
        key = f".<{spec.key_field}>" if spec.key_field else ""
        tag = spec.schema.__struct_config__.tag
        rows.append(
            (
                f"rl.<run>.{t.value}{key}",
                f"{spec.schema.__name__} ({tag})",
                spec.producer,
                spec.consumers,
            )
        )
    rows.append(
        (
            "rl.<run>.infer.<model>",
            "GenerateRequest or ScoreRequest, with a reply",
            "env servers, algorithms, the gateway",
            "inference (queue group; core NATS, not stored)",
        )
    )
    return rows


assert set(TOPIC_OF) == set(EVENT_TYPES), "every event type needs exactly one topic"

if __name__ == "__main__":
    for row in topology():
        print(" | ".join(row))
