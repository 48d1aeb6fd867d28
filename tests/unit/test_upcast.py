"""Legacy events: the committed v0 golden decodes and upcasts; unknown versions are named.

The golden ``tests/golden/trace_completed.v0.msgpack`` is what a writer from before the
top-level ``env`` field produced. Write it (once; never rewrite it) with

    python -m tests.unit.test_upcast
"""

from __future__ import annotations

import msgspec
import pytest

from bus import codec
from bus.errors import UnknownSchema
from bus.reader import ALL_TYPES, decode_event
from replay.tables import rows_for
from schemas import EVENT_TYPES, Event, TraceCompleted
from schemas.legacy import TraceCompletedV0, upcast
from tests.golden.make_golden import golden_path
from tests.samples import TS, trace

V0 = "trace_completed/0"


def legacy_trace_completed() -> TraceCompletedV0:
    """The v0 golden's content: a TraceCompleted as old writers sent it (no ``env``)."""
    return TraceCompletedV0(
        run="golden", event_id="e-trace-v0", causation_id="e-task", ts_ns=TS,
        producer="golden-0", request_id="e-task", group_size=8, step=2, trace=trace("golden"),
    )  # fmt: skip


def write_golden() -> None:
    path = golden_path(V0)
    if not path.exists():
        path.write_bytes(codec.encode(legacy_trace_completed()))
        print("wrote", path)


def test_v0_golden_decodes_to_the_legacy_class() -> None:
    """The committed v0 bytes still decode, field for field, as ``TraceCompletedV0``."""
    data = golden_path(V0).read_bytes()
    assert msgspec.msgpack.decode(data)["type"] == V0
    assert "env" not in msgspec.msgpack.decode(data)
    assert codec.decode(data, ALL_TYPES, V0) == legacy_trace_completed()


def test_v0_upcasts_to_current_with_env_from_the_trace() -> None:
    """Upcasting fills ``env`` from ``trace.env`` and keeps the envelope (ids, causation, time)."""
    old = codec.decode(golden_path(V0).read_bytes(), ALL_TYPES, V0)
    new = upcast(old)
    assert isinstance(new, TraceCompleted)
    assert new.env == old.trace.env == "reverse-text"
    for name in ("run", "event_id", "causation_id", "ts_ns", "producer", "request_id", "step"):
        assert getattr(new, name) == getattr(old, name), name
    assert new.trace == old.trace and new.group_size == 8
    # the upcast event is an ordinary current event: it round-trips through the live codec
    assert codec.decode(codec.encode(new), EVENT_TYPES) == new


def test_log_decoder_upcasts_legacy_and_passes_current_through() -> None:
    """``decode_event`` (what replay and the lake use) returns current events only."""
    golden = golden_path(V0).read_bytes()
    event = decode_event(golden, V0)
    assert type(event) is TraceCompleted and event.env == "reverse-text"
    assert rows_for(event, seq=1)["rollouts"][0]["env"] == "reverse-text"
    current = golden_path("trace_completed/1").read_bytes()
    assert decode_event(current, "trace_completed/1") == codec.decode(current, EVENT_TYPES)


def test_live_decoders_do_not_accept_legacy_versions() -> None:
    """Live roles decode current types only: a v0 message is an unknown schema to them."""
    with pytest.raises(UnknownSchema, match="trace_completed/0"):
        codec.decode(golden_path(V0).read_bytes(), EVENT_TYPES, V0)


class TraceCompletedV9(Event, frozen=True, tag="trace_completed/9"):
    """What a future writer might send: a version this reader has never heard of."""

    env: str
    novelty: int = 1


@pytest.mark.parametrize("with_header", [True, False])
def test_unknown_newer_version_is_named_not_misread(with_header: bool) -> None:
    """``trace_completed/9`` is an ``UnknownSchema`` naming it (the reader then skips it)."""
    data = codec.encode(TraceCompletedV9(run="golden", env="x"))
    with pytest.raises(UnknownSchema, match="trace_completed/9"):
        decode_event(data, "trace_completed/9" if with_header else None)


if __name__ == "__main__":
    write_golden()
