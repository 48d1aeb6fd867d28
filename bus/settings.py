"""A run's bus settings and their defaults, in one place: ``Bus`` (``bus.runtime``)
publishes and consumes by them, and the config's ``[bus]`` section
(``configs.models.BusConfig``) takes its defaults from here (the one import configs
makes of bus besides ``bus.subjects``: this module imports nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

# After the connection loses its server and comes back, how long a publish, a request or
# an object put in progress may still finish over the new connection before what the
# old one carried is sent again (its acks or reply never come; otherwise a restarted
# server costs each of them its whole timeout).
RECONNECT_GRACE_S = 0.25


@dataclass(frozen=True)
class BusSettings:
    # Bodies larger than this go to the object store; NATS max_payload defaults to 1 MB.
    offload_threshold_bytes: int = 512 * 1024
    # per attempt: a stream leader lost mid-publish, or a server restart, costs this
    publish_timeout_s: float = 2.0
    publish_attempts: int = 5
    # ...and keep retrying this long: a cluster elects a new stream leader in seconds.
    publish_patience_s: float = 30.0
    publish_window: int = 256  # max un-acked async publishes
    # cap in-flight bytes (stream ingest queue, NATS_NOTES #3)
    publish_window_bytes: int = 32 * 1024 * 1024
    # How long the stream remembers Nats-Msg-Id values to drop duplicate publishes.
    duplicate_window_s: float = 3600.0
    max_deliver: int = 5  # deliveries before a message is dead-lettered
    # Seconds a consumer may hold a message unanswered before the server redelivers it.
    ack_wait_s: float = 3.0
    nak_delay_s: float = 1.0
    server_lost_s: float = 60.0  # unreachable this long: ``watch_server`` gives up
    replicas: int = 1  # copies of the run's stream and object store (3 on a cluster)
    squat_steps: int = 3  # salted ids tried for a squatted event before PublishError
