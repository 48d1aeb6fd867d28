"""The trainer role: train on ``batch.assembled`` strictly in order, announce each new policy.

    rlbus role trainer --run demo --config run.toml

State is a fold over batches (``core.TrainerCore``) and a checkpoint is a snapshot of
it, so a restart never trains a batch twice or skips one:

1. **setup** loads the initial weights (``model.path``; ``"tiny"`` builds the tiny model
   under the run directory) and the newest checkpoint (step c, or c = 0), which records
   the stream sequence of its last batch.
2. **catch-up** reads the ``BatchAssembled`` events after that sequence with an ordered
   consumer and trains every step > c, republishing its ``WeightsPublished`` and
   ``MetricsReported`` with the same derived ids (the server dedups them). Where a
   ``WeightsPublished`` for the step is already on the stream, the recomputed digest
   must equal the recorded one (``trainer.replay_diverged`` is logged if not, and the
   recorded announcement and object are left as they are).
3. **the durable consumer** ``trainer`` is then repositioned by the role runtime
   (``Subscription.restart_at``) to start right after what catch-up read, and handles
   the rest with one message in flight
   (``max_ack_pending=1``, so a retried batch can never be overtaken by the next): a
   batch whose step <= the current step is acked without training (idempotent by
   step); a batch with step > current + 1 is a gap and raises, so it is retried and
   then dead-lettered, never silently skipped (catch-up stops at a gap and leaves it
   to this consumer).

A batch the trainer refuses (a sample with ``Sample.problem``: a NaN advantage, a
misaligned array, ...; see ``core.batch_problem``) counts as a step that trained nothing:
nothing is trained on any rank, its version is announced with the weights unchanged
and metrics ``refused_batch=1``, and then the batch is dead-lettered at once
(``Rejected``: its after-publish hook raises it, so the announcement is stored first).
The next batch follows it as usual, so one bad batch never stalls the run, and a
restart (catch-up) or a replay steps over the same batch the same way (catch-up logs
``trainer.batch_refused`` but records no dead letter: that is the consumer's, and a
trainer that died between the announcement and the dead letter leaves only the
metrics' ``refused_batch=1``). A step whose loss or gradient norm is not finite is
not applied (``nonfinite_step=1``, logged as ``trainer.nonfinite_step``): its version is
the previous weights, announced as usual.

Each step runs in a worker thread so heartbeats and ``in_progress`` keep flowing. The
handler returns the step's announcement (``Effects``: the weights are stored or shared, the
events are for the runtime to publish); its after-publish hook marks the step announced
and writes a checkpoint when one is due, so a checkpoint never includes an unannounced
step (that would hide it from the catch-up), and the input is acked after both. A step
whose announcement failed stays pending and is announced again, with the same ids,
before anything else. Weights go to the run's object store as ``weights.v<N>``,
or, past 200 MB, to ``<run_dir>/weights/v<N>.safetensors`` (an ``ObjectRef`` of kind
``path``). Checkpoints every ``trainer.checkpoint_interval`` steps and on graceful stop;
the newest ``trainer.keep_checkpoints`` stay, and each whose step is a multiple of
``trainer.checkpoint_keep_every`` (``core.checkpoints_to_delete``).

With ``trainer.weights_via = "ipc"`` or ``"broadcast"`` every version is announced at
once with its device reference (``roles.lib.model.shared_weights`` / ``broadcast``), and
only some are stored (``RunConfig.stores_weights``): the last in its announcement, the
others after it. Their weights are copied where they are (``TrainerCore.weights_snapshot``)
and written while the next steps train, then named by a ``weights.stored`` event (same
derived ids on a retry). One store is in flight at a time; a checkpoint waits for it (so
catch-up, which starts after the checkpoint, finds every store it covers on the log) and
catch-up stores a version the stride names whose ``weights.stored`` is missing. A store
that fails is retried for a transient error, else logged (``weights.store_failed``): the
version stays device-only and training goes on.

Old weights are deleted by the trainer (``roles.trainer.retention`` says which: all but
the newest ``trainer.keep_weights`` stored versions, the initial weights and a policy
snapshot's), in the same
after-publish hook, so a version is deleted only once a newer one is stored and
announced. At start it lists what a previous process left (objects and files) and
collects that too; deleting is idempotent, so a restart after a crash mid-collection
simply deletes again. A failed delete is logged and retried after the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from bus.consumer import Delivery, Effects, Subscription, commit
from bus.errors import STORE_ERRORS, HandlerBroken, Rejected
from bus.follower import Follow
from bus.offload import OBJECT_STORE_MAX_BYTES
from bus.reader import last_seq, read_log
from bus.runtime import Bus
from bus.subjects import Topic, durable_name
from bus.waits import retry_transient
from roles.lib.model import serving_dtype
from roles.lib.model.broadcast import BroadcastHub
from roles.lib.model.loading import resolve_dtype
from roles.lib.model.shared_weights import Layout, WeightsRing
from roles.lib.model.weights import digest, tensors_to_bytes, write_atomic
from roles.runtime.context import RoleContext
from roles.runtime.role import Role, serve_role
from roles.trainer import retention
from roles.trainer.core import BatchGap, TrainerCore, latest_checkpoint, take_step
from roles.trainer.group import GroupBroken, Ranks, make_trainer, start_ranks
from schemas import (
    BatchAssembled,
    Event,
    MetricsReported,
    ObjectRef,
    WeightsPublished,
    WeightsStored,
    batch_id,
    derive_id,
)

# How long catch-up waits for the next message it knows is on the stream.
_READ_TIMEOUT_S = 30.0
# What a failed delete or rewrite raises (the store's errors, a file system error).
_STORE_ERRORS: tuple[type[Exception], ...] = (*STORE_ERRORS, OSError)
# Tries of a store after its announcement that fails for a transient reason (1 s, 2 s apart).
_STORE_ATTEMPTS = 3


@dataclass
class _Pending:
    """A trained step whose weights and metrics are not announced yet."""

    batch: BatchAssembled
    seq: int  # its stream sequence (recorded in checkpoints for catch-up)
    metrics: dict[str, float]
    recorded: WeightsPublished | None  # its announcement already on the stream (catch-up)
    events: list[Event] | None = None  # its announcement, once its weights are stored
    digest: str = ""
    refused: str | None = None  # why the batch was refused (a step that trained nothing)
    # Its weights, copied where they are, to be stored once it is announced (a version
    # announced on the device: ``TrainerRole._store_after``).
    snapshot: dict[str, torch.Tensor] | None = None


class TrainerRole(Role):
    role = "trainer"

    def __init__(self, bus: Bus, ctx: RoleContext):
        super().__init__(bus, ctx.instance, heartbeat_interval_s=ctx.cfg.bus.heartbeat_interval_s)
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.run_dir = ctx.run_dir
        self._core: TrainerCore | None = None  # built in setup (loads the model)
        self.ranks: Ranks | None = None  # ranks 1..N-1 of a multi-rank trainer
        self.broken = False  # the rank group failed: nothing more is asked of it
        self.sub = Subscription(
            durable_name("trainer"),
            [(Topic.BATCH_ASSEMBLED, None)],
            self.on_batch,
            batch=1,
            max_ack_pending=1,
            owned=True,
        )
        self.saved_step = 0  # step of the newest checkpoint on disk
        self.last_batch_seq = 0  # stream seq of the batch behind ``core.step``
        self.pending: list[_Pending] = []  # trained but not yet announced, in step order
        self.idle_since = time.monotonic()
        # Weights versions in the object store ("object") or the weights dir ("path"),
        # not yet collected: listed at start, added as they are stored.
        self.stored_weights: dict[int, str] = {}
        self.collected_since_rewrite = 0  # versions deleted since weights.v0 was rewritten
        # Versions whose bytes are stored after their announcement (on the log already:
        # catch-up), and the store in flight, if any (one at a time).
        self.stored_later: set[int] = set()
        self.storing: asyncio.Task[None] | None = None
        self.ring: WeightsRing | None = None  # trainer.weights_via = "ipc": made at first use
        self.hub: BroadcastHub | None = None  # trainer.weights_via = "broadcast": the same

    @property
    def core(self) -> TrainerCore:
        if self._core is None:
            raise RuntimeError("the trainer is not set up yet")
        return self._core

    def subscriptions(self) -> list[Subscription | Follow]:
        return [self.sub]

    def background(self) -> list[Awaitable[None]]:
        return [self._watch_ranks()] if self.cfg.trainer.world_size > 1 else []

    async def _watch_ranks(self) -> None:
        """A rank that dies between steps takes the role down now, not at the next batch."""
        while not await self.sleep(1.0):
            if self.ranks is not None:
                with self._group_fault():
                    self.ranks.check()

    async def status(self) -> dict[str, object]:
        out = await super().status()
        if self._core is not None:
            out["policy_version"] = int(self._core.step)
            out["info"] = {"checkpoint_step": str(self.saved_step)}
        return out

    # -- start: snapshot, then catch up from the log -------------------------------------

    async def setup(self) -> None:
        model_dir = await asyncio.to_thread(self.ctx.model_dir)
        # Ranks 1..N-1 start from this (the event loop's) thread: they die with it.
        self.ranks = start_ranks(self.cfg, model_dir)
        self._core = await asyncio.to_thread(make_trainer, self.cfg, model_dir, self.ranks)
        start_seq = 1
        checkpoint = latest_checkpoint(self.run_dir)
        if checkpoint is not None:
            extra = await asyncio.to_thread(self.core.load_checkpoint, checkpoint)
            self.saved_step = self.core.step
            self.last_batch_seq = int(extra.get("batch_seq", 0))
            start_seq = self.last_batch_seq + 1
        self.log.info(
            "trainer.loaded", model=str(model_dir), checkpoint=str(checkpoint), step=self.core.step
        )
        self.stored_weights = await self._list_stored_weights()
        with self._group_fault():
            await self.beating(self._catch_up(start_seq), consumer=self.sub.durable)
        if not self.pending:  # what an earlier process left: catch-up announced up to here
            await self._collect_weights(self.core.step)

    async def _catch_up(self, start_seq: int) -> None:
        end = await last_seq(self.bus, Topic.BATCH_ASSEMBLED)
        resume_seq = end + 1  # where the durable consumer takes over
        if end >= start_seq:
            recorded = await self._recorded_weights(start_seq)
            self.log.info("trainer.catch_up", from_seq=start_seq, to_seq=end, step=self.core.step)
            batches = read_log(
                self.bus, [(Topic.BATCH_ASSEMBLED, None)], (BatchAssembled,),
                from_seq=start_seq, until_seq=end, with_seq=True, stall_timeout_s=_READ_TIMEOUT_S,
            )  # fmt: skip
            async with contextlib.aclosing(batches):
                async for seq, batch in batches:
                    if self.stop_event.is_set():
                        return
                    if batch.step <= self.core.step or batch.event_id != batch_id(
                        batch.run, batch.step
                    ):
                        continue  # trained, or not the orchestrator's (dead-lettered live)
                    try:
                        self.core.check_next(batch)
                    except BatchGap:
                        # Leave the gap to the durable consumer: it retries the batch, then
                        # dead-letters it, visibly. Nothing after it is trained here.
                        self.log.error(
                            "trainer.batch_gap", seq=seq, step=batch.step, current=self.core.step
                        )
                        resume_seq = seq
                        break
                    # Not a handler: catch-up publishes each step's announcement itself.
                    await self._train(batch, seq, wait_s=0.0, recorded=recorded.get(batch.step))
                    await commit(self.bus, await self._announcement())
        if not self.stop_event.is_set():
            # The durable's position is derived state: catch-up just trained everything
            # before ``resume_seq``. Repositioning it (rather than resuming an old one)
            # means a batch in flight when the last process died is not waited for until
            # its ack_wait expires (with one message in flight, that would stall every
            # newer batch), and a fresh trainer does not download every batch body twice.
            self.sub.restart_at = resume_seq
            self.log.info("trainer.consumer_ready", start_seq=resume_seq, step=self.core.step)

    async def _recorded_weights(self, start_seq: int) -> dict[int, WeightsPublished]:
        """WeightsPublished already on the stream (first per step), from ``start_seq``;
        the versions stored after their announcement go to ``stored_later``."""
        out: dict[int, WeightsPublished] = {}
        topics = [(Topic.WEIGHTS_PUBLISHED, None), (Topic.WEIGHTS_STORED, None)]
        end = max([await last_seq(self.bus, topic) for topic, _ in topics])
        events = read_log(
            self.bus, topics, (WeightsPublished, WeightsStored),
            from_seq=start_seq, until_seq=end, with_seq=True, stall_timeout_s=_READ_TIMEOUT_S,
        )  # fmt: skip
        async for _, event in events:
            if isinstance(event, WeightsStored):
                self.stored_later.add(event.version)
            else:
                out.setdefault(event.step, event)
        return out

    # -- the durable consumer -------------------------------------------------------------

    async def on_batch(self, batch: BatchAssembled, delivery: Delivery) -> Effects | None:
        with self._group_fault():
            return await self._on_batch(batch, delivery)

    @contextlib.contextmanager
    def _group_fault(self) -> Iterator[None]:
        """A broken rank group is the trainer's fault, not the batch's: the role exits
        (``HandlerBroken``: the batch is handed back, not retried or dead-lettered) and
        its supervisor restarts the group, which resumes from its checkpoint."""
        try:
            yield
        except GroupBroken as e:
            self.broken = True
            raise HandlerBroken(str(e)) from e

    async def _on_batch(self, batch: BatchAssembled, delivery: Delivery) -> Effects | None:
        if batch.event_id != batch_id(batch.run, batch.step):
            raise Rejected(f"batch.assembled step {batch.step} is not the orchestrator's")
        wait_s = time.monotonic() - self.idle_since
        if batch.step > self.core.step:
            for p in self.pending:  # announced again first (their weights, before the next step)
                await self._prepare(p)
            self.core.check_next(batch)  # a gap raises BatchGap: retried, then dead-lettered
            await self._train(batch, delivery.stream_seq, wait_s)
        elif not self.pending:
            self.log.info("trainer.batch_already_trained", step=batch.step, current=self.core.step)
            return None  # idempotent by step: its effects are already on the stream
        return await self._announcement(refused=self._refusal_of(batch))

    def _refusal_of(self, batch: BatchAssembled) -> str | None:
        """Why this very batch was refused, if it was (a pending step of another batch
        that was refused is announced, not dead-lettered again with this one)."""
        for p in self.pending:
            if p.batch.event_id == batch.event_id and p.refused is not None:
                return p.refused
        return None

    async def _train(
        self,
        batch: BatchAssembled,
        seq: int,
        wait_s: float,
        recorded: WeightsPublished | None = None,
    ) -> None:
        metrics, refused = await asyncio.to_thread(take_step, self.core, batch)
        if refused is not None:  # refused before anything was trained: a step all the same
            self.log.error("trainer.batch_refused", step=batch.step, seq=seq, reason=refused)
        if metrics.get("nonfinite_step"):
            self.log.warning(
                "trainer.nonfinite_step", step=batch.step, loss=metrics.get("loss"),
                grad_norm=metrics.get("grad_norm"), detail="not applied: weights unchanged",
            )  # fmt: skip
        metrics = {**metrics, "wait_s": wait_s}
        self.pending.append(_Pending(batch, seq, metrics, recorded, refused=refused))

    async def _announcement(self, refused: str | None = None) -> Effects:
        """The announcement of every pending step: weights stored, events to publish, and
        the hook that marks them announced once the events are stored. With ``refused``
        (the batch in hand was refused) the hook then raises ``Rejected``, so the consumer
        dead-letters that batch once its step is announced."""
        for p in self.pending:
            await self._prepare(p)
        done = list(self.pending)
        events = [e for p in done for e in p.events or ()]

        async def after_publish() -> None:
            await self._announced_once(done)
            if refused is not None:
                raise Rejected(refused)

        return Effects(events, after_publish=after_publish)

    async def _prepare(self, p: _Pending) -> None:
        """Store the weights of a step just trained and build its events (once: a retry
        republishes the same events, which the server drops as duplicates)."""
        if p.events is not None:
            return
        batch = p.batch
        assert batch.step == self.core.step, "a pending step's weights are the current ones"
        shared = await asyncio.to_thread(self._share, batch.step)
        data = None
        when = "now" if shared is None else self._when_stored(batch.step, p.recorded)
        if when == "after":
            p.snapshot = await asyncio.to_thread(self.core.weights_snapshot)
        elif when == "now":
            data = await asyncio.to_thread(self.core.weights_bytes)
        # What the announcement's digest is of: the bytes when they are stored, else the
        # shared device copy ("dev:..."); a recorded one is compared the same way.
        p.digest = digest(data) if data is not None else shared.digest  # type: ignore[union-attr]
        events: list[Event] = []
        if p.recorded is not None and p.recorded.weights.digest != p.digest:
            self.log.error(
                "trainer.replay_diverged", step=batch.step,
                recorded=p.recorded.weights.digest, recomputed=p.digest,
            )  # fmt: skip
            p.snapshot = None  # other weights than those announced: nothing is stored as them
        if p.recorded is None:
            ref = shared
            if data is not None:
                ref = await self._store_weights(batch.step, data, p.digest)
                self.stored_weights[batch.step] = ref.kind
            events.append(
                WeightsPublished(
                    run=self.run,
                    event_id=derive_id(batch.event_id, "weights"),
                    causation_id=batch.event_id,
                    version=batch.step,
                    step=batch.step,
                    weights=ref,  # type: ignore[arg-type]
                    batch_id=batch.event_id,
                    device=shared,
                )
            )
        events.append(
            MetricsReported(
                run=self.run,
                event_id=derive_id(batch.event_id, "metrics"),
                causation_id=batch.event_id,
                role="trainer",
                step=batch.step,
                values=p.metrics,
                policy_version=batch.step,
            )
        )
        p.events = events

    async def _announced_once(self, done: list[_Pending]) -> None:
        with self._group_fault():  # its checkpoint runs on every rank
            await self._announced(done)

    async def _announced(self, done: list[_Pending]) -> None:
        """The steps' events are stored: record them, start storing the bytes of a
        version announced on the device, checkpoint if one is due."""
        for p in done:
            self.last_batch_seq = p.seq
            self.log.info(
                "trainer.step", step=p.batch.step, loss=p.metrics.get("loss"),
                grad_norm=p.metrics.get("grad_norm"), step_s=round(p.metrics.get("step_s", 0.0), 3),
                digest=p.digest[:19], refused=p.refused is not None,
            )  # fmt: skip
            if p.snapshot is not None:
                await self._stored_so_far()  # one store in flight at a time
                snapshot, p.snapshot = p.snapshot, None
                self.storing = asyncio.create_task(self._store_after(p.batch, snapshot))
        interval = self.cfg.trainer.checkpoint_interval
        if interval and any(p.batch.step % interval == 0 for p in done):
            await self._checkpoint()
        self.pending = [p for p in self.pending if p not in done]
        if done:
            await self._collect_weights(done[-1].batch.step)
        self.idle_since = time.monotonic()

    def _share(self, version: int) -> ObjectRef | None:
        """(worker thread) With ``trainer.weights_via = "ipc"``, write ``version`` into the
        shared device ring (made at the first call) and return its reference; with
        "broadcast", also send it to every replica joined (``roles.lib.model.broadcast``:
        the rendezvous starts at the first call) and return the broadcast reference."""
        if not self.cfg.trainer.weights_on_device:
            return None
        model = self.core.model
        if self.ring is None:
            state = model.state_dict()
            device = next(iter(state.values())).device
            # The dtype inference holds weights in (on CUDA bfloat16, unless said otherwise).
            served = serving_dtype(self.cfg.model.dtype, str(device), self.cfg.inference.dtype)
            dtype = resolve_dtype(served)  # serving_dtype names one: never 'auto'
            assert not isinstance(dtype, str), served
            self.ring = WeightsRing.create(
                Layout.of(state), dtype, device, self.ctx.paths.shm_weights
            )
            self.log.info("weights.ring", handle=self.ring.handle[:80], dtype=str(dtype),
                          slots=self.ring.slots, bytes=self.ring.buffer.nbytes)  # fmt: skip
        shared = self.ring.write(version, model.state_dict())
        if self.cfg.trainer.weights_via == "ipc":
            return shared
        if self.hub is None:
            self.hub = BroadcastHub(self.ring, self.cfg.trainer.broadcast_host, self._hub_event)
            self.log.info("weights.rendezvous", host=self.hub.host, port=self.hub.store.port,
                          session=self.hub.session)  # fmt: skip
        return self.hub.announce(version, shared)

    def _hub_event(self, event: str, fields: dict[str, object]) -> None:
        """(a sender thread) A replica joined or was dropped."""
        self.log.info(event, **fields)

    def _when_stored(self, version: int, recorded: WeightsPublished | None) -> str | None:
        """When the bytes of ``version``, shared on the device, are stored
        (``RunConfig.stores_weights``): "now", in its announcement (the last version; a
        recorded one stored so, whose digest is compared), "after" it, while the next
        step trains (``_store_after``), or None (a recorded one already stored after)."""
        if recorded is not None:
            if recorded.stored() is not None:
                return "now"
            if version in self.stored_later:
                return None
        if not self.cfg.stores_weights(version):
            return None
        if version < self.cfg.max_steps:
            return "after"
        return "now" if recorded is None else None

    async def _store_after(self, batch: BatchAssembled, snapshot: dict[str, torch.Tensor]) -> None:
        """Store a version announced on the device from its snapshot and say so
        (``weights.stored``), transient failures retried (``retry_transient``). Any
        failure is logged, never raised: the version stays device-only (the next stored
        one, or the last, is stored as usual) and training goes on."""
        started, version = time.perf_counter(), batch.step
        try:
            data = await asyncio.to_thread(tensors_to_bytes, snapshot)
            del snapshot
            weights_digest = await asyncio.to_thread(digest, data)

            async def store_and_say() -> ObjectRef:
                ref = await self._store_weights(version, data, weights_digest)
                await commit(self.bus, [WeightsStored(
                    run=self.run, event_id=derive_id(batch.event_id, "weights.stored"),
                    causation_id=derive_id(batch.event_id, "weights"), version=version,
                    step=version, weights=ref, batch_id=batch.event_id,
                )])  # fmt: skip
                return ref

            ref = await retry_transient(
                store_and_say, attempts=_STORE_ATTEMPTS, backoff_s=1.0, sleep=self.sleep,
                on_retry=lambda attempt, delay_s, e: self.log.warning(
                    "weights.store_retry", version=version, attempt=attempt,
                    delay_s=delay_s, error=repr(e)[:300],
                ),
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a version left unstored must not stop training
            self.log.error(
                "weights.store_failed", version=version, error=repr(e)[:300], exc_info=True
            )
            return
        self.stored_weights[version] = ref.kind  # once named: only then counted as kept
        self.stored_later.add(version)
        self.log.info(
            "weights.stored", version=version, kind=ref.kind, bytes=ref.size,
            digest=ref.digest[:19], store_s=round(time.perf_counter() - started, 3),
        )  # fmt: skip

    async def _stored_so_far(self) -> None:
        """Wait for the store in flight, if any (before a checkpoint, which must not
        cover a version whose bytes are not stored yet; before the next store; at exit).
        A waiter cancelled (the role stopping) leaves the store running: teardown waits
        for it again."""
        task = self.storing
        if task is None:
            return
        try:
            await asyncio.shield(task)
        finally:
            if task.done():
                self.storing = None

    async def _store_weights(self, version: int, data: bytes, weights_digest: str) -> ObjectRef:
        """Write ``version``'s bytes where ``trainer.weights_via`` says (the caller counts
        it in ``stored_weights`` once it is named on the log)."""
        via = self.cfg.trainer.weights_via
        if via == "auto" or self.cfg.trainer.weights_on_device:
            via = "object" if len(data) <= OBJECT_STORE_MAX_BYTES else "path"
        if via == "object":
            name = retention.object_name(version)
            stored = await self.bus.objects.put(name, data)
            return ObjectRef(
                kind="object", location=name, bucket=self.bus.objects.bucket,
                size=len(data), digest=stored,
            )  # fmt: skip
        path = self._weights_folder(via) / retention.file_name(version)
        await asyncio.to_thread(write_atomic, path, data)
        return ObjectRef(
            kind=via, location=str(path.resolve()), size=len(data), digest=weights_digest
        )

    def _weights_folder(self, kind: str) -> Path:
        """Where weights files of ``kind`` go: "path" in ``trainer.weights_dir/<run>``
        (default: the run's weights folder), "shm" in ``RunPaths.shm_weights``."""
        if kind == "shm":
            return self.ctx.paths.shm_weights
        given = self.cfg.trainer.weights_dir
        return Path(given) / self.run if given else self.ctx.paths.weights

    # -- weights garbage collection ----------------------------------------------------

    async def _list_stored_weights(self) -> dict[int, str]:
        """Every weights version stored so far (by earlier processes too), by kind."""
        found = {
            v: "object"
            for name in await self.bus.objects.names(retention.OBJECT_PREFIX)
            if (v := retention.version_of_object(name)) is not None
        }
        for kind in ("path", "shm"):
            folder = self._weights_folder(kind)
            if folder.is_dir():
                for f in folder.iterdir():
                    if (v := retention.version_of_file(f.name)) is not None:
                        found[v] = kind
        return found

    async def _collect_weights(self, newest: int) -> None:
        """Delete the stored versions no reader needs once ``newest`` is announced.

        Best effort: a failure is logged and the version stays listed, so it is deleted
        after the next step (or by the next process, which lists what is left).
        """
        stale = retention.collectable_in(self.cfg, self.stored_weights, newest)
        for version in stale:
            try:
                await self._delete_weights(version, self.stored_weights[version])
            except _STORE_ERRORS as e:
                self.log.warning("weights.collect_failed", version=version, error=repr(e))
                return
            del self.stored_weights[version]
            self.collected_since_rewrite += 1
        if stale:
            self.log.debug("weights.collected", versions=stale, newest=newest)
        if self.collected_since_rewrite >= retention.REWRITE_INITIAL_EVERY:
            try:
                await self._rewrite_initial_weights()
            except _STORE_ERRORS as e:  # the server's compaction frees the space later
                self.log.warning("weights.rewrite_failed", error=repr(e))

    async def _rewrite_initial_weights(self) -> None:
        """Move ``weights.v0`` to the tail of the bucket so the disk behind it is freed now
        (``BodyStore.rewrite``); only an object the orchestrator stored is moved."""
        self.collected_since_rewrite = 0
        if self.stored_weights.get(retention.INITIAL_VERSION) == "object":
            size = await self.bus.objects.rewrite(retention.object_name(retention.INITIAL_VERSION))
            self.log.debug("weights.initial_rewritten", bytes=size)

    async def _delete_weights(self, version: int, kind: str) -> None:
        if kind == "object":
            await self.bus.objects.delete(retention.object_name(version))
        else:
            path = self._weights_folder(kind) / retention.file_name(version)
            await asyncio.to_thread(path.unlink, missing_ok=True)

    async def _checkpoint(self) -> None:
        await self._stored_so_far()  # catch-up starts after it: it could not store them
        path = await asyncio.to_thread(
            self.core.save_checkpoint, self.run_dir, {"batch_seq": self.last_batch_seq}
        )
        self.saved_step = self.core.step
        self.log.info("trainer.checkpoint", step=self.core.step, path=str(path))

    async def teardown(self) -> None:
        if self._core is None:
            if self.ranks is not None:  # the group never formed
                await asyncio.to_thread(self.ranks.close, 5.0)
            return
        try:
            if self.broken:  # no collective can finish: the restarted group redoes the rest
                return
            if self.pending:
                with contextlib.suppress(Exception):  # best effort; catch-up redoes it otherwise
                    await commit(self.bus, await self._announcement())
            await self._stored_so_far()
            if not self.pending and self.core.step > self.saved_step and self.last_batch_seq:
                await self._checkpoint()
        finally:
            await asyncio.to_thread(self.core.close, self.broken)
            if self.hub is not None:
                self.hub.close()
            if self.ring is not None:
                self.ring.close()


async def main(ctx: RoleContext, nproc: int | None = None) -> None:
    """``rlbus role trainer [--nproc N]``: serve until SIGTERM, then checkpoint and exit;
    ``nproc`` overrides ``trainer.world_size``."""
    if nproc is not None:
        ctx.cfg.trainer = ctx.cfg.trainer.model_copy(update={"world_size": nproc})
    bus = await ctx.connect()
    await serve_role(TrainerRole(bus, ctx))
