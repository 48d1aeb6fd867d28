"""The inference role: serve one model's generate/score requests, follow published weights.

    rlbus role inference --run demo                 # the policy (follows weights.published)
    rlbus role inference --run demo --model teacher # a key of orchestrator.models (frozen)

Requests are core NATS request/reply on ``infer_subject(run, model)`` in the queue group
``infer_queue(model)``: every replica of a model joins the group and NATS spreads the
requests; each replica also answers on its own ``infer_replica_subject`` (the gateway
keeps a session's turns on one replica, where its prompt prefix is cached). Each request is handled in its own task and handed to the backend, whose
decode loop admits concurrent requests between two steps. Nothing here is stored on the stream:
each trace records what inference answered (tokens, logprobs, policy version).

Which weights: the policy loads ``model.path`` ("tiny" = the locally built tiny model
under the run directory); a key of ``orchestrator.models`` loads its ``path`` (or the
base ``model.path`` when unset) and never changes. The policy replica follows
``weights.published``: at start it loads the newest announcement on the stream that
loads (an unreadable or refused one is stepped over for the one before it), then
an ordered consumer (DeliverPolicy.LAST, NATS_NOTES #11) delivers new ones; the bytes
come from the trainer device to device (``WeightsPublished.device``: its shared ring
with ``trainer.weights_via = "ipc"``, one device-to-device copy; its broadcast with
``"broadcast"``, received beside the decode loop; the device digest checked; on failure
the stored bytes, when this version has them: in its announcement, or in the
``weights.stored`` the trainer publishes seconds after it for every
``trainer.store_weights_every``-th version, which the replica follows too and waits for
when such a version's device copy cannot be read), the object store
(``kind == "object"``) or a file (``kind == "path"`` on a shared filesystem, ``"shm"``
under /dev/shm on the trainer's host), the digest is verified, every tensor is checked
finite, and the swap happens between two decode steps (``inference.swap``: rows in
flight carry on under the new version, or finish first). ``weights.swapped`` logs
``via``, ``lag_s`` and ``pause_s`` (what generation lost). Announcements that pile up
while a load runs collapse to the newest. A fetch
that fails for a transient reason (a timeout, a lost connection:
``bus.errors.TRANSIENT_ERRORS``) is retried a few times with backoff (``weights.fetch_retry``),
so one slow read does not leave a replica on old weights, the last version's included.
A bad announcement (wrong digest, missing object, other shape) is logged as
``weights.rejected``, weights holding a NaN or an inf as ``weights.refused`` (version
and tensor), both at once and for good, and the old weights keep serving.
The trainer deletes old versions (``trainer.keep_weights``), so a version can vanish
between its announcement and its load: that is ``weights.superseded``, and the newest
announcement is loaded instead (a collected version always has a newer one).

Eval pinning (``GenerateRequest.pin_version``: a swap waits, bounded, for the requests
pinned to the version served) and snapshots (a model pinned to a policy version) are in
``roles/inference/pinning.py``; replies always carry the version that ran.

Every ``metrics_interval_s`` (10 s) with traffic it logs ``inference.throughput`` and
publishes ``MetricsReported(role="inference")``: tokens/s, requests/s, mean batch size,
mean queue time, and ``weights_lag_s``: for the last swap, the seconds from the
trainer's ``weights.published`` (its ``ts_ns``) to this replica serving those weights
(fetch and load included; ``weights.swapped`` logs it as ``lag_s`` for every swap).
The heartbeat carries ``policy_version``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

from bus.consumer import Delivery
from bus.follower import Follow
from bus.log import get_logger
from bus.reader import newest_batch_step
from bus.rpc import Serve
from bus.runtime import Bus
from bus.subjects import Topic, infer_queue, infer_replica_subject, infer_subject
from bus.waits import retry_transient
from configs import POLICY, ConfigError, RunConfig
from roles.inference.backend import Backend, WeightsNotFinite, throughput
from roles.inference.pinning import EvalPinning, snapshot_weights
from roles.inference.weights_io import (
    fetch_weights,
    read_latest_weights,
    stored_later,
    weights_gone,
    weights_newest_first,
)
from roles.lib.model import materialize_model, serving_dtype
from roles.lib.model.broadcast import Superseded
from roles.runtime.context import RoleContext
from roles.runtime.role import Role, serve_role
from schemas import (
    GenerateRequest,
    InferenceFailed,
    MetricsReported,
    ObjectRef,
    ScoreRequest,
    WeightsPublished,
    WeightsStored,
)

# At start, how many announcements (newest first) a replica tries before it serves the
# initial weights: a few bad ones in a row are a fault; more is a flood, not a history.
START_CANDIDATES = 8
# Versions stored after their announcement a replica remembers (newest): more than the
# trainer keeps (``trainer.keep_weights``, 4 by default).
_STORED_LATER_KEPT = 16


class VersionAhead(ValueError):
    """An announced weights version beyond the newest batch step: refused for good."""


@dataclass(frozen=True)
class ServedModel:
    """What one inference process serves, resolved from the config."""

    key: str  # "policy" or a key of orchestrator.models
    subject_model: str  # the model token of the subject it answers on
    path: str  # "tiny", a local directory, or a cached hub id
    follows_weights: bool  # the policy and its snapshots pick up weights.published
    pin: int | None = None  # a snapshot: follows the policy up to this version, then stays


def resolve_served_model(cfg: RunConfig, model: str) -> ServedModel:
    """Map ``--model`` to weights and subject; an unknown key fails naming the config key."""
    if model == POLICY:
        return ServedModel(POLICY, POLICY, cfg.model.path, follows_weights=True)
    endpoint = cfg.orchestrator.models.get(model)
    if endpoint is None:
        raise ConfigError(
            f"inference --model {model!r}: not {POLICY!r} and not a key of "
            f"`orchestrator.models` (declared: {sorted(cfg.orchestrator.models) or 'none'})"
        )
    # No path = the frozen base weights of the policy (`model.path`), never updated; or,
    # with `policy_version`, the policy's weights as published at that version.
    pin = endpoint.policy_version
    return ServedModel(
        model, endpoint.subject_model or model, endpoint.path or cfg.model.path,
        pin is not None, pin,
    )  # fmt: skip


async def make_backend(cfg: RunConfig, path: str, weights_dir: Path) -> Backend:
    """The backend ``inference.backend`` names, with the model loaded."""
    inf = cfg.inference
    if inf.backend == "vllm":
        from roles.inference.vllm_backend import VllmBackend

        return VllmBackend(
            path,
            dtype=serving_dtype(cfg.model.dtype, "cuda", inf.dtype),  # vLLM: CUDA only
            weights_dir=weights_dir,
            seed=cfg.seed,
            gpu_memory_utilization=inf.gpu_memory_fraction,
            max_model_len=inf.max_model_len,
        )
    from roles.inference.torch_backend import TorchBackend

    return await asyncio.to_thread(
        TorchBackend.from_path,
        path,
        batch_window_ms=inf.batch_window_ms,
        swap=inf.swap,
        device=inf.device,
        dtype=cfg.model.dtype,
        local_files_only=cfg.model.local_files_only,
        max_batch_size=inf.max_batch_size,
        max_model_len=inf.max_model_len,
        kv_cache_gb=inf.kv_cache_gb,
        cuda_graphs=inf.cuda_graphs,
        graphs_at_start=inf.graphs_at_start,
        gpu_memory_fraction=inf.gpu_memory_fraction,
        served_dtype=inf.dtype,
    )


def peek_request_id(data: bytes) -> str:
    """The request id of an undecodable request, if its bytes still show one."""
    try:
        raw = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError):
        return ""
    rid = raw.get("request_id") if isinstance(raw, dict) else None
    return rid if isinstance(rid, str) else ""


class InferenceRole(Role):
    """Answers ``infer.<model>`` requests through a batching backend; follows new weights."""

    role = "inference"
    # Transient fetch errors: tries in all, and the first wait (doubled each time):
    # 0.5 + 1 + 2 + 4 s, about 8 s before a version is given up.
    fetch_attempts = 5
    fetch_backoff_s = 0.5

    def __init__(
        self,
        bus: Bus,
        instance: str,
        cfg: RunConfig,
        *,
        model: str = POLICY,
        run_dir: Path,
        metrics_interval_s: float = 10.0,
        heartbeat_interval_s: float | None = None,
    ) -> None:
        super().__init__(bus, instance, heartbeat_interval_s or cfg.bus.heartbeat_interval_s)
        self.cfg = cfg
        self.served = resolve_served_model(cfg, model)
        self.run_dir = Path(run_dir)
        self.metrics_interval_s = metrics_interval_s
        self._prev_stats: dict[str, float] = {}  # backend counters at the last report
        self._prev_t = time.perf_counter()
        self.log = get_logger(run=bus.run, role=self.role, instance=instance, model=model)
        self.backend: Backend | None = None
        self.weights_loaded = 0
        self.weights_lag_s: float | None = None  # published -> serving, of the last swap
        self.weights_rejected = 0
        self.last_weights_error: str | None = None
        self._pending: dict[int, WeightsPublished] = {}  # announced, newer than serving
        self._weights_arrived = asyncio.Event()
        self._rejected: set[str] = set()  # event ids already refused: not retried
        # Versions announced on the trainer's device whose bytes were stored later
        # (``weights.stored``): the fallback when the device copy is gone.
        self._stored_later: dict[int, ObjectRef] = {}
        # Announcements whose device copy could not be read, waiting for those bytes.
        self._awaiting_bytes: dict[int, WeightsPublished] = {}
        # Eval pinning (GenerateRequest.pin_version): only the policy itself follows every
        # version; a frozen model or a snapshot serves what it serves.
        honours = self.served.follows_weights and self.served.pin is None
        self.pins = EvalPinning(cfg, self.served.key, honours, self.log)
        self._starting = False  # loading the newest weights at start (_hold)

    # -- lifecycle ----------------------------------------------------------------------

    async def setup(self) -> None:
        path = str(
            await asyncio.to_thread(materialize_model, self.cfg, self.served.path, self.run_dir)
        )
        weights_dir = self.run_dir / "inference" / self.instance
        self.backend = await make_backend(self.cfg, path, weights_dir)
        if self.served.follows_weights:
            self._starting = True  # nothing served yet: no pinned request, no eval, to hold for
            self._stored_later = await stored_later(self.bus)
            try:
                await self._load_newest_good()
            finally:
                self._starting = False
        engine: dict[str, Any] = getattr(self.backend, "describe", dict)()
        self.log.info(
            "inference.loaded",
            path=path,
            backend=self.backend.name,
            policy_version=self.backend.policy_version,
            max_model_len=self.backend.max_model_len,
            **engine,
        )
        if engine.get("rows", 0) < engine.get("rows_asked", 0):
            self.log.warning(
                "inference.kv_cache_limits_rows",
                rows=engine["rows"],
                asked=engine["rows_asked"],
                hint="raise inference.kv_cache_gb or lower inference.max_model_len",
            )

    def subscriptions(self) -> list[Follow | Serve]:
        model, kinds = self.served.subject_model, (GenerateRequest, ScoreRequest)
        inputs: list[Follow | Serve] = [
            Serve(infer_subject(self.run, model), infer_queue(model), kinds, self._answer,
                  self._bad_request),
            # Its own subject too: a conversation the gateway keeps here (X-Session-ID).
            Serve(infer_replica_subject(self.run, model, self.instance), self.instance, kinds,
                  self._answer, self._bad_request),
        ]  # fmt: skip
        if self.served.follows_weights:
            # From the newest announcement on; a bad one must not stop following.
            weights = [(Topic.WEIGHTS_PUBLISHED, None)]
            inputs.append(Follow("weights", weights, self.on_weights, start="last",
                                 on_undecodable="skip"))  # fmt: skip
            stored = [(Topic.WEIGHTS_STORED, None)]
            inputs.append(Follow("weights-stored", stored, self.on_weights_stored, start="last",
                                 on_undecodable="skip"))  # fmt: skip
        return inputs

    def background(self) -> list[Any]:
        self._prev_t = time.perf_counter()  # throughput windows start once serving
        tasks = [self.report_every(self.metrics_interval_s, self.metrics)]
        if self.served.follows_weights:
            tasks.append(self._load_weights())
        return tasks

    async def teardown(self) -> None:
        if self.backend is not None:
            await self.backend.close()  # answers what was queued
            await asyncio.sleep(0.05)  # let the answering tasks send their replies
            with contextlib.suppress(Exception):
                await self.bus.flush(timeout_s=2)

    async def status(self) -> dict[str, object]:
        if self.backend is None:
            return {"info": {"model": self.served.key, "state": "loading"}}
        return {
            "policy_version": self.backend.policy_version,
            "info": {
                "model": self.served.key,
                "subject_model": self.served.subject_model,
                "backend": self.backend.name,
                "weights_rejected": str(self.weights_rejected),
            },
        }

    # -- requests -----------------------------------------------------------------------

    async def _answer(self, req: GenerateRequest | ScoreRequest) -> Any:
        assert self.backend is not None  # serving starts after setup loaded it
        try:
            if isinstance(req, ScoreRequest):
                return (await self.backend.score([req]))[0]
            pin = await self.pins.pin_of(req, self._serving_version)
            if pin is None:
                return (await self.backend.generate([req]))[0]
            with self.pins.hold.pinned(pin):  # the swap to a newer version waits for it
                return (await self.backend.generate([req]))[0]
        except Exception as e:  # noqa: BLE001 - a reply beats a client timeout
            self.log.error("inference.failed", request_id=req.request_id, error=repr(e))
            return InferenceFailed(
                request_id=req.request_id, kind="internal", message=repr(e)[:500]
            )

    def _bad_request(self, data: bytes, error: Exception) -> InferenceFailed:
        return InferenceFailed(
            request_id=peek_request_id(data), kind="bad_request", message=str(error)[:500]
        )

    # -- weights ------------------------------------------------------------------------

    async def on_weights(self, event: WeightsPublished, delivery: Delivery) -> None:
        """Note an announced version; ``_load_weights`` loads it between two decode steps."""
        pending = max(self._pending, default=-1)
        if event.event_id in self._rejected:
            return
        pin = self.served.pin
        if pin is not None and event.version > pin:  # a snapshot: frozen at its version
            if max(self._serving_version(), pending) >= pin:
                return
            found = await snapshot_weights(self.bus, pin, event)  # the pin itself went by unseen
            if found is None:
                return
            event = found
        if event.version > self._serving_version():
            self._pending[event.version] = event
            self._weights_arrived.set()

    async def on_weights_stored(self, event: WeightsStored, delivery: Delivery) -> None:
        """Note where a version announced on the device was stored (the newest few, and
        a snapshot's pinned version); an announcement that waited for these bytes (its
        device copy could not be read) is loaded next, if it is still newer."""
        self._stored_later.setdefault(event.version, event.weights)
        keep = {self.served.pin}
        for v in [v for v in sorted(self._stored_later)[:-_STORED_LATER_KEPT] if v not in keep]:
            del self._stored_later[v]
        serving = self._serving_version()
        for v in [v for v in self._awaiting_bytes if v <= serving]:
            del self._awaiting_bytes[v]
        waiting = self._awaiting_bytes.pop(event.version, None)
        if waiting is not None:
            self._pending[event.version] = waiting
            self._weights_arrived.set()

    def _bytes_to_come(self, event: WeightsPublished) -> bool:
        """Whether ``event``, announced on the device only, will have its bytes stored
        after its announcement (``weights.stored``: every ``store_weights_every``-th
        version, seconds later), so a replica that could not read the device copy waits
        for them rather than refusing the version."""
        return (
            event.device is not None
            and self._stored(event) is None
            and self.cfg.stores_weights(event.version)
        )

    def _stored(self, event: WeightsPublished) -> ObjectRef | None:
        """Where ``event``'s bytes are stored: in the announcement, or stored after it."""
        return event.stored() or self._stored_later.get(event.version)

    async def _load_weights(self) -> None:
        """Loads the newest pending version (older ones are skipped, not queued), or the
        one requests pinned to a version newer than the one served wait for (an eval
        round's, announced while a load or a hold ran): then the newest after it."""
        while await _wait_either(self._weights_arrived, self.stop_event):
            self._weights_arrived.clear()
            event = self._take_pending()
            if event is not None:
                await self._apply_weights(event)
            if any(v > self._serving_version() for v in self._pending):
                self._weights_arrived.set()

    def _take_pending(self) -> WeightsPublished | None:
        """The announcement to load next (``_load_weights``); older ones are dropped."""
        serving = self._serving_version()
        for v in [v for v in self._pending if v <= serving]:
            del self._pending[v]
        if not self._pending:
            return None
        return self._pending.pop(self.pins.next_version(self._pending, serving))

    def _serving_version(self) -> int:
        return self.backend.policy_version if self.backend is not None else 0

    async def _apply_weights(self, event: WeightsPublished) -> bool:
        assert self.backend is not None
        previous = self.backend.policy_version
        started = time.perf_counter()
        try:
            if event.format != "safetensors":
                raise ValueError(f"unsupported weights format {event.format!r}")
            await self._check_version(event)
            via, size, paused_s, held_s = await self._swap_in(event, previous)
        except Superseded as e:  # a newer broadcast version came first: it loads next
            self.log.info("weights.superseded", version=event.version, detail=str(e))
            return False
        except Exception as e:  # noqa: BLE001 - bad weights are refused, serving goes on
            stored = self._stored(event)
            gone_is_news = not isinstance(e, WeightsNotFinite | VersionAhead)
            if gone_is_news and (stored is None or await weights_gone(self.bus, stored)):
                return await self._load_newer_than(event, e)
            self._reject(event, e, previous)
            return False
        self.pins.hold.swapped(event.version)
        self.weights_loaded += 1
        # Wall clocks of two processes (one host under `rlbus up`): the event's ts_ns is
        # the trainer's, taken when it announced the version.
        self.weights_lag_s = (time.time_ns() - event.ts_ns) / 1e9
        self.log.info(
            "weights.swapped",
            version=event.version,
            previous=previous,
            digest=event.weights.digest,
            via=via,
            bytes=size,
            load_s=round(time.perf_counter() - started, 4),
            lag_s=round(self.weights_lag_s, 4),
            pause_s=round(paused_s, 5),
            pin_held_s=round(held_s, 4),
        )
        return True

    async def _swap_in(
        self, event: WeightsPublished, previous: int
    ) -> tuple[str, int, float, float]:
        """Load ``event``'s weights device to device when the trainer announced them so
        (``event.device``: its shared ring, ``trainer.weights_via = "ipc"``, or its
        broadcast, ``"broadcast"``), else, or when that fails (another host, a ring gone or
        overwritten, a version that never arrived), the stored bytes. (via, bytes,
        generation pause, seconds held for pinned requests)."""
        assert self.backend is not None
        stored = self._stored(event)
        if event.device is not None:
            try:
                held_s = await self._hold(previous, event.version)
                paused_s = await self.backend.load_shared(event.device, event.version)
                return event.device.kind, event.device.size, paused_s, held_s
            except (WeightsNotFinite, VersionAhead, Superseded):
                raise
            except Exception as e:  # noqa: BLE001 - the stored copy, if any, is tried next
                if stored is None:
                    raise
                self.log.warning(
                    "weights.device_failed", version=event.version, error=repr(e)[:300],
                    fallback=stored.kind,
                )  # fmt: skip
        if stored is None:
            raise ValueError("weights announced only on the trainer's device, and none given")
        data = await self._fetch(event, stored)
        held_s = await self._hold(previous, event.version)
        paused_s = await self.backend.load_weights(data, stored.digest, event.version)
        return stored.kind, len(data), paused_s, held_s

    async def _hold(self, serving: int, version: int) -> float:
        """Hold the swap from ``serving`` for its pinned requests (``Pins.hold_swap``);
        not at start, before any request was served (a restarted replica catches up at
        once: holding the weights it loaded for an eval that no longer comes only delayed
        the run's recovery)."""
        return 0.0 if self._starting else await self.pins.hold_swap(serving, version)

    async def _check_version(self, event: WeightsPublished) -> None:
        """Refuse a version no batch made: the trainer announces version v after training
        batch v, so v beyond the newest batch step on the log is a forged or buggy
        announcement (the orchestrator's fold refuses it by the same rule). Served, a
        version 1e9 would shadow every real version after it."""
        newest = await retry_transient(
            lambda: newest_batch_step(self.bus),
            attempts=self.fetch_attempts,
            backoff_s=self.fetch_backoff_s,
            on_retry=self._retrying(event),
            sleep=self.sleep,
        )
        if event.version > newest:
            raise VersionAhead(
                f"weights.published version {event.version}, but the newest batch is step "
                f"{newest}: no trainer step made it"
            )

    async def _fetch(self, event: WeightsPublished, stored: ObjectRef) -> bytes:
        """The announced bytes, transient errors retried (``retry_transient``)."""

        return await retry_transient(
            lambda: fetch_weights(self.bus, stored),
            attempts=self.fetch_attempts,
            backoff_s=self.fetch_backoff_s,
            on_retry=self._retrying(event),
            sleep=self.sleep,
        )

    def _retrying(self, event: WeightsPublished) -> Callable[[int, float, Exception], None]:
        """Logs each retry of a transient failure while loading ``event``."""

        def retrying(attempt: int, delay_s: float, error: Exception) -> None:
            self.log.warning(
                "weights.fetch_retry", version=event.version, attempt=attempt,
                attempts=self.fetch_attempts, delay_s=delay_s, error=repr(error)[:300],
            )  # fmt: skip

        return retrying

    async def _load_newer_than(self, event: WeightsPublished, missing: Exception) -> bool:
        """``event``'s weights are gone: load the newest announcement instead.

        The trainer deletes a version only after announcing a newer one, so a collected
        version is superseded, not bad. If nothing newer is announced the weights are
        really missing, and the announcement is rejected like any bad one.
        """
        serving = self._serving_version()
        newest = max(self._pending, default=-1)  # what _load_weights takes next, if any
        pending = self._pending[newest] if newest > event.version else None
        newer = pending or await self._newest_after(event.version)
        if newer is None or newer.event_id in self._rejected:
            if self._bytes_to_come(event):  # weights.stored comes seconds after its announcement
                self._awaiting_bytes[event.version] = event
                self.log.warning(
                    "weights.awaiting_bytes", version=event.version, serving=serving,
                    error=str(missing)[:500],
                )  # fmt: skip
            else:
                self._reject(event, missing, serving)
            return False
        self.log.warning(
            "weights.superseded", version=event.version, newest=newer.version,
            serving=serving, error=str(missing)[:500],
        )  # fmt: skip
        if newer is pending:
            return False
        return await self._apply_weights(newer)

    async def _load_newest_good(self) -> None:
        """At start, the newest announced weights that load: an unreadable announcement,
        or one refused (a wrong digest, a missing object, a NaN), is stepped over for the
        one before it, up to ``START_CANDIDATES`` stored ones, so a restarted replica never
        serves the initial weights while good newer ones are on the log."""
        async with contextlib.aclosing(weights_newest_first(self.bus)) as announced:
            tried = 0
            async for event in announced:
                found = await snapshot_weights(self.bus, self.served.pin, event)
                if found is not None and await self._apply_weights(found):
                    return
                # (a version only shared on a trainer's device is not counted: after a
                # restart of the trainer, up to store_weights_every of them precede a stored one)
                tried += found is None or self._stored(found) is not None
                if tried >= START_CANDIDATES:
                    self.log.error("weights.none_loaded", tried=tried)
                    return

    async def _newest_after(self, version: int) -> WeightsPublished | None:
        """The newest announcement on the log (a snapshot's: the newest up to its pin),
        if it is newer than ``version``."""
        try:
            latest = await read_latest_weights(self.bus)
            if latest is not None:
                latest = await snapshot_weights(self.bus, self.served.pin, latest)
        except Exception as e:  # noqa: BLE001 - an unreadable log: nothing newer known
            self.log.warning("weights.latest_unreadable", error=repr(e))
            return None
        return latest if latest is not None and latest.version > version else None

    def _reject(self, event: WeightsPublished, error: Exception, serving: int) -> None:
        """Refuse ``event`` for good (never retried); the current weights keep serving."""
        self.weights_rejected += 1
        self._rejected.add(event.event_id)
        self.pins.hold.refused(event.version)  # requests waiting for it stop waiting
        self.last_weights_error = f"{type(error).__name__}: {error}"
        if isinstance(error, WeightsNotFinite):
            self.log.error(
                "weights.refused", version=event.version, tensor=error.tensor,
                event_id=event.event_id, serving=serving, error=self.last_weights_error[:500],
            )  # fmt: skip
            return
        self.log.error(
            "weights.rejected",
            version=event.version,
            event_id=event.event_id,
            serving=serving,
            error=self.last_weights_error[:500],
        )

    # -- metrics ------------------------------------------------------------------------

    def metrics(self, stopping: bool) -> MetricsReported | None:
        """Throughput since the last report (None without traffic: nothing worth storing)."""
        if stopping or self.backend is None:
            return None
        now, cur = time.perf_counter(), self.backend.stats()
        values = throughput(self._prev_stats, cur, now - self._prev_t)
        self._prev_stats, self._prev_t = cur, now
        if values is None:
            return None
        if self.weights_lag_s is not None:
            values["weights_lag_s"] = self.weights_lag_s
        version = self.backend.policy_version
        self.log.info("inference.throughput", policy_version=version, **values)
        return MetricsReported(
            run=self.run, role=self.role, step=version, values=values, policy_version=version
        )


async def _wait_either(event: asyncio.Event, stop: asyncio.Event) -> bool:
    """Wait for ``event`` or ``stop``; True when ``event`` fired and we are not stopping."""
    if not event.is_set() and not stop.is_set():
        waiters = [asyncio.create_task(event.wait()), asyncio.create_task(stop.wait())]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
    return not stop.is_set()


async def main(ctx: RoleContext, model: str = POLICY) -> None:
    """``rlbus role inference``: serve ``model`` until SIGTERM."""
    bus = await ctx.connect()
    try:
        role = InferenceRole(bus, ctx.instance, ctx.cfg, model=model, run_dir=ctx.run_dir)
    except BaseException:
        await bus.close()
        raise
    await serve_role(role)
