"""The algorithm worker role: complete groups of traces in, ``samples.scored.<id>`` out.

    rlbus role algorithm --run demo --name grpo

One worker per algorithm id (``orchestrator.algorithms[].id``; an id absent from the
config is taken as a registered algorithm name with no options). It reads
``trace.completed.*`` with its own durable consumer ``algorithm-<id>`` (a worker
attached mid-run starts from the beginning of the log), and hands each trace to its pure core
(``roles.algorithm.core.ScoringCore``: route, buffer per group until ``group_size``
distinct rollouts arrived, score, fold the state; algorithm replay drives the same
object). A complete group is one ``SamplesScored`` with the id
``derive_id("scored", id, group_id)``, returned for the runtime to publish: a
re-publish is deduplicated, and the core marks the group scored only after the
publish is acknowledged.

A worker attached to a live run (``rlbus algorithm attach``) may start at a later
sequence (``from_seq``: the attach event, unless ``--from-start``), and stops by itself
when an ``algorithm.detached`` event for its id appears (a follower of that subject and
``run.stopped``, ``on_end``). Distillation algorithms get
their reference logprobs from the inference role first (``roles/algorithm/scoring.py``),
up to ``orchestrator.algorithms[].max_concurrent`` groups at once (a stateless
algorithm's groups score independently, so a group's samples are the same whichever
finishes first; a stateful one scores one group at a time, in order);
every worker adds the env's tool-output cross-entropy when the env's config asks for it
(``[orchestrator.train.env.sft]``).

The worker keeps no state the log cannot rebuild. At start it folds over the log with
the log reader (``bus.reader``): first its own ``samples.scored.<id>`` (which groups
are done, and the state of a stateful algorithm), then ``trace.completed.*`` (the traces
of groups not scored yet, scoring any group the log already completes). Only then does
the durable consumer start; a trace is acked as soon as it is buffered, because a
restarted worker gets it back from the log, not from the consumer. A long catch-up
(``rlbus algorithm attach --from-start`` on a long run) logs ``algorithm.catch_up``
with the traces read of those stored every ``CATCH_UP_LOG_S`` seconds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from bus.consumer import Delivery, Effects, Subscription
from bus.follower import Follow
from bus.reader import Progress, last_seq, read_log
from bus.runtime import Bus
from bus.subjects import Topic, check_token, durable_name
from configs import RunConfig
from configs.orchestrator import AlgorithmConfig
from roles.algorithm.base import Refs
from roles.algorithm.core import ScoringCore
from roles.algorithm.samples import GroupBuffer
from roles.algorithm.scoring import RefScorer
from roles.runtime.context import RoleContext
from roles.runtime.role import Role, serve_role
from schemas import (
    AlgorithmDetached,
    Event,
    MetricsReported,
    RunStopped,
    SamplesScored,
    TraceCompleted,
)

# Scored groups published per pipelined window while catching up on the log.
CATCH_UP_WINDOW = 64
CATCH_UP_LOG_S = 5.0  # seconds between two ``algorithm.catch_up`` progress lines


@dataclass
class _Window:
    """What was scored since the last metrics report."""

    groups: int = 0
    zero_advantage: int = 0
    excluded: int = 0
    rewards: list[float] = field(default_factory=list)


class AlgorithmWorker(Role):
    """Scores complete groups of traces with one algorithm; one instance per algorithm id."""

    role = "algorithm"

    def __init__(
        self,
        bus: Bus,
        instance: str,
        core: ScoringCore,
        metrics_interval_s: float = 10.0,
        heartbeat_interval_s: float = 2.0,
        *,
        scorer: RefScorer | None = None,
        max_concurrent: int = 1,
        exit_when_done: bool = False,
        on_catch_up: Progress | None = None,
    ):
        super().__init__(bus, instance, heartbeat_interval_s)
        self.name = check_token(core.algorithm_id, "algorithm id")
        self.core = core
        self.algorithm = core.algorithm
        self.scorer = scorer
        # Groups scored at once: only a stateless algorithm that waits on a model gains, and
        # only there is the order in which groups finish scoring free (no state to fold).
        self.concurrency = (
            max_concurrent if scorer is not None and not core.algorithm.stateful else 1
        )
        self.from_seq = core.from_seq
        self.detach_floor = 0  # newest algorithm.detached seq for our id when we started
        self.run_stopped = asyncio.Event()  # seen run.stopped (``on_end``)
        self.exit_when_done = exit_when_done  # attached by hand: exit once the run stopped
        self.on_catch_up = on_catch_up  # (traces read, traces stored) while catching up
        self.metrics_interval_s = metrics_interval_s
        self.scored_total = 0  # groups this instance published (catch-up included)
        self.last_step = 0
        self.window = _Window()
        self.log = self.log.bind(algorithm=self.name)

    @property
    def buffer(self) -> GroupBuffer:
        return self.core.buffer

    @property
    def state(self) -> Any:
        return self.core.state

    def subscriptions(self) -> list[Subscription | Follow]:
        # batch 32: traces are up to the offload threshold (512 KiB) each, and a fetch of
        # batch x size above 64 MiB gets the consumer cut off (NATS_NOTES #5).
        traces = Subscription(
            durable_name("algorithm", self.name),
            [(Topic.TRACE_COMPLETED, None)],
            self.on_trace,
            batch=32,
            start_seq=self.from_seq,
            concurrency=self.concurrency,
        )
        if not self.exit_when_done:
            return [traces]
        # Attached by hand: its end is on the log (a detach after its start, the run's stop).
        ends = [(Topic.ALGORITHM_DETACHED, self.name), (Topic.RUN_STOPPED, None)]
        return [traces, Follow("end", ends, self.on_end)]

    async def setup(self) -> None:
        self.detach_floor = await last_seq(self.bus, Topic.ALGORITHM_DETACHED, self.name)
        # Beating meanwhile: a long catch-up is a live worker (the orchestrator detaches an
        # attached algorithm whose worker shows no heartbeat, orchestrator.attach_timeout_s).
        await self.beating(self.catch_up(), consumer=durable_name("algorithm", self.name))

    def background(self) -> list[Awaitable[Any]]:
        return [self.report_every(self.metrics_interval_s, self.metrics), self._drain_then_stop()]

    async def on_end(self, event: Event, delivery: Delivery) -> None:
        """A worker attached by hand (``exit_when_done``) stops when ``rlbus algorithm
        detach`` names it, or once the run has stopped and every stored trace is scored.
        A worker ``rlbus up`` supervises keeps running when detached (its samples no
        longer train; the supervisor would only restart it)."""
        if isinstance(event, AlgorithmDetached) and delivery.stream_seq > self.detach_floor:
            self.log.info("algorithm.detached")
            self.stop_event.set()
        elif isinstance(event, RunStopped):
            self.run_stopped.set()

    async def _drain_then_stop(self, interval_s: float = 1.0) -> None:
        """Once the run has stopped: stop when no stored trace is left to score."""
        if not self.exit_when_done:
            return
        await self.run_stopped.wait()
        while not await self.sleep(interval_s):
            if all([await c.pending() == 0 for c in self.consumers]):
                self.log.info("algorithm.done", scored=self.scored_total)
                self.stop_event.set()

    async def status(self) -> dict[str, object]:
        out = await super().status()
        out["info"] = {
            "algorithm": type(self.algorithm).__name__,
            "pending_groups": str(len(self.buffer)),
            "scored": str(self.scored_total),
        }
        return out

    # -- the fold -----------------------------------------------------------------------

    async def catch_up(self) -> None:
        """Rebuild the scored set, the algorithm state and the pending groups from the log."""
        folded = 0
        async for scored in read_log(
            self.bus, [(Topic.SAMPLES_SCORED, self.name)], (SamplesScored,)
        ):
            self.core.done(scored)
            folded += 1
        traces = 0
        # Catching up, results are published in pipelined windows: a failed publish
        # fails the start (the restarted worker redoes it; ids make re-publishing safe).
        backlog: list[SamplesScored] = []
        said = time.monotonic()

        def progress(read: int, total: int | None) -> None:
            nonlocal said
            if self.on_catch_up is not None:
                self.on_catch_up(read, total)
            if time.monotonic() - said >= CATCH_UP_LOG_S:
                said = time.monotonic()
                self.log.info(
                    "algorithm.catch_up", traces_read=read, traces_total=total,
                    scored_now=self.scored_total,
                )  # fmt: skip

        async for event in read_log(
            self.bus, [(Topic.TRACE_COMPLETED, None)], (TraceCompleted,), from_seq=self.from_seq,
            on_progress=progress,
        ):  # fmt: skip
            traces += 1
            await self._add(event, backlog)
            if len(backlog) >= CATCH_UP_WINDOW:
                await self.bus.publish_many(backlog)
                backlog.clear()
        await self.bus.publish_many(backlog)
        self.log.info(
            "algorithm.caught_up",
            scored_before=folded,
            traces_read=traces,
            scored_now=self.scored_total,
            pending_groups=len(self.buffer),
        )

    async def on_trace(self, event: TraceCompleted, delivery: Delivery) -> Effects | None:
        """Buffer one trace; a group it completes is returned for the runtime to publish,
        and the scored set and state move only once that publish is acknowledged (if it
        fails, the trace is redelivered and the still-complete group is scored again)."""
        scored = await self._step(event)
        if scored is None:
            return None
        return Effects([scored], after_publish=lambda: self._scored(scored))

    async def _add(self, event: TraceCompleted, backlog: list[SamplesScored]) -> None:
        """Catching up: a group the trace completes joins ``backlog`` (published in windows)."""
        scored = await self._step(event)
        if scored is not None:
            backlog.append(scored)
            self._scored(scored)

    async def _step(self, event: TraceCompleted) -> SamplesScored | None:
        if self.core.routes(event):
            self.last_step = max(self.last_step, event.step)
        return await self.core.step(event, self._refs if self.scorer is not None else None)

    async def _refs(self, group: list[TraceCompleted]) -> Refs:
        assert self.scorer is not None
        ok = [e.trace for e in group if e.trace.ok]
        return await self.scorer.refs(self.algorithm, self.name, ok)

    def _scored(self, scored: SamplesScored) -> None:
        """A scored group is stored (or joins the catch-up backlog): fold it in."""
        self.core.done(scored)
        if scored.failed:
            self.log.warning("group.failed", group_id=scored.group_id, reason=scored.failed)
            return
        self.scored_total += 1
        w = self.window
        w.groups += 1
        w.zero_advantage += scored.zero_advantage
        w.excluded += scored.excluded
        w.rewards.extend(scored.rewards)
        self.log.debug(
            "group.scored", group_id=scored.group_id, samples=len(scored.samples),
            excluded=scored.excluded, zero_advantage=scored.zero_advantage,
        )  # fmt: skip

    # -- metrics ------------------------------------------------------------------------

    def metrics(self, stopping: bool = False) -> MetricsReported | None:
        """The metrics of the last window; starts a new window (as the worker stops, only
        if it scored something since the last report)."""
        if stopping and not self.window.groups:
            return None
        w, self.window = self.window, _Window()
        values = {
            "groups_scored": float(self.scored_total),
            "window_groups": float(w.groups),
            "pending_groups": float(len(self.buffer)),
            "excluded_traces": float(w.excluded),
        }
        if w.groups:
            values["zero_advantage_frac"] = w.zero_advantage / w.groups
        if w.rewards:
            values["mean_reward"] = sum(w.rewards) / len(w.rewards)
        return MetricsReported(
            run=self.run, role=f"algorithm-{self.name}", step=self.last_step, values=values
        )


def max_concurrent(cfg: RunConfig, algorithm_id: str) -> int:
    """``orchestrator.algorithms[].max_concurrent`` of the id (an attached worker that is
    not in the config: the key's default)."""
    return (
        cfg.orchestrator.algorithm(algorithm_id) or AlgorithmConfig(id=algorithm_id)
    ).max_concurrent


def make_scorer(ctx: RoleContext, bus: Bus) -> RefScorer:
    """The inference client, the run's renderer and the run's envs, for distillation."""
    from roles.lib.clients import InferenceClient
    from roles.lib.envs.registry import make_env

    envs: dict[str, Any] = {}

    def env_for(key: str) -> Any:
        if key not in envs:
            spec = ctx.cfg.orchestrator.env(key)
            envs[key] = make_env(spec.id if spec else key, dict(spec.args) if spec else {})
        return envs[key]

    client = InferenceClient.from_config(bus, ctx.cfg.inference)
    return RefScorer(client, ctx.load_renderer(), env_for)


async def serve_worker(
    ctx: RoleContext, core: ScoringCore, exit_when_done: bool = False,
    on_catch_up: Progress | None = None,
) -> None:  # fmt: skip
    """Run one worker until SIGTERM or its detach (``rlbus role algorithm`` and ``attach``,
    which shows the catch-up's progress through ``on_catch_up``)."""
    bus = await ctx.connect()
    scorer = make_scorer(ctx, bus) if core.needs_refs else None
    worker = AlgorithmWorker(
        bus, ctx.instance, core, scorer=scorer, exit_when_done=exit_when_done,
        max_concurrent=max_concurrent(ctx.cfg, core.algorithm_id),
        heartbeat_interval_s=ctx.cfg.bus.heartbeat_interval_s, on_catch_up=on_catch_up,
    )  # fmt: skip
    await serve_role(worker)


async def main(ctx: RoleContext, name: str) -> None:
    """Entry point of ``rlbus role algorithm --name <id>``."""
    check_token(name, "algorithm id")
    core = ScoringCore.for_run(ctx.cfg, name)  # bad name or options: fail before connecting
    await serve_worker(ctx, core)
