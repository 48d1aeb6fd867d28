"""The orchestrator role: replays the run's log through its fold and acts on it.

    rlbus role orchestrator --run R --nats-url U [--config C]

It has no durable consumer and no state of its own: at start it publishes
``run.started`` (if the run has none), then follows the run's log from sequence 1
(a ``Follow``: an ordered consumer run by the role runtime), folds every event into
``OrchestratorState`` and, after each one, returns what ``decide`` returns for the
runtime to publish. A restarted orchestrator therefore rebuilds its state
and re-makes its past decisions with the same ids, which the server drops as duplicates.
"""

from __future__ import annotations

import hashlib

from bus.consumer import Delivery, Effects
from bus.follower import Follow
from bus.offload import OBJECT_STORE_MAX_BYTES
from bus.subjects import Topic
from configs import RunConfig
from roles.orchestrator.policy import decide, trains_on
from roles.orchestrator.state import OrchestratorState
from roles.runtime.context import RoleContext, read_run_started
from roles.runtime.role import Role, serve_role
from schemas import (
    BatchAssembled,
    Event,
    MetricsReported,
    ObjectRef,
    RunStarted,
    RunStopped,
    derive_id,
)

READS = (
    Topic.RUN_STARTED, Topic.RUN_STOPPED, Topic.TASK_REQUESTED, Topic.SAMPLES_SCORED,
    Topic.BATCH_ASSEMBLED, Topic.WEIGHTS_PUBLISHED, Topic.EVAL_COMPLETED,
    Topic.ALGORITHM_ATTACHED, Topic.ALGORITHM_DETACHED,
)  # fmt: skip


class Orchestrator(Role):
    role = "orchestrator"

    def __init__(self, bus, ctx: RoleContext):  # type: ignore[no-untyped-def]
        super().__init__(bus, ctx.instance, ctx.cfg.bus.heartbeat_interval_s)
        self.ctx = ctx
        self.cfg: RunConfig = ctx.cfg
        self.state = OrchestratorState(trains_on=trains_on(ctx.cfg))
        self.applied = 0

    async def setup(self) -> None:
        await self.start_run()

    def subscriptions(self) -> list[Follow]:  # type: ignore[override]
        topics = [(t, None) for t in READS] + [(Topic.METRICS_REPORTED, "eval")]
        return [Follow("orchestrator", topics, self.on_event)]

    async def status(self) -> dict[str, object]:
        return {
            "policy_version": self.state.trainer_version,
            "info": {"assembled": str(self.state.assembled)},
        }

    async def start_run(self) -> None:
        if await read_run_started(self.bus) is not None:
            self.log.info("orchestrator.resuming")
            return
        weights_dir = self.ctx.model_dir()
        initial = None
        files = sorted(weights_dir.glob("*.safetensors"))
        if len(files) == 1 and files[0].stat().st_size <= OBJECT_STORE_MAX_BYTES:
            data = files[0].read_bytes()
            name = "weights.v0"
            digest = await self.bus.objects.put(name, data)
            initial = ObjectRef(
                kind="object",
                location=name,
                bucket=self.bus.objects.bucket,
                size=len(data),
                digest=digest,
            )
        elif files:
            h = hashlib.sha256()
            for f in files:
                h.update(f.read_bytes())
            initial = ObjectRef(
                kind="path", location=str(weights_dir), digest="sha256:" + h.hexdigest()
            )
        await self.bus.publish(
            RunStarted(
                run=self.run,
                event_id=derive_id(self.run, "started"),
                config=self.cfg.model_dump(mode="json"),
                seed=self.cfg.seed,
                model_path=str(weights_dir),
                initial_weights=initial,
            )  # fmt: skip
        )
        self.log.info("run.started", model=str(weights_dir))

    async def on_event(self, event: object, delivery: Delivery) -> Effects:
        """Fold one event, then decide: what the decision returns is published."""
        self.state.apply(event, skip_zero=self.cfg.orchestrator.skip_zero_advantage_groups)
        self.applied += 1
        out = decide(self.state, self.cfg, cause=event.event_id)  # type: ignore[attr-defined]
        return Effects(out, after_publish=lambda: self._log_decisions(out))

    def _log_decisions(self, out: list[Event]) -> None:
        for e in out:
            if isinstance(e, BatchAssembled):
                self.log.info(
                    "batch.assembled", step=e.step, phase=e.phase, samples=len(e.samples),
                    trainer_version=self.state.trainer_version,
                )  # fmt: skip
            elif isinstance(e, RunStopped):
                self.log.info("run.stopped", reason=e.reason, detail=e.detail)
            elif isinstance(e, MetricsReported) and e.role == "eval":
                values = {k.replace("/", "_").replace("@", "_at_"): v for k, v in e.values.items()}
                self.log.info("eval.reported", version=e.step, **values)


async def main(ctx: RoleContext) -> None:
    bus = await ctx.connect()
    await serve_role(Orchestrator(bus, ctx))
