"""The subjects registry: one topic per event type, well-formed subjects, no strays."""

from __future__ import annotations

import pytest

from bus import subjects
from bus.subjects import TOPIC_OF, TOPICS, Topic
from schemas import EVENT_TYPES, RunStopped, TraceCompleted
from tests.samples import every_event


def test_every_event_type_has_exactly_one_topic() -> None:
    """Each event type maps to one topic and each topic to one event type."""
    assert set(TOPIC_OF) == set(EVENT_TYPES)
    assert len({spec.schema for spec in TOPICS.values()}) == len(TOPICS) == len(EVENT_TYPES)
    for event_type in EVENT_TYPES:
        assert sum(spec.schema is event_type for spec in TOPICS.values()) == 1


def test_key_fields_exist_on_their_schemas() -> None:
    """A keyed topic's key must be a string field of its schema."""
    for spec in TOPICS.values():
        if spec.key_field:
            assert spec.key_field in spec.schema.__struct_fields__, spec.topic


def test_subject_for_uses_the_key_field() -> None:
    events = {type(e): e for e in every_event("r1")}
    assert subjects.subject_for(events[TraceCompleted]) == "rl.r1.trace.completed.reverse-text"
    assert subjects.subject_for(events[RunStopped]) == "rl.r1.run.stopped"
    for e in events.values():
        subj = subjects.subject_for(e)
        assert subjects.topic_of_subject("r1", subj) is TOPIC_OF[type(e)]


def test_stream_captures_every_topic_but_not_inference() -> None:
    """Inference is core request/reply; the stream must not store it."""
    patterns = subjects.stream_subjects("r1")
    assert len(patterns) == len(Topic)
    assert not any(p.startswith("rl.r1.infer") for p in patterns)
    assert subjects.infer_subject("r1", "policy") == "rl.r1.infer.policy"


@pytest.mark.parametrize("bad", ["a.b", "a*", "a>", "", "a b"])
def test_tokens_with_dots_or_wildcards_are_rejected(bad: str) -> None:
    """A dot or wildcard in a run id or key would silently change what a subject matches."""
    with pytest.raises(ValueError):
        subjects.subject("r1", Topic.TRACE_COMPLETED, bad)
    with pytest.raises(ValueError):
        subjects.stream_name(bad)


def test_keyed_topics_need_keys() -> None:
    with pytest.raises(ValueError):
        subjects.subject("r1", Topic.TRACE_COMPLETED)
    with pytest.raises(ValueError):
        subjects.subject("r1", Topic.RUN_STARTED, "x")
    assert subjects.filter_subject("r1", Topic.TRACE_COMPLETED) == "rl.r1.trace.completed.*"


def test_topology_lists_every_topic() -> None:
    rows = subjects.topology()
    assert len(rows) == len(Topic) + 1


def test_a_subject_moves_to_another_run_with_its_topic_and_key() -> None:
    from bus.subjects import Topic, moved_subject, subject

    keyed = subject("old", Topic.TRACE_COMPLETED, "reverse-text")
    assert moved_subject(keyed, "old", "new") == subject(
        "new", Topic.TRACE_COMPLETED, "reverse-text"
    )
    plain = subject("old", Topic.WEIGHTS_PUBLISHED)
    assert moved_subject(plain, "old", "new") == "rl.new.weights.published"


def test_only_bus_subjects_spells_a_subject_of_the_scheme() -> None:
    """``rl.<run>...`` is written in bus/subjects.py alone: every other module of the
    product asks it (``subject``, ``filter_subject``, ``infer_patterns``, ...)."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spelled = re.compile(r"""f?["']rl\.""")
    found = [
        str(path.relative_to(root))
        for package in ("bus", "schemas", "configs", "roles", "replay")
        for path in sorted((root / package).rglob("*.py"))
        if path != root / "bus" / "subjects.py" and spelled.search(path.read_text())
    ]
    assert not found, found
