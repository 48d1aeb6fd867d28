"""Where published weights come from, for the inference role: the newest announcement,
the versions stored after their announcement (``weights.stored``) and the bytes (object
store or file; fetched with ``bus.waits.retry_transient``).

    latest = await read_latest_weights(bus)
    data = await retry_transient(lambda: fetch_weights(bus, latest.weights), attempts=5,
                                 backoff_s=0.5, on_retry=log_it)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path

from bus.reader import last_event, newest_first, read_log
from bus.runtime import Bus
from bus.subjects import Topic
from schemas import ObjectRef, WeightsPublished, WeightsStored


async def read_latest_weights(bus: Bus) -> WeightsPublished | None:
    """The newest readable ``weights.published`` event of the run, or None before the
    first (an unreadable newer message is stepped over)."""
    event: WeightsPublished | None = await last_event(
        bus, Topic.WEIGHTS_PUBLISHED, (WeightsPublished,)
    )
    return event


def weights_newest_first(bus: Bus) -> AsyncGenerator[WeightsPublished, None]:
    """The run's readable ``weights.published`` events, newest first."""
    return newest_first(bus, Topic.WEIGHTS_PUBLISHED, (WeightsPublished,))


async def stored_later(bus: Bus) -> dict[int, ObjectRef]:
    """Where the versions announced only on the trainer's device were stored after
    their announcement (``weights.stored``), by version."""
    out: dict[int, ObjectRef] = {}
    async for event in read_log(bus, [(Topic.WEIGHTS_STORED, None)], (WeightsStored,)):
        out.setdefault(event.version, event.weights)
    return out


# Weights announced as a file: "path" (a shared filesystem) or "shm" (a file under
# /dev/shm the trainer wrote on this host: no disk round trip). Both are read the same way.
FILE_KINDS = ("path", "shm")


async def fetch_weights(bus: Bus, ref: ObjectRef) -> bytes:
    """The announced bytes (object store reads verify the digest on the way)."""
    if ref.kind == "object":
        return await bus.bodies(ref.bucket).get(ref.location, ref.digest)
    if ref.kind in FILE_KINDS:
        return await asyncio.to_thread(Path(ref.location).read_bytes)
    raise ValueError(
        f"unknown weights location kind {ref.kind!r} (expected 'object', 'path' or 'shm')"
    )


async def weights_gone(bus: Bus, ref: ObjectRef) -> bool:
    """Whether the announced weights are no longer stored (collected by the trainer);
    False when that cannot be told (the announcement is then treated as bad)."""
    try:
        if ref.kind == "object":
            store = bus.bodies(ref.bucket)
            return not await store.exists(ref.location)
        if ref.kind in FILE_KINDS:
            return not await asyncio.to_thread(Path(ref.location).exists)
    except Exception:  # noqa: BLE001 - unknown: not "gone"
        return False
    return False
