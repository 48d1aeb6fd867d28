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
3. **the durable consumer** ``trainer`` is then (re)created to start right after what
   catch-up read, and handles the rest with one message in flight
   (``max_ack_pending=1``, so a retried batch can never be overtaken by the next): a
   batch whose step <= the current step is acked without training (idempotent by
   step); a batch with step > current + 1 is a gap and raises, so it is retried and
   then dead-lettered, never silently skipped (catch-up stops at a gap and leaves it
   to this consumer).

Each step runs in a worker thread so heartbeats and ``in_progress`` keep flowing. Its
outputs are published *before* any checkpoint that includes it is written (a
checkpoint past an unannounced step would hide that step from the catch-up), and the
input is acked after both. Weights go to the run's object store as ``weights.v<N>``,
or, past 200 MB, to ``<run_dir>/weights/v<N>.safetensors`` (an ``ObjectRef`` of kind
``path``). Checkpoints every ``trainer.checkpoint_interval`` steps and on graceful stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path

import nats.errors
import nats.js.errors
from nats.js.api import DeliverPolicy

from bus.consumer import Consumer, Delivery, Subscription
from bus.reader import last_seq, read_log
from bus.registry import Heartbeat
from bus.runtime import Bus
from bus.subjects import Topic, durable_name
from roles.lib.model.weights import digest
from roles.runtime.context import RoleContext
from roles.runtime.role import Role, serve_role
from roles.trainer.core import TrainerCore, latest_checkpoint
from schemas import (
    BatchAssembled,
    Event,
    MetricsReported,
    ObjectRef,
    WeightsPublished,
    derive_id,
)

# Weights above this go to a shared path instead of the object store.
OBJECT_STORE_MAX_BYTES = 200 * 1024 * 1024
# How long catch-up waits for the next message it knows is on the stream.
_READ_TIMEOUT_S = 30.0


class BatchGap(Exception):
    """A batch arrived whose step is past the next one: an earlier batch is missing."""


@dataclass
class _Pending:
    """A trained step whose weights and metrics are not announced yet."""

    batch: BatchAssembled
    seq: int  # its stream sequence (recorded in checkpoints for catch-up)
    metrics: dict[str, float]
    recorded: WeightsPublished | None  # its announcement already on the stream (catch-up)


