"""The algorithm worker role: complete groups of traces in, ``samples.scored.<id>`` out.

    rlbus role algorithm --run demo --name grpo

One worker per algorithm id (``orchestrator.algorithms[].id``; an id absent from the
config is taken as a registered algorithm name with no options). It reads
``trace.completed.*`` with its own durable consumer ``algorithm-<id>`` (a worker
attached mid-run starts from the beginning of the log), buffers traces per group until
``group_size`` distinct rollouts arrived, and publishes one ``SamplesScored`` per group
with the id ``derive_id("scored", id, group_id)``: a re-publish is deduplicated.

A worker attached to a live run (``rlbus algorithm attach``) may start at a later
sequence (``from_seq``: the attach event, unless ``--from-start``), and stops by itself
when an ``algorithm.detached`` event for its id appears. Distillation algorithms get
their reference logprobs from the inference role first (``roles/algorithm/scoring.py``);
every worker adds the env's tool-output cross-entropy when the env's config asks for it
(``[orchestrator.train.env.sft]``).

The worker keeps no state the log cannot rebuild. At start it folds over the log with
ordered consumers (NATS_NOTES #11): first its own ``samples.scored.<id>`` (which groups
are done, and the state of a stateful algorithm), then ``trace.completed.*`` (the traces
of groups not scored yet, scoring any group the log already completes). Only then does
the durable consumer start; a trace is acked as soon as it is buffered, because a
restarted worker gets it back from the log, not from the consumer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from bus.consumer import Delivery, Subscription
from bus.errors import PublishError
from bus.reader import last_seq, read_log
from bus.runtime import Bus
from bus.subjects import Topic, check_token, durable_name, token_for
from configs import RunConfig
from roles.algorithm.base import Algorithm
from roles.algorithm.registry import create
from roles.algorithm.samples import GroupBuffer, ToolSft, score_group
from roles.algorithm.scoring import RefScorer
from roles.runtime.context import RoleContext
from roles.runtime.role import Role, serve_role
from schemas import AlgorithmAttached, Event, MetricsReported, SamplesScored, TraceCompleted

# Scored groups published per pipelined window while catching up on the log.
CATCH_UP_WINDOW = 64


def algorithm_spec(cfg: RunConfig, algorithm_id: str) -> tuple[str, dict[str, Any]]:
    """(registered name, options) of ``algorithm_id`` in ``orchestrator.algorithms``."""
    for spec in cfg.orchestrator.algorithms:
        if spec.id == algorithm_id:
            return spec.name or spec.id, dict(spec.options)
    return algorithm_id, {}


def routed_envs(cfg: RunConfig, algorithm_id: str) -> set[str] | None:
    """Env keys a config algorithm trains on (None: every env, e.g. a shadow or warm start)."""
    spec = next((a for a in cfg.orchestrator.algorithms if a.id == algorithm_id), None)
    if spec is None or spec.shadow:
        return None
    envs = cfg.orchestrator.train.env
    return {token_for(e.id) for e in envs if not e.algorithms or algorithm_id in e.algorithms}


def attached_envs(event: AlgorithmAttached) -> set[str] | None:
    """Env keys a worker attached at runtime scores (None: every env; always for a shadow)."""
    return set(event.envs) if event.envs and not event.shadow else None


def tool_sft_rules(cfg: RunConfig) -> dict[str, ToolSft]:
    """Env key -> its tool-output SFT rule, for envs with ``sft.on_tool_outputs``."""
    return {
        token_for(e.id): ToolSft(
            e.sft.alpha, None if e.sft.tool_names is None else tuple(e.sft.tool_names)
        )
        for e in cfg.orchestrator.train.env
        if e.sft.on_tool_outputs
    }


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
        name: str,
        algorithm: Algorithm,
        metrics_interval_s: float = 10.0,
        heartbeat_interval_s: float = 2.0,
        *,
        scorer: RefScorer | None = None,
        tool_sft: dict[str, ToolSft] | None = None,
        from_seq: int = 1,
        exit_when_done: bool = False,
        envs: set[str] | None = None,
    ):
        super().__init__(bus, instance, heartbeat_interval_s)
        self.name = check_token(name, "algorithm id")
        self.algorithm = algorithm
        self.scorer = scorer
        self.tool_sft = dict(tool_sft or {})
        self.from_seq = max(1, from_seq)
        self.detach_floor = 0  # newest algorithm.detached seq for our id when we started
        self.exit_when_done = exit_when_done  # attached by hand: exit once the run stopped
        self.envs = envs  # env keys whose groups it scores (None: every env)
        self.metrics_interval_s = metrics_interval_s
        self.buffer = GroupBuffer()
        self.state: Any = algorithm.initial_state()
        self.scored_total = 0  # groups this instance published (catch-up included)
        self.last_step = 0
        self.window = _Window()
        self.log = self.log.bind(algorithm=name)

    def subscriptions(self) -> list[Subscription]:
        # batch 32: traces are up to the offload threshold (512 KiB) each, and a fetch of
        # batch x size above 64 MiB gets the consumer cut off (NATS_NOTES #5).
        return [
            Subscription(
                durable_name("algorithm", self.name),
                [(Topic.TRACE_COMPLETED, None)],
                self.on_trace,
                batch=32,
                start_seq=self.from_seq,
            )
        ]

    async def setup(self) -> None:
        self.detach_floor = await last_seq(self.bus, Topic.ALGORITHM_DETACHED, self.name)
        await self.catch_up()

    def background(self) -> list[Awaitable[Any]]:
        return [self._report_metrics(), self._watch_end()]

    async def _watch_end(self, interval_s: float = 1.0) -> None:
        """For a worker attached by hand (``exit_when_done``): stop when ``rlbus algorithm
        detach`` names it, or once the run has stopped and every stored trace is scored.
        A worker ``rlbus up`` supervises keeps running when detached (its samples no
        longer train; the supervisor would only restart it)."""
        if not self.exit_when_done:
            return
        while not self.stop_event.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), interval_s)
            if await last_seq(self.bus, Topic.ALGORITHM_DETACHED, self.name) > self.detach_floor:
                self.log.info("algorithm.detached")
                self.stop_event.set()
            elif await last_seq(self.bus, Topic.RUN_STOPPED) > 0:
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
            self._fold(scored)
            folded += 1
        traces = 0
        # Catching up, results are published in pipelined windows: a failed publish
        # fails the start (the restarted worker redoes it; ids make re-publishing safe).
        backlog: list[SamplesScored] = []
        async for event in read_log(
            self.bus, [(Topic.TRACE_COMPLETED, None)], (TraceCompleted,), from_seq=self.from_seq
        ):
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

    async def on_trace(self, event: TraceCompleted, delivery: Delivery) -> list[Event]:
        # We publish ourselves (not by returning the event) so the scored set and the
        # state only move once the publish is acknowledged; if it fails, the handler
        # raises, the trace is redelivered, and the still-complete group is retried.
        await self._add(event)
        return []

    async def _add(self, event: TraceCompleted, backlog: list[SamplesScored] | None = None) -> None:
        """Buffer one trace; score its group once complete. Live (``backlog`` None), the
        result is published before the state moves; catching up, it joins ``backlog``."""
        if self.envs is not None and event.env not in self.envs:
            return  # not routed here: scoring it would only cost (distillation: a model call)
        self.last_step = max(self.last_step, event.step)
        group = self.buffer.add(event)
        if group is None:
            return
        refs = None
        if self.scorer is not None:
            ok = [e.trace for e in group if e.trace.ok]
            refs = await self.scorer.refs(self.algorithm, self.name, ok)
        scored = score_group(
            self.name, self.algorithm, group, self.state, refs, self.tool_sft.get(event.env)
        )
        if backlog is None:
            await self.bus.publish(scored)
        else:
            backlog.append(scored)
        self._fold(scored)
        self.scored_total += 1
        w = self.window
        w.groups += 1
        w.zero_advantage += scored.zero_advantage
        w.excluded += scored.excluded
        w.rewards.extend(scored.rewards)
        self.log.debug(
            "group.scored",
            group_id=scored.group_id,
            samples=len(scored.samples),
            excluded=scored.excluded,
            zero_advantage=scored.zero_advantage,
        )

    def _fold(self, scored: SamplesScored) -> None:
        self.buffer.mark_scored(scored.group_id)
        if self.algorithm.stateful:
            self.state = self.algorithm.fold(self.state, scored)

    # -- metrics ------------------------------------------------------------------------

    def metrics(self) -> MetricsReported:
        """The metrics of the last window; starts a new window."""
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

    async def _report_metrics(self) -> None:
        while not self.stop_event.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop_event.wait(), self.metrics_interval_s)
            if self.stop_event.is_set() and not self.window.groups:
                return
            try:
                await self.bus.publish(self.metrics())
            except PublishError as e:  # metrics are best effort; scoring goes on
                self.log.warning("metrics.publish_failed", error=str(e))


def needs_scorer(algorithm: Algorithm) -> bool:
    return type(algorithm).score_spec is not Algorithm.score_spec


def make_scorer(ctx: RoleContext, bus: Bus) -> RefScorer:
    """The inference client, the run's renderer and the run's envs, for distillation."""
    from roles.lib.clients import InferenceClient
    from roles.lib.envs.registry import make_env

    specs = {token_for(e.id): e for e in ctx.cfg.orchestrator.train.env}
    envs: dict[str, Any] = {}

    def env_for(key: str) -> Any:
        if key not in envs:
            spec = specs.get(key)
            envs[key] = make_env(spec.id if spec else key, dict(spec.args) if spec else {})
        return envs[key]

    timeout = ctx.cfg.inference.request_timeout_s
    return RefScorer(InferenceClient(bus, timeout_s=timeout), ctx.load_renderer(), env_for)


async def serve_worker(
    ctx: RoleContext,
    name: str,
    registered: str,
    options: dict[str, Any],
    from_seq: int = 1,
    exit_when_done: bool = False,
    envs: set[str] | None = None,
) -> None:
    """Run one worker until SIGTERM or its detach (``rlbus role algorithm`` and ``attach``)."""
    check_token(name, "algorithm id")
    algorithm = create(registered, options)  # bad name or options: fail before connecting
    bus = await ctx.connect()
    scorer = make_scorer(ctx, bus) if needs_scorer(algorithm) else None
    worker = AlgorithmWorker(
        bus, ctx.instance, name, algorithm,
        scorer=scorer, tool_sft=tool_sft_rules(ctx.cfg), from_seq=from_seq,
        exit_when_done=exit_when_done, envs=envs,
    )  # fmt: skip
    await serve_role(worker)


async def main(ctx: RoleContext, name: str) -> None:
    """Entry point of ``rlbus role algorithm --name <id>``."""
    registered, options = algorithm_spec(ctx.cfg, name)
    await serve_worker(ctx, name, registered, options, envs=routed_envs(ctx.cfg, name))
