"""The orchestrator role: replays the run's log through its fold and acts on it.

    rlbus role orchestrator --run R --nats-url U [--config C]

It has no durable consumer and no state of its own: at start it publishes
``run.started`` (if the run has none), then follows the run's log from sequence 1
(a ``Follow``: an ordered consumer run by the role runtime) and steps every event
through its core (``roles.orchestrator.core``: the fold and the decisions), returning
what the core decides for the runtime to publish. A restarted orchestrator therefore
rebuilds its state and re-makes its past decisions with the same ids, which the server
drops as duplicates; ``rlbus replay <run> orchestrator`` steps the same core over the
recorded log and diffs. An event the fold cannot take (``OrchestratorState.check``) is
dead-lettered and skipped.

Beside the fold, a watch (``_watch``, once a second) acts on the clock, which the fold
never reads: a train group not scored within ``orchestrator.group_timeout_s`` is
released (a ``samples.scored`` with ``failed="deadline ..."`` for each algorithm it
still waits for, folded like any other), and a run with no new batch for longer than
the stall threshold (``StepTimes``) is reported (``run.stalled`` with what it waits for, in the
heartbeat's info for ``rlbus status`` and the live view, a ``metrics.reported.stall``)
and, past ``stall_stop_s``, stopped with reason "stalled". Rollouts that only error
(none could train, no trainer step) for ``error_stop_s`` stop the run sooner, with
reason "rollout_errors" and the most frequent error (``policy.error_stop``): every
errored rollout is replaced by a new one, so such a run would otherwise loop silently
until the stall stop. An attached training algorithm whose worker shows no heartbeat
within ``attach_timeout_s`` of the watch first looking for it is detached
(``AttachWatch``: an ``algorithm.detached`` with reason "no worker ..."), so groups never
wait on a worker that is not there. What the watch publishes is on the log, so a
restart and a replay fold the same releases, detaches and the same stop.
"""

from __future__ import annotations

import contextlib
import hashlib
import statistics
import time
from collections import deque

from bus.consumer import Delivery, Effects
from bus.errors import Rejected
from bus.follower import Follow
from bus.offload import OBJECT_STORE_MAX_BYTES
from bus.reader import read_log
from bus.registry import is_alive
from bus.subjects import Topic, durable_name
from configs import RunConfig
from roles.orchestrator.core import (
    INPUTS,
    OrchestratorCore,
    changed_keys,
    decisive,
    segment_starts,
)
from roles.orchestrator.policy import error_stop, share_warning, waits_for
from roles.orchestrator.state import OrchestratorState
from roles.runtime.context import RoleContext, read_run_started
from roles.runtime.role import Role, serve_role
from schemas import (
    AlgorithmAttached,
    AlgorithmDetached,
    BatchAssembled,
    Event,
    MetricsReported,
    ObjectRef,
    RunStarted,
    RunStopped,
    SamplesScored,
    derive_id,
    new_id,
    run_resumed_id,
    run_started_id,
    run_stopped_id,
)


