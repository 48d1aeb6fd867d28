"""Large bodies off the stream: the run's JetStream Object Store, verified by digest.

The stream's messages stay small (NATS's max_payload is 1 MB, and a big message slows
every reader). A body over the threshold is written to ``RLOBJ_<run>`` and the stream
carries a ``BodyRef`` with its size and SHA-256. Reading checks the digest, so a
corrupted, replaced or missing object is a ``BodyError``, never silent garbage. Reads use
``writeinto`` (without it nats-py's ``get`` is quadratic in the object size).
"""

from __future__ import annotations

import hashlib
import io

import nats.js.errors
from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.object_store import ObjectStore

from bus.errors import BodyError

# Weights larger than this are not put in a run's object store: they go to a path under
# the run directory, named by an ObjectRef of kind "path" (trainer and orchestrator).
OBJECT_STORE_MAX_BYTES = 200 * 1024 * 1024


def sha256_digest(data: bytes | memoryview) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class BodyStore:
    """Put and get verified blobs in one object-store bucket."""

    def __init__(self, js: JetStreamContext, bucket: str):
        self.js = js
        self.bucket = bucket
        self._obs: ObjectStore | None = None

    async def store(self) -> ObjectStore:
        if self._obs is None:
            try:
                self._obs = await self.js.object_store(self.bucket)
            except nats.js.errors.BucketNotFoundError:
                self._obs = await self.js.create_object_store(
                    self.bucket, ObjectStoreConfig(storage=StorageType.FILE)
                )
        return self._obs

    async def put(self, name: str, data: bytes) -> str:
        """Store ``data`` under ``name``; returns its digest."""
        obs = await self.store()
        await obs.put(name, data)
        return sha256_digest(data)

    async def get(self, name: str, digest: str) -> bytes:
        """The bytes of ``name``, checked against ``digest``."""
        obs = await self.store()
        buf = io.BytesIO()
        try:
            await obs.get(name, writeinto=buf)
        except nats.js.errors.ObjectNotFoundError as e:
            raise BodyError(f"object {self.bucket}/{name} is missing") from e
        except nats.js.errors.DigestMismatchError as e:
            raise BodyError(
                f"object {self.bucket}/{name} is corrupted (chunk digest mismatch)"
            ) from e
        data = buf.getvalue()
        actual = sha256_digest(data)
        if actual != digest:
            raise BodyError(
                f"object {self.bucket}/{name} does not match its reference: "
                f"expected {digest}, got {actual} ({len(data)} bytes)"
            )
        return data

    async def delete(self, name: str) -> None:
        obs = await self.store()
        await obs.delete(name)
