"""Large bodies off the stream: the run's JetStream Object Store, verified by digest.

The stream's messages stay small (NATS's max_payload is 1 MB, and a big message slows
every reader). A body over the threshold is written to ``RLOBJ_<run>`` and the stream
carries a ``BodyRef`` with its size and SHA-256. Reading checks the digest, so a
corrupted, replaced or missing object is a ``BodyError``, never silent garbage.

Reads stream the object's chunks from an ordered consumer into one buffer (nats-py's
``get`` without ``writeinto`` is quadratic in the object size, and waits forever for
chunks that an ``ObjectStore.delete`` purged under it). Deleting is idempotent and leaves
no tombstone: the trainer deletes old weights objects (``roles.trainer.retention``), and a
restarted trainer deletes again. How the server gives the disk back: ``rewrite``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import nats.errors
import nats.js.errors
from nats.js.api import ObjectInfo, ObjectStoreConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DIGEST_TYPE,
    OBJ_META_PRE_TEMPLATE,
    OBJ_STREAM_TEMPLATE,
    ObjectStore,
)

from bus.errors import BodyError
from bus.settings import RECONNECT_GRACE_S
from bus.waits import unless_stopped

# Weights larger than this are not put in a run's object store: they go to a path under
# the run directory, named by an ObjectRef of kind "path" (trainer and orchestrator).
OBJECT_STORE_MAX_BYTES = 200 * 1024 * 1024

# A read that receives no chunk for this long checks that its object still exists.
READ_STALL_S = 5.0
# A put that meets a restarting server or a cluster electing a leader is tried again
# for this long (a put of the same name and bytes is idempotent).
PUT_PATIENCE_S = 30.0


T = TypeVar("T")

_TRANSIENT = (
    asyncio.TimeoutError,
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.js.errors.ServiceUnavailableError,
)


def sha256_digest(data: bytes | memoryview) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class BodyStore:
    """Put and get verified blobs in one object-store bucket."""

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        read_stall_s: float = READ_STALL_S,
        replicas: int = 1,  # copies kept when this store creates the bucket
        reconnected: Callable[[], asyncio.Event] | None = None,
    ):
        """``reconnected``: the event the connection sets when it next comes back
        (``Bus``'s), so that a put it interrupts starts again at once."""
        self.js = js
        self.reconnected = reconnected
        self.bucket = bucket
        self.replicas = replicas
        self.stream = OBJ_STREAM_TEMPLATE.format(bucket=bucket)  # the bucket's JetStream stream
        self.read_stall_s = read_stall_s
        self._obs: ObjectStore | None = None

    async def store(self) -> ObjectStore:
        if self._obs is None:
            try:
                self._obs = await self.js.object_store(self.bucket)
            except nats.js.errors.BucketNotFoundError:
                self._obs = await self.js.create_object_store(
                    self.bucket, ObjectStoreConfig(storage=StorageType.FILE, replicas=self.replicas)
                )
        return self._obs

    async def put(self, name: str, data: bytes, patience_s: float = PUT_PATIENCE_S) -> str:
        """Store ``data`` under ``name``; returns its digest. Tried again while the server
        is away or leaderless, for ``patience_s``; then the error is raised."""
        deadline = time.monotonic() + patience_s
        while True:
            try:
                await self._again_on_reconnect(lambda: self._put(name, data))
                return sha256_digest(data)
            except _TRANSIENT:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def _put(self, name: str, data: bytes) -> None:
        await (await self.store()).put(name, data)  # (the bucket's lookup is a request too)

    async def _again_on_reconnect(self, work: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """``work()``'s result, started again when the connection comes back while it
        runs: a request or chunk the old connection carried is never answered (nats-py
        would wait out its timeout, 5 s, and a read its stall time), so after
        ``RECONNECT_GRACE_S`` for what went over the new one, it is cancelled."""
        while True:
            if self.reconnected is None:
                return await work()
            done = await unless_stopped(work(), self.reconnected(), grace_s=RECONNECT_GRACE_S)
            if done is not None:
                return done.result()

    async def get(self, name: str, digest: str) -> bytes:
        """The bytes of ``name``, checked against ``digest``."""
        data = await self.read(name)
        actual = sha256_digest(data)
        if actual != digest:
            raise BodyError(
                f"object {self.bucket}/{name} does not match its reference: "
                f"expected {digest}, got {actual} ({len(data)} bytes)"
            )
        return data

    async def _info(self, name: str) -> ObjectInfo:
        """The info of a stored object; a ``BodyError`` for anything that makes it
        unreadable, a bucket that does not exist or cannot (a reference read from the
        log names it: a read never creates a bucket) included."""
        try:
            if self._obs is None:
                self._obs = await self.js.object_store(self.bucket)
            return await self._obs.get_info(name)
        except (nats.js.errors.ObjectNotFoundError, nats.js.errors.BucketNotFoundError) as e:
            raise BodyError(f"object {self.bucket}/{name} is missing") from e
        except (nats.js.errors.InvalidBucketNameError, nats.js.errors.InvalidObjectNameError) as e:
            raise BodyError(f"object {self.bucket}/{name} cannot exist: {e!r}") from e

    async def read(self, name: str) -> bytes:
        """Every chunk of ``name`` in order, its chunk digest checked (no reference needed).

        When no chunk arrives for ``read_stall_s`` the object's info is read again: an
        object deleted (or replaced) under the read is a ``BodyError``, never a hang. A
        read the connection's coming back interrupts starts again at once.
        """
        return await self._again_on_reconnect(lambda: self._read(name))

    async def _read(self, name: str) -> bytes:
        info = await self._info(name)
        if not info.size:
            return b""
        chunks = OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=self.bucket, obj=info.nuid)
        sub = await self.js.subscribe(chunks, ordered_consumer=True)
        buf, h = bytearray(), hashlib.sha256()
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=self.read_stall_s)
                except nats.errors.TimeoutError:
                    await self._check_still_there(name, info)
                    continue
                buf += msg.data
                h.update(msg.data)
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        expected = (
            (info.digest or "").removeprefix(OBJ_DIGEST_TYPE).removeprefix(OBJ_DIGEST_TYPE.upper())
        )
        if h.digest() != base64.urlsafe_b64decode(expected):
            raise BodyError(f"object {self.bucket}/{name} is corrupted (chunk digest mismatch)")
        return bytes(buf)

    async def _check_still_there(self, name: str, info: ObjectInfo) -> None:
        try:
            now = await self._info(name)
        except BodyError as e:
            raise BodyError(f"object {self.bucket}/{name} was deleted while being read") from e
        if now.nuid != info.nuid:
            raise BodyError(f"object {self.bucket}/{name} was replaced while being read")

    async def exists(self, name: str) -> bool:
        """Whether ``name`` is stored (not deleted): tells a missing object from a bad one."""
        try:
            await self._info(name)
        except BodyError:
            return False
        return True

    async def delete(self, name: str) -> bool:
        """Delete ``name``; False if it was not there (deleting twice is no error).

        nats-py marks the object deleted (a meta tombstone) and purges its chunks; the
        tombstone is purged too: no deleted object leaves a live message behind, which
        would hold the stream's head (and the disk behind it, see ``rewrite``) in place.
        """
        obs = await self.store()
        try:
            await obs.delete(name)
            existed = True
        except nats.js.errors.ObjectNotFoundError:
            existed = False
        await self.js.purge_stream(self.stream, subject=self._meta_subject(name))
        return existed

    async def rewrite(self, name: str) -> int:
        """Store ``name`` again, same bytes and digest, at the end of the bucket's stream;
        returns its size.

        The file store frees space from the head of a stream: a block emptied by deletes
        while older live messages precede it stays on disk until the server's periodic
        compaction (minutes). Moving the oldest object that must stay (a run's initial
        weights) to the tail lets the head advance past everything deleted behind it.
        A concurrent reader of the old copy gets a clear ``BodyError`` ("replaced while
        being read"), and a crash midway leaves the object readable (nats-py writes the
        new chunks, then switches the meta, then purges the old chunks).
        """
        data = await self.read(name)
        await self.put(name, data)
        return len(data)

    async def names(self, prefix: str = "") -> list[str]:
        """The names of the stored (not deleted) objects starting with ``prefix``, sorted."""
        obs = await self.store()
        try:
            infos = await obs.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:  # nats-py's answer for an empty bucket
            return []
        return sorted(i.name for i in infos if i.name.startswith(prefix) and not i.deleted)

    async def stored_bytes(self) -> int:
        """Bytes the bucket's stream holds (what deletes give back)."""
        await self.store()
        info = await self.js.stream_info(self.stream)
        return int(info.state.bytes)

    def _meta_subject(self, name: str) -> str:
        encoded = base64.urlsafe_b64encode(name.encode()).decode()  # as nats-py names it
        return OBJ_META_PRE_TEMPLATE.format(bucket=self.bucket, obj=encoded)