class Orchestrator(Role):
    role = "orchestrator"

    def __init__(self, bus, ctx: RoleContext):  # type: ignore[no-untyped-def]
        super().__init__(bus, ctx.instance, ctx.cfg.bus.heartbeat_interval_s)
        self.ctx = ctx
        self.cfg: RunConfig = ctx.cfg
        self.core = OrchestratorCore(ctx.cfg)
        self.stall: Stall | None = None  # the current stall, while there is one
        self.caught_up = False  # folded the whole log once (the watch waits for it)
        self.attaches = AttachWatch()  # attached algorithms whose worker was not seen yet

    async def setup(self) -> None:
        await self.start_run()

    @property
    def state(self) -> OrchestratorState:
        return self.core.state

    def subscriptions(self) -> list[Follow]:
        return [Follow("orchestrator", INPUTS, self.on_event)]

    def background(self) -> list:  # type: ignore[type-arg]
        return [self._watch()]

    async def status(self) -> dict[str, object]:
        s = self.state
        # Rollout counts of the groups folded so far, for the launcher's view and report
        # (their sum is every scored train rollout; errored and filtered ones never train).
        info = {
            "assembled": str(s.assembled), "trainable_rollouts": str(s.trainable_rollouts),
            "errored_rollouts": str(s.errored_rollouts),
            "filtered_rollouts": str(s.filtered_rollouts),
        }  # fmt: skip
        if s.error_streak:
            info["erroring"] = s.streak_errors.most_common(1)[0][0]
        if self.stall is not None:
            info["stalled_s"] = f"{self.stall.seconds():.0f}"
            info["waiting_for"] = "; ".join(self.stall.waiting_for)
        return {"policy_version": self.state.trainer_version, "info": info}

    async def start_run(self) -> None:
        first = await read_run_started(self.bus)
        if first is not None:
            await self._resume(first)
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
                event_id=run_started_id(self.run),
                config=self.cfg.model_dump(mode="json"),
                seed=self.cfg.seed,
                model_path=str(weights_dir),
                initial_weights=initial,
            )  # fmt: skip
        )
        self.log.info("run.started", model=str(weights_dir))

    async def _resume(self, first: RunStarted) -> None:
        """A restart, or ``rlbus up --resume``: when this process's config differs from
        the one in force (the newest of the run's starts), publish it as the start of the
        run's next segment (``resumed=True``, ``run_resumed_id``), which the fold, the
        launcher and a replay read as the config from there on."""
        events = read_log(self.bus, [(Topic.RUN_STARTED, None)], (RunStarted,))
        async with contextlib.aclosing(events):
            starts = segment_starts(self.run, [e async for e in events]) or [first]
        in_force = starts[-1]
        if self.core.config_of(in_force) is self.cfg:
            self.log.info("orchestrator.resuming", segment=len(starts) - 1)
            return
        resumed = RunStarted(
            run=self.run, event_id=run_resumed_id(self.run, len(starts)),
            causation_id=in_force.event_id, config=self.cfg.model_dump(mode="json"),
            seed=self.cfg.seed, model_path=first.model_path,
            initial_weights=first.initial_weights, resumed=True,
        )  # fmt: skip
        await self.bus.publish(resumed)
        changed = changed_keys(decisive(self.core.config_of(in_force)), decisive(self.cfg))
        self.log.info("run.resumed", segment=len(starts), changed=changed)

    async def on_event(self, event: Event, delivery: Delivery) -> Effects:
        """One transition of the core; what it decides is published (a refused event is
        dead-lettered by the follower, then what the refusal caused is published)."""
        self.caught_up = self.caught_up or delivery.pending == 0
        t = self.core.step(event)
        if t.rejected is None and isinstance(event, AlgorithmAttached | AlgorithmDetached):
            self.attaches.saw(event)
        out = Effects(t.outputs, after_publish=lambda: self._log_decisions(t.outputs))
        if t.rejected is not None:
            raise Rejected(t.rejected, outputs=out)
        return out

    # -- the watch: what depends on the clock --------------------------------------------

    async def _watch(self, interval_s: float = 1.0) -> None:
        o = self.cfg.orchestrator
        dispatched: dict[str, float] = {}  # group id -> when the watch first saw it in flight
        steps = StepTimes()
        assembled, progress = -1, time.monotonic()
        erroring = ErrorClock()
        while not await self.sleep(interval_s):
            s, now = self.state, time.monotonic()
            if s.started is None or s.stopped is not None or not self.caught_up:
                # Still folding the log (a restart): its deadlines start once caught up.
                dispatched.clear()
                progress = now
                continue
            if s.assembled != assembled:
                if assembled >= 0 and s.assembled > 0:  # a new batch (not one found at start)
                    steps.batch(now, stalled=self.stall is not None)
                assembled, progress = s.assembled, now
                self._stall_over()
            for gid in list(dispatched):
                if gid not in s.groups:
                    del dispatched[gid]
            for gid, group in list(s.groups.items()):
                since = dispatched.setdefault(gid, now)
                if now - since > o.group_timeout_s and group.request.phase != "eval":
                    await self._release(group, now - since)
                    dispatched[gid] = now  # asked once; a later pass asks again if needed
            if self.attaches.waiting:
                await self._detach_absent(now)
            if detail := error_stop(s, self.cfg, erroring.seconds(s, now)):
                await self._stop("rollout_errors", detail)
                continue
            threshold = max(o.stall_min_s, o.stall_factor * steps.median())
            if now - progress > threshold:
                await self._stalled(progress, threshold)

    async def _release(self, group, waited_s: float) -> None:  # type: ignore[no-untyped-def]
        """A group past its deadline: each algorithm it still waits for is marked failed."""
        r = group.request
        reason = f"deadline: not scored within {self.cfg.orchestrator.group_timeout_s:g} s"
        self.log.warning(
            "group.released", group=r.group_id, env=r.env, waited_s=round(waited_s, 1),
            algorithms=sorted(group.waiting_for),
        )  # fmt: skip
        await self.bus.publish_many(
            [
                SamplesScored(
                    run=self.run,
                    event_id=derive_id("deadline", a, r.group_id),
                    causation_id=r.event_id,
                    algorithm=a,
                    env=r.env,
                    group_id=r.group_id,
                    request_id=r.event_id,
                    task_index=r.task.index,
                    step=r.step,
                    samples=[],
                    failed=reason,
                )  # fmt: skip
                for a in sorted(group.waiting_for)
            ]
        )

    async def _stalled(self, since: float, threshold: float) -> None:
        """Report the stall (at its start, then every threshold), stop the run past the limit."""
        wants = waits_for(self.state, self.cfg) + await self._silent_roles()
        if self.stall is None:
            self.stall = Stall(since, wants)
        self.stall.waiting_for = wants
        seconds = self.stall.seconds()
        if time.monotonic() - self.stall.reported >= threshold:
            self.stall.reported = time.monotonic()
            self.log.warning(
                "run.stalled", stalled_s=round(seconds), waiting_for=wants,
                step=self.state.assembled,
            )  # fmt: skip
            metrics = MetricsReported(
                run=self.run, event_id=new_id(), role="stall", step=self.state.assembled,
                policy_version=self.state.trainer_version,
                values={"stalled_s": seconds, "groups_in_flight": float(len(self.state.groups))},
            )  # fmt: skip
            await self.bus.publish(metrics)
        if seconds > self.cfg.orchestrator.stall_stop_s:
            detail = f"no batch for {seconds:.0f} s; waiting for: " + "; ".join(wants)
            await self._stop("stalled", detail)

    async def _stop(self, reason: str, detail: str) -> None:
        """Stop the run from the watch (the fold reads the ``run.stopped`` back; until
        then a second one has the same id and is dropped)."""
        self.log.error("run.stopping", reason=reason, detail=detail)
        await self.bus.publish(
            RunStopped(
                run=self.run,
                event_id=run_stopped_id(self.run, self.state.segment),
                reason=reason,
                step=self.state.trainer_version,
                detail=detail,
            )  # fmt: skip
        )

    def _stall_over(self) -> None:
        if self.stall is not None:
            self.log.info("run.unstalled", stalled_s=round(self.stall.seconds()))
            self.stall = None

    async def _detach_absent(self, now: float) -> None:
        """Detach each attached algorithm whose worker showed no heartbeat within
        ``orchestrator.attach_timeout_s`` of the watch seeing its attach (the event is
        the orchestrator's input like a user's detach: its groups stop waiting)."""
        try:
            beats = await self.bus.live_roles()
        except Exception as e:  # noqa: BLE001 - a registry hiccup: ask again next second
            self.log.warning("attach.registry_unreadable", error=repr(e))
            return
        interval, wall = self.cfg.bus.heartbeat_interval_s, time.time_ns()
        live = {
            name
            for hb in beats
            if hb.consumer and is_alive(hb, interval, wall)
            for name in hb.consumer.split(",")
        }
        timeout = self.cfg.orchestrator.attach_timeout_s
        for attached in self.attaches.absent(live, now, timeout):
            reason = (f"no worker: no heartbeat from {durable_name('algorithm', attached.algorithm)} "
                      f"within {timeout:g} s of its attach (orchestrator.attach_timeout_s)")  # fmt: skip
            self.log.warning("algorithm.no_worker", algorithm=attached.algorithm, reason=reason)
            await self.bus.publish(
                AlgorithmDetached(
                    run=self.run,
                    event_id=derive_id(self.run, "no-worker", attached.event_id),
                    causation_id=attached.event_id,
                    algorithm=attached.algorithm,
                    reason=reason,
                )  # fmt: skip
            )

    async def _silent_roles(self) -> list[str]:
        """Role instances of this run whose heartbeat stopped (crashed, SIGSTOPped, hung)."""
        try:
            beats = await self.bus.live_roles()
        except Exception as e:  # noqa: BLE001 - the report must not die with the registry
            return [f"role registry unreadable: {e!r}"]
        now = time.time_ns()
        interval = self.cfg.bus.heartbeat_interval_s
        return [
            f"{hb.role} {hb.instance}: no heartbeat for {(now - hb.last_seen_ns) / 1e9:.0f} s"
            for hb in beats
            if hb.status != "stopped" and not is_alive(hb, interval, now)
        ]

    def _log_decisions(self, out: list[Event]) -> None:
        for e in out:
            if isinstance(e, BatchAssembled):
                self.log.info(
                    "batch.assembled", step=e.step, phase=e.phase, samples=len(e.samples),
                    trainer_version=self.state.trainer_version,
                )  # fmt: skip
            elif isinstance(e, RunStopped):
                self.log.info("run.stopped", reason=e.reason, detail=e.detail)
            elif isinstance(e, MetricsReported) and (warning := share_warning(e, self.cfg)):
                self.log.warning("batch.low_trainable_share", step=e.step, detail=warning)
            elif isinstance(e, MetricsReported) and e.role == "eval":
                values = {k.replace("/", "_").replace("@", "_at_"): v for k, v in e.values.items()}
                self.log.info("eval.reported", version=e.step, **values)


