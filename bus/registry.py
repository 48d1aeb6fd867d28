"""The live role registry: a KV bucket of heartbeats per run, one key per role instance.

The bucket is ``RLROLES_<run>`` (``bus.subjects.roles_bucket_name``): one per run, so
a run's identities can be confined to their own (``bus.auth``). It is created by the
run's launcher; a role only looks it up (creating it when it is missing works where the
server lets the client, as without authentication). Keys are
``<run>.<role>.<instance>``; values are ``RoleHeartbeat``s. Entries expire (bucket
TTL), and a role whose last heartbeat is older than three intervals is shown as stale
by ``rlbus status``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Awaitable, Callable

import msgspec
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.client import JetStreamContext
from nats.js.kv import KeyValue

from bus.subjects import role_key, roles_bucket_name
from schemas import RoleHeartbeat

_decoder = msgspec.msgpack.Decoder(RoleHeartbeat)
TTL_S = 120.0


async def roles_bucket(js: JetStreamContext, run: str, replicas: int = 1) -> KeyValue:
    """The run's registry bucket, created if missing (with ``replicas`` copies)."""
    bucket = roles_bucket_name(run)
    try:
        return await js.key_value(bucket)
    except nats.js.errors.BucketNotFoundError:
        try:
            return await js.create_key_value(
                KeyValueConfig(
                    bucket=bucket, ttl=TTL_S, storage=StorageType.FILE, replicas=replicas
                )
            )
        except nats.js.errors.BadRequestError:
            return await js.key_value(bucket)


async def list_roles(js: JetStreamContext, run: str) -> list[RoleHeartbeat]:
    """Every role instance of ``run`` in the registry (alive, stale or stopped)."""
    kv = await roles_bucket(js, run)
    bucket = roles_bucket_name(run)
    # The keys come from the server's per-subject index, exactly filtered. Not kv.keys()
    # (matches substrings client-side) nor kv.watch(): nats-py's watcher can signal "no
    # initial values" while the first value is still in flight, returning an empty list.
    info = await js.stream_info(f"KV_{bucket}", subjects_filter=f"$KV.{bucket}.{run}.>")
    prefix = len(f"$KV.{bucket}.")
    out = []
    for subject in info.state.subjects or {}:
        with contextlib.suppress(nats.js.errors.KeyNotFoundError, nats.js.errors.KeyDeletedError):
            entry = await kv.get(subject[prefix:])
            if entry.value:
                out.append(_decoder.decode(entry.value))
    return sorted(out, key=lambda h: (h.role, h.instance))


def is_alive(hb: RoleHeartbeat, interval_s: float, now_ns: int | None = None) -> bool:
    now_ns = now_ns or time.time_ns()
    return hb.status != "stopped" and (now_ns - hb.last_seen_ns) < 3 * interval_s * 1e9


class Heartbeat:
    """Publishes this role instance's heartbeat every ``interval_s`` until stopped."""

    def __init__(
        self,
        js: JetStreamContext,
        run: str,
        role: str,
        instance: str,
        interval_s: float = 2.0,
        consumer: str | None = None,
        probe: Callable[[], Awaitable[dict[str, object]]] | None = None,
    ):
        self.js, self.run, self.role, self.instance = js, run, role, instance
        self.interval_s = interval_s
        self.consumer = consumer
        self.probe = probe  # returns fields to update: policy_version, pending, info
        self.started_ns = time.time_ns()
        self.key = role_key(run, role, instance)
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def beat(self, status: str = "running") -> None:
        extra: dict[str, object] = await self.probe() if self.probe else {}
        hb = RoleHeartbeat(
            run=self.run, role=self.role, instance=self.instance, host=socket.gethostname(),
            pid=os.getpid(), started_ns=self.started_ns, last_seen_ns=time.time_ns(),
            consumer=self.consumer, status=status, **extra,  # type: ignore[arg-type]
        )  # fmt: skip
        kv = await roles_bucket(self.js, self.run)
        await kv.put(self.key, msgspec.msgpack.encode(hb))

    async def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                await self.beat()
            except Exception:  # noqa: BLE001 - a missed heartbeat must not kill the role
                pass
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self, mark_stopped: bool = True) -> None:
        # An event, not cancel(): on Python 3.11 a cancel that lands just as a NATS request
        # completes can be swallowed by wait_for inside nats-py, leaving the loop running.
        self._stop.set()
        if self._task:
            await asyncio.gather(self._task, return_exceptions=True)
        if not mark_stopped:  # a phase ended (a role's setup), not the role
            return
        try:
            await self.beat(status="stopped")
        except Exception:  # noqa: BLE001 - best effort on the way out
            pass
