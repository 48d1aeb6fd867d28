"""The event envelope every stored message shares, and the rules for ids.

Every message on a run's stream is an ``Event``: a frozen, tagged msgspec Struct that
omits defaults on the wire. The tag is ``<name>/<version>``: a breaking change is a new
class with a new tag (the old one moves to ``schemas.legacy`` with a pure ``upcast``),
never a changed field type or a reused tag. New fields always get defaults, so an old
reader ignores them and a new reader fills them in.

Ids: ``new_id()`` for events caused by the outside world (a user, the clock); outputs of
a handler use ``derive_id(input_id, ...)`` so a redelivered input republishes the same
ids and the server's ``Nats-Msg-Id`` dedup stores them once.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from typing import Annotated

import msgspec

# Declared constraints, checked by msgspec as a message decodes: a value outside them is a
# decode error, so every reader dead-letters it the same way (bus.consumer, bus.follower).
# What training takes as a signal (a reward, an advantage): finite and within
# +-VALUE_BOUND (NaN and the infinities fail both bounds). A finite value beyond it (an
# advantage of 1e38) is a bug upstream, never a signal, and is refused by the same rule
# as a non-finite one (``Sample.problem`` for a sample's arrays).
VALUE_BOUND = 1e6
Bounded = Annotated[float, msgspec.Meta(ge=-VALUE_BOUND, le=VALUE_BOUND)]
# A log-probability is at most 0 (float32 rounding may leave a hair above it).
LOGPROB_MAX = 1e-3
NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
# Rollouts in one group: a bound well above any real group, below anything absurd.
GroupSize = Annotated[int, msgspec.Meta(ge=1, le=4096)]


def new_id() -> str:
    """A fresh random event id (32 hex chars)."""
    return uuid.uuid4().hex


def derive_id(*parts: object) -> str:
    """A stable id from its causes (blake2b; never Python's per-process ``hash``)."""
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(str(part).encode())
        h.update(b"\x1f")
    return h.hexdigest()


def stable_seed(*parts: object) -> int:
    """A 63-bit seed derived from data coordinates (run seed, step, request id...)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(str(part).encode())
        h.update(b"\x1f")
    return int.from_bytes(h.digest(), "little") >> 1


class Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", omit_defaults=True):
    """Base of every stored message.

    ``ts_ns`` is informational only: replay and pure roles never read it.
    """

    run: str
    event_id: str = msgspec.field(default_factory=new_id)
    causation_id: str | None = None
    ts_ns: int = msgspec.field(default_factory=time.time_ns)
    producer: str = ""  # the role instance that published it, e.g. "env-reverse-text-1"


class Record(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Base of nested value objects (not events themselves)."""
