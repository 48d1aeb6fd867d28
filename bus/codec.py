"""Encoding events to bytes + headers, and decoding them back to declared types.

Headers carry only what a reader needs before decoding (see docs/architecture.md):
``Nats-Msg-Id`` (the event id, keyed by the publisher's identity: ``Bus.msg_id``; for
server-side dedup), ``Rl-Schema`` (tag ``name/version``),
``Rl-Policy-Version`` when the event has one, ``Rl-Step`` on a batch (a weights follower
checks an announced version against the newest batch step without reading the batch,
which may be an offloaded body of megabytes: ``roles/inference``), and ``Rl-Body: ref``
on a payload that is a ``BodyRef`` to an offloaded body. Run, producer and causation id live in the event's
envelope (and the run in the subject): every header costs every message on both sides,
measured in ``benchmarks/bus_bench.py``.

Decoders are built once per set of types; an unknown or newer schema is an
``UnknownSchema`` error that names it, anything else undecodable a ``DecodeError``.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from typing import Any, Union

import msgspec

from bus.errors import DecodeError, UnknownSchema
from schemas import BatchAssembled, BodyRef, Event

H_MSG_ID = "Nats-Msg-Id"
H_SCHEMA = "Rl-Schema"
H_POLICY = "Rl-Policy-Version"
H_BODY = "Rl-Body"
H_STEP = "Rl-Step"

_encoder = msgspec.msgpack.Encoder()
_ref_decoder = msgspec.msgpack.Decoder(BodyRef)


def tag_of(cls: type[msgspec.Struct]) -> str:
    return str(cls.__struct_config__.tag)


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def encode_any(value: Any) -> bytes:
    return _encoder.encode(value)


def headers_for(event: Event, msg_id: str | None = None) -> dict[str, str]:
    """The headers ``event`` is published with; ``msg_id``: its header id (default: the
    event id; a bus with an identity keys it, ``bus.runtime.Bus.msg_id``)."""
    h = {H_MSG_ID: msg_id or event.event_id, H_SCHEMA: tag_of(type(event))}
    version = getattr(event, "policy_version", None)
    if isinstance(version, int):
        h[H_POLICY] = str(version)
    if isinstance(event, BatchAssembled):
        h[H_STEP] = str(event.step)
    return h


@lru_cache(maxsize=64)
def _decoder(types: tuple[type, ...]) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(types[0] if len(types) == 1 else Union[types])  # noqa: UP007


@lru_cache(maxsize=64)
def _tags(types: tuple[type, ...]) -> frozenset[str]:
    return frozenset(tag_of(t) for t in types)


def decode(payload: bytes | memoryview, types: Iterable[type], schema: str | None = None) -> Any:
    """Decode ``payload`` as one of ``types``; ``schema`` is the Rl-Schema header if known."""
    types = types if isinstance(types, tuple) else tuple(types)
    if schema is not None and schema not in _tags(types):
        raise UnknownSchema(schema)
    try:
        return _decoder(types).decode(payload)
    except msgspec.ValidationError as e:
        if "Invalid value" in str(e) and "$.type" in str(e):
            raise UnknownSchema(schema or _peek_tag(payload)) from e
        raise DecodeError(f"{e}") from e
    except msgspec.DecodeError as e:
        raise DecodeError(f"{e}") from e


BODY_PREFIX = "body."  # an offloaded body's object name: body.<event id>.<digest prefix>


class _Ids(msgspec.Struct):
    """The two keys ``stored_event_id`` reads of a payload; every other key is skipped."""

    event_id: str | None = None  # an event
    name: str | None = None  # a BodyRef: ``body.<event id>.<digest prefix>``


_ids_decoder = msgspec.msgpack.Decoder(_Ids)


def stored_event_id(payload: bytes | memoryview, headers: dict[str, str]) -> str | None:
    """The event id of a stored message: its payload's, or an offloaded body's (from the
    body's name); None when the payload is unreadable. Not the header id, which is keyed
    by the publisher's identity (``bus.runtime.Bus.msg_id``)."""
    try:
        ids = _ids_decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if headers.get(H_BODY) == "ref" and ids.name and ids.name.startswith(BODY_PREFIX):
        return ids.name.removeprefix(BODY_PREFIX).rsplit(".", 1)[0]
    return ids.event_id


def decode_ref(payload: bytes | memoryview) -> BodyRef:
    try:
        return _ref_decoder.decode(payload)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise DecodeError(f"bad body reference: {e}") from e


def _peek_tag(payload: bytes | memoryview) -> str:
    try:
        raw = msgspec.msgpack.decode(payload)
        return str(raw.get("type", "?")) if isinstance(raw, dict) else "?"
    except msgspec.DecodeError:
        return "?"
