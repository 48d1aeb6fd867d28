"""``rlbus events``: a run's log in order (the log reader, ``bus.reader``), one line each."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from typing import Any

import msgspec

from bus.reader import LogReader, stored_event
from bus.runtime import Bus
from bus.subjects import Topic, relative_subject
from schemas import Event


def summary(event: Event) -> str:
    """One line of the fields that matter; per-token bytes are shown as lengths."""
    fields: dict[str, Any] = {}
    for name in event.__struct_fields__:
        if name in ("run", "event_id", "ts_ns", "causation_id", "producer"):
            continue
        value = getattr(event, name)
        if isinstance(value, bytes):
            value = f"<{len(value)} bytes>"
        elif isinstance(value, list) and value and isinstance(value[0], msgspec.Struct):
            value = f"[{len(value)} x {type(value[0]).__name__}]"
        elif isinstance(value, msgspec.Struct):
            value = f"<{type(value).__name__}>"
        elif isinstance(value, dict) and len(str(value)) > 120:
            value = f"{{{len(value)} keys}}"
        fields[name] = value
    return " ".join(f"{k}={v}" for k, v in fields.items())


async def print_events(
    url: str, run: str, topics: list[str], from_seq: int, follow: bool, limit: int, as_json: bool
) -> None:
    bus = await Bus.connect(url, run=run, producer="cli-events")
    try:
        wanted = [Topic(t) for t in topics] if topics else list(Topic)
        reader = LogReader(
            bus, from_seq=from_seq, topics=[(t, None) for t in wanted] if topics else None,
            follow=follow, idle_timeout_s=2.0 if follow else 0.5,
        )  # fmt: skip
        shown = 0
        async with contextlib.aclosing(reader.messages()) as messages:
            async for msg in messages:
                meta = msg.metadata
                try:
                    event = await stored_event(bus, msg)
                    line = summary(event)
                    kind = type(event).__name__
                except Exception as e:  # noqa: BLE001 - show undecodable entries, keep reading
                    event, kind, line = None, "UNDECODABLE", str(e)
                ts = dt.datetime.fromtimestamp(
                    meta.timestamp.timestamp() if meta.timestamp else 0
                ).strftime("%H:%M:%S.%f")[:-3]
                if as_json:
                    record = {"seq": meta.sequence.stream, "subject": msg.subject, "type": kind}
                    if event is not None:
                        record["event"] = msgspec.to_builtins(event, enc_hook=lambda b: len(b))
                    print(json.dumps(record, default=str))
                else:
                    cause = (
                        f" <- {event.causation_id[:8]}"
                        if event is not None and event.causation_id
                        else ""
                    )
                    eid = event.event_id[:8] if event is not None else "-"
                    print(
                        f"{meta.sequence.stream:>6} {ts} {relative_subject(run, msg.subject):<32} {kind:<16} {eid}{cause}  {line}"
                    )
                shown += 1
                if limit and shown >= limit:
                    break
    finally:
        await bus.close()