class StepTimes:
    """The run's recent step times, what the stall threshold scales: from one batch the
    watch sees to the next, when no stall was reported in between. Neither the roles'
    startup, nor a restart's catch-up, nor a stall itself is a step: any of them would
    raise the threshold past the next real stall (a warm start's teacher batch arrives
    seconds before inference has loaded the policy for the first RL batch)."""

    def __init__(self, keep: int = 10) -> None:
        self.times: deque[float] = deque(maxlen=keep)
        self.last: float | None = None  # when the newest batch was seen (monotonic)

    def batch(self, now: float, stalled: bool) -> None:
        """A new batch seen at ``now``; ``stalled``: a stall was reported since the last."""
        if self.last is not None and not stalled:
            self.times.append(now - self.last)
        self.last = now

    def median(self) -> float:
        return statistics.median(self.times) if self.times else 0.0


class AttachWatch:
    """Attached training algorithms whose worker the watch has not seen live yet, with
    when it first looked for each (monotonic): ``absent`` names those past the bound."""

    def __init__(self) -> None:
        self.waiting: dict[str, tuple[AlgorithmAttached, float | None]] = {}

    def saw(self, event: AlgorithmAttached | AlgorithmDetached) -> None:
        """An attach or a detach the core took."""
        if isinstance(event, AlgorithmDetached):
            self.waiting.pop(event.algorithm, None)
        elif not event.shadow:  # a shadow's samples never train: nothing waits for them
            self.waiting[event.algorithm] = (event, None)

    def absent(self, live: set[str], now: float, timeout_s: float) -> list[AlgorithmAttached]:
        """Forget those whose worker's consumer is ``live``; return (and forget) those not
        live ``timeout_s`` after the first look."""
        out = []
        for algorithm, (event, since) in list(self.waiting.items()):
            if durable_name("algorithm", algorithm) in live:
                del self.waiting[algorithm]
            elif since is None:
                self.waiting[algorithm] = (event, now)
            elif now - since >= timeout_s:
                del self.waiting[algorithm]
                out.append(event)
        return out


class ErrorClock:
    """How long rollouts have only errored (``policy.error_stop``): since the later of
    when the watch saw the error streak begin and when it saw the newest weights."""

    def __init__(self) -> None:
        self.version = -1  # the trainer version last seen, and when (monotonic)
        self.version_at = 0.0
        self.streak_at: float | None = None  # when the current error streak was first seen

    def seconds(self, state: OrchestratorState, now: float) -> float:
        if state.trainer_version != self.version:
            self.version, self.version_at = state.trainer_version, now
        if state.error_streak == 0:
            self.streak_at = None
            return 0.0
        if self.streak_at is None:
            self.streak_at = now
        return now - max(self.version_at, self.streak_at)


class Stall:
    """A stall in progress: since when (monotonic), what the run waits for."""

    def __init__(self, since: float, waiting_for: list[str]):
        self.since = since
        self.waiting_for = waiting_for
        self.reported = 0.0  # when it was last reported (monotonic)

    def seconds(self) -> float:
        return time.monotonic() - self.since


async def main(ctx: RoleContext) -> None:
    bus = await ctx.connect()
    await serve_role(Orchestrator(bus, ctx))