class TrainerRole(Role):
    role = "trainer"

    def __init__(self, bus: Bus, ctx: RoleContext):
        super().__init__(bus, ctx.instance, heartbeat_interval_s=ctx.cfg.bus.heartbeat_interval_s)
        self.ctx = ctx
        self.cfg = ctx.cfg
        self.run_dir = ctx.run_dir
        self._core: TrainerCore | None = None  # built in setup (loads the model)
        self.sub = Subscription(
            durable_name("trainer"),
            [(Topic.BATCH_ASSEMBLED, None)],
            self.on_batch,
            batch=1,
            max_ack_pending=1,
        )
        self.saved_step = 0  # step of the newest checkpoint on disk
        self.last_batch_seq = 0  # stream seq of the batch behind ``core.step``
        self.pending: _Pending | None = None  # trained but not yet announced
        self.idle_since = time.monotonic()

    @property
    def core(self) -> TrainerCore:
        if self._core is None:
            raise RuntimeError("the trainer is not set up yet")
        return self._core

    def subscriptions(self) -> list[Subscription]:
        return [self.sub]

    async def status(self) -> dict[str, object]:
        out = await super().status()
        if self._core is not None:
            out["policy_version"] = int(self._core.step)
            out["info"] = {"checkpoint_step": str(self.saved_step)}
        return out

    # -- start: snapshot, then catch up from the log -------------------------------------

    async def setup(self) -> None:
        model_dir = await asyncio.to_thread(self.ctx.model_dir)
        self._core = await asyncio.to_thread(TrainerCore, self.cfg, model_dir)
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
        await self._with_heartbeat(self._catch_up(start_seq))

    async def _with_heartbeat(self, work: Awaitable[None]) -> None:
        """Keep the registry entry alive while setup works (serve_role's starts after)."""
        hb = Heartbeat(
            self.bus.js, self.run, self.role, self.instance, self.heartbeat_interval_s,
            consumer=self.sub.durable, probe=self.status,
        )  # fmt: skip

        done = asyncio.Event()

        async def beat() -> None:
            while not done.is_set():
                with contextlib.suppress(Exception):
                    await hb.beat()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), self.heartbeat_interval_s)

        # Stopped by an event, not by cancel(): on Python 3.11 a cancel that lands as a
        # nats request completes is swallowed by asyncio.wait_for, and the loop would
        # never end.
        task = asyncio.create_task(beat())
        try:
            await work
        finally:
            done.set()
            await task

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
                    if batch.step <= self.core.step:
                        continue
                    if batch.step != self.core.step + 1:
                        # Leave the gap to the durable consumer: it retries the batch, then
                        # dead-letters it, visibly. Nothing after it is trained here.
                        self.log.error(
                            "trainer.batch_gap", seq=seq, step=batch.step, current=self.core.step
                        )
                        resume_seq = seq
                        break
                    await self._advance(batch, seq, wait_s=0.0, recorded=recorded.get(batch.step))
        if not self.stop_event.is_set():
            await self._reset_durable(resume_seq)

    async def _recorded_weights(self, start_seq: int) -> dict[int, WeightsPublished]:
        """WeightsPublished already on the stream (first per step), from ``start_seq``."""
        out: dict[int, WeightsPublished] = {}
        end = await last_seq(self.bus, Topic.WEIGHTS_PUBLISHED)
        events = read_log(
            self.bus, [(Topic.WEIGHTS_PUBLISHED, None)], (WeightsPublished,),
            from_seq=start_seq, until_seq=end, with_seq=True, stall_timeout_s=_READ_TIMEOUT_S,
        )  # fmt: skip
        async for _, event in events:
            out.setdefault(event.step, event)
        return out

    async def _reset_durable(self, start_seq: int) -> None:
        """(Re)create the durable consumer to start right after what catch-up covered.

        Its position is derived state: catch-up just trained everything before
        ``start_seq``. Recreating it (rather than resuming an old one) means a batch that
        was in flight when the last process died is not waited for until its ack_wait
        expires (with one message in flight, that would stall every newer batch), and a
        fresh trainer does not download every batch body a second time.
        """
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.bus.js.delete_consumer(self.bus.stream, self.sub.durable)
        config = Consumer(self.bus, self.sub, self.role).config()
        config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = start_seq
        await self.bus.js.add_consumer(self.bus.stream, config)
        self.log.info("trainer.consumer_ready", start_seq=start_seq, step=self.core.step)

    # -- the durable consumer -------------------------------------------------------------

    async def on_batch(self, batch: BatchAssembled, delivery: Delivery) -> list[Event]:
        wait_s = time.monotonic() - self.idle_since
        if self.pending is not None:
            await self._announce()  # a trained step whose announcement failed comes first
        if batch.step <= self.core.step:
            self.log.info("trainer.batch_already_trained", step=batch.step, current=self.core.step)
            return []  # idempotent by step: its effects are already on the stream
        self._check_next(batch)
        await self._advance(batch, delivery.stream_seq, wait_s=wait_s)
        return []

    def _check_next(self, batch: BatchAssembled) -> None:
        if batch.step != self.core.step + 1:
            raise BatchGap(
                f"batch {batch.event_id} has step {batch.step} but the trainer is at step "
                f"{self.core.step}: step {self.core.step + 1} is missing"
            )

    async def _advance(
        self,
        batch: BatchAssembled,
        seq: int,
        wait_s: float,
        recorded: WeightsPublished | None = None,
    ) -> None:
        """Train one batch, then announce it (weights, metrics, checkpoint if due)."""
        metrics = await asyncio.to_thread(self.core.train_step, batch)
        self.pending = _Pending(batch, seq, {**metrics, "wait_s": wait_s}, recorded)
        await self._announce()

    async def _announce(self) -> None:
        """Store and announce the weights of the step just trained; safe to repeat.

        Until this succeeds ``pending`` stays set, so a failure (object store, publish,
        checkpoint) is redone on the next delivery instead of the step going unannounced.
        """
        p = self.pending
        assert p is not None and p.batch.step == self.core.step
        batch = p.batch
        data = await asyncio.to_thread(self.core.weights_bytes)
        weights_digest = digest(data)
        events: list[Event] = []
        if p.recorded is not None and p.recorded.weights.digest != weights_digest:
            self.log.error(
                "trainer.replay_diverged", step=batch.step,
                recorded=p.recorded.weights.digest, recomputed=weights_digest,
            )  # fmt: skip
        if p.recorded is None:
            ref = await self._store_weights(batch.step, data, weights_digest)
            events.append(
                WeightsPublished(
                    run=self.run,
                    event_id=derive_id(batch.event_id, "weights"),
                    causation_id=batch.event_id,
                    version=batch.step,
                    step=batch.step,
                    weights=ref,
                    batch_id=batch.event_id,
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
        await self.bus.publish_many(events)
        self.last_batch_seq = p.seq
        self.log.info(
            "trainer.step", step=batch.step, loss=p.metrics["loss"],
            grad_norm=p.metrics["grad_norm"], step_s=round(p.metrics["step_s"], 3),
            digest=weights_digest[:19],
        )  # fmt: skip
        interval = self.cfg.trainer.checkpoint_interval
        if interval and batch.step % interval == 0:
            await self._checkpoint()
        self.pending = None
        self.idle_since = time.monotonic()

    async def _store_weights(self, version: int, data: bytes, weights_digest: str) -> ObjectRef:
        if len(data) <= OBJECT_STORE_MAX_BYTES:
            name = f"weights.v{version}"
            stored = await self.bus.objects.put(name, data)
            return ObjectRef(
                kind="object", location=name, bucket=self.bus.objects.bucket,
                size=len(data), digest=stored,
            )  # fmt: skip
        path = self.run_dir / "weights" / f"v{version}.safetensors"
        await asyncio.to_thread(_write_atomic, path, data)
        return ObjectRef(
            kind="path", location=str(path.resolve()), size=len(data), digest=weights_digest
        )

    async def _checkpoint(self) -> None:
        path = await asyncio.to_thread(
            self.core.save_checkpoint, self.run_dir, {"batch_seq": self.last_batch_seq}
        )
        self.saved_step = self.core.step
        self.log.info("trainer.checkpoint", step=self.core.step, path=str(path))

    async def teardown(self) -> None:
        if self._core is None:
            return
        if self.pending is not None:
            with contextlib.suppress(Exception):  # best effort; catch-up redoes it otherwise
                await self._announce()
        if self.pending is None and self.core.step > self.saved_step and self.last_batch_seq:
            await self._checkpoint()


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


async def main(ctx: RoleContext) -> None:
    """``rlbus role trainer``: serve until SIGTERM, then checkpoint and exit."""
    bus = await ctx.connect()
    await serve_role(TrainerRole(bus, ctx))
