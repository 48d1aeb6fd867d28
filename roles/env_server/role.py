"""The env server role: runs rollout groups of one environment against inference.

    rlbus role env --run R --env reverse-text [--nats-url U] [--config C]

Every replica of an env binds one shared durable consumer, ``env-<env key>``, on
``task.requested.<env key>`` (a work queue: each request goes to one replica, and a
request whose replica dies is redelivered to another after ``ack_wait``). Up to
``concurrency`` groups (the env's ``max_concurrent``, else ``env_server.groups_in_flight``)
are in flight per replica; the rollouts of a group run concurrently. For a ``TaskRequested`` the server builds ``make_env(env, request.args)`` (plus its config entry's ``state_columns``, ``schedule`` and ``min_turns``),
takes ``task(split, index)`` and runs ``group_size`` rollouts (rollout ``i`` samples with
seed ``stable_seed(request.seed, i)``), then returns:

- split ``train``: one ``TraceCompleted`` per rollout, ``event_id = derive_id(request,
  "trace", i)`` and ``rollout_id = derive_id(request, "rollout", i)``;
- split ``eval``: one ``EvalCompleted`` (``derive_id(request, "eval")``) with all traces;
  its policy turns are pinned to ``request.policy_version`` (inference holds that version
  while they run), so an eval at vN is answered by vN.

An env with a group rubric has the group's finished rollouts scored together once all of
them are done, before anything is published (``roles.lib.envs.group``). Train traces
then pass the env's rollout filters (``roles.lib.envs.filters``): each
verdict is recorded on the trace (``filters``, ``is_filtered``), so the log, the lake and
algorithm replay see the same verdict.

The runtime publishes them and only then acks the request; a redelivered request
republishes the same ids, which the stream dedups. A retryable failure (inference
timeout, a failed or malformed reply) is an errored trace, so a group completes; an
exception from env code (a bug: ``EnvCodeError``) dead-letters the task at once with the
traceback (``bus.errors.Rejected``), and the orchestrator releases its group and stops
the run after ``orchestrator.max_env_errors`` of them. ``MetricsReported(role="env-<key>")``
goes out every ``metrics_interval_s``: rollouts/s, mean reward, errors and turn errors by
kind, the share of rollouts each filter flagged (``filter_<name>``) and the share kept
out of training (``filtered``).

Only the tokenizer is loaded (from ``model.path``; "tiny" = the run's tiny model, built
with ``model.tiny`` sizes and ``model.tiny.init_seed`` if absent): no torch model.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from bus.consumer import Delivery, Subscription
from bus.errors import Rejected
from bus.runtime import Bus
from bus.subjects import Topic, durable_name
from configs import EnvServerConfig
from configs.orchestrator import POLICY
from roles.lib.envs.base import EnvCodeError, Environment, Messages, State, check_split
from roles.lib.envs.filters import Filter, apply_filters, build_filters
from roles.lib.envs.group import score_group
from roles.lib.envs.harness import Generate, completion_tokens, run_rollout
from roles.lib.envs.registry import env_key, make_env, turn_options
from roles.lib.envs.stop import HAS_ERROR
from roles.lib.tasks import undispatched
from roles.runtime.context import RoleContext
from roles.runtime.role import Role, serve_role
from schemas import (
    Branch,
    EvalCompleted,
    Event,
    MetricsReported,
    SamplingParams,
    TaskRef,
    TaskRequested,
    Trace,
    TraceCompleted,
    TraceError,
    derive_id,
    stable_seed,
)

METRICS_INTERVAL_S = 10.0


# -- pure parts -------------------------------------------------------------------------


def rollout_id(request: TaskRequested, i: int) -> str:
    return derive_id(request.event_id, "rollout", i)


def failed_group(request: TaskRequested, env_name: str, kind: str, message: str) -> list[Trace]:
    """Errored traces for a whole group (the task itself could not be built)."""
    return [
        Trace(
            rollout_id=rollout_id(request, i),
            env=env_name,
            task=request.task,
            group_id=request.group_id,
            sample_index=i,
            messages=[],
            branches=[Branch(messages=[])],
            errors=[TraceError(kind=kind, message=message[:2000])],
            stop_condition=HAS_ERROR,
        )
        for i in range(request.group_size)
    ]


def outputs_for(request: TaskRequested, traces: Sequence[Trace]) -> list[Event]:
    """The events a finished group publishes; ids derive from the request (redelivery-safe)."""
    env = request.env
    if request.task.split == "eval":
        return [
            EvalCompleted(
                run=request.run,
                event_id=derive_id(request.event_id, "eval"),
                causation_id=request.event_id,
                request_id=request.event_id,
                env=env,
                step=request.step,
                task_index=request.task.index,
                rewards=[t.reward for t in traces],
                traces=list(traces),
                errors=sum(1 for t in traces if t.errors),
            )
        ]
    return [
        TraceCompleted(
            run=request.run,
            event_id=derive_id(request.event_id, "trace", i),
            causation_id=request.event_id,
            env=env,
            request_id=request.event_id,
            group_size=request.group_size,
            step=request.step,
            trace=trace,
        )
        for i, trace in enumerate(traces)
    ]


async def rollout_group(
    env: Environment,
    request: TaskRequested,
    generate: Generate,
    renderer: Any,
    env_id: str | None = None,
    filters: Sequence[Filter] = (),
    models: Sequence[str] = (POLICY,),
) -> list[Trace]:
    """The ``group_size`` rollouts of one request, run concurrently; an env with a group
    rubric then scores the finished ones together (``roles.lib.envs.group``), and train
    traces pass ``filters``. An ``EnvCodeError`` (a bug in env code) propagates.
    ``models``: the run's model keys, which an agent env's code may call
    (``roles.lib.envs.agent``).

    The orchestrator draws task indices from a large space without knowing the taskset;
    the index is reduced modulo the split's size here, and the trace records the task's
    real index and data.
    """
    try:
        check_split(request.task.split)
    except ValueError as e:  # the request's fault, not the env's: errored traces
        return failed_group(request, request.env, "task_error", str(e))
    try:
        index = request.task.index % env.size(request.task.split)
        data = env.task(request.task.split, index)
    except Exception as e:  # noqa: BLE001 - the taskset is env code: its bug
        raise EnvCodeError.from_exception(request.env, e) from e
    task = TaskRef(index=index, split=request.task.split, data=data)
    if task.split == "eval":
        generate = pinned(generate, request.policy_version)
    seen: dict[int, tuple[Messages, State]] = {}  # what each rollout's rubric scored

    def keep(i: int) -> Callable[[Messages, State], None]:
        return lambda messages, state: seen.__setitem__(i, (messages, state))

    # A TaskGroup: an EnvCodeError in one rollout cancels its siblings and propagates
    # (bare, not in an ExceptionGroup, so the env server can dead-letter the task).
    try:
        async with asyncio.TaskGroup() as rollouts:
            tasks = [
                rollouts.create_task(
                    run_rollout(
                        env,
                        task,
                        generate,
                        renderer,
                        request.sampling,
                        rollout_id=rollout_id(request, i),
                        model=request.model,
                        env_name=request.env,
                        env_id=env_id,
                        group_id=request.group_id,
                        sample_index=i,
                        seed=stable_seed(request.seed, i),
                        max_turns=request.max_turns,
                        seating=request.seating,
                        group_seed=request.seed,
                        agent_models=models,
                        on_scored=keep(i) if env.group_scored else None,
                    )
                )
                for i in range(request.group_size)
            ]
    except BaseExceptionGroup as group:  # a rollout never raises anything else
        bugs = [e for e in group.exceptions if isinstance(e, EnvCodeError)]
        raise (bugs[0] if bugs else group.exceptions[0]) from None
    traces = await score_group(env, data, [t.result() for t in tasks], seen, request.env)
    if task.split == "train" and filters:
        traces = [apply_filters(t, filters) for t in traces]
    return traces


def pinned(generate: Generate, version: int) -> Generate:
    """``generate`` with the policy's turns pinned to weights ``version`` (an eval)."""

    async def pinned_generate(model: str, *args: Any, **kwargs: Any) -> Any:
        if model == POLICY:
            kwargs["pin_version"] = version
        return await generate(model, *args, **kwargs)

    return pinned_generate  # type: ignore[return-value]


@dataclass
class RolloutStats:
    """Counters since the last metrics report."""

    since: float = field(default_factory=time.monotonic)
    rollouts: int = 0
    groups: int = 0
    reward_sum: float = 0.0
    tokens: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    turn_errors: Counter[str] = field(default_factory=Counter)
    judged: int = 0  # rollouts the filters judged (train rollouts without an error)
    # by filter name: every filter that judged a rollout (0 when it flagged none)
    flagged: Counter[str] = field(default_factory=Counter)
    filtered: int = 0  # kept out of training by an enforcing filter
    step: int = 0

    def add(self, request: TaskRequested, traces: Sequence[Trace]) -> None:
        self.groups += 1
        self.step = max(self.step, request.step)
        for t in traces:
            self.rollouts += 1
            self.reward_sum += t.reward
            self.tokens += completion_tokens(t)
            self.errors.update(e.kind for e in t.errors)
            self.turn_errors.update(e.kind for e in t.turn_errors)
            if t.filters:
                self.judged += 1
                self.flagged.update({v.name: int(v.flagged) for v in t.filters})
                self.filtered += t.is_filtered

    def values(self, now: float) -> dict[str, float]:
        n = max(self.rollouts, 1)
        out = {
            "rollouts": float(self.rollouts),
            "groups": float(self.groups),
            "rollouts_per_s": self.rollouts / max(now - self.since, 1e-9),
            "reward_mean": self.reward_sum / n,
            "completion_tokens_mean": self.tokens / n,
            "errors": float(sum(self.errors.values())),
        }
        out.update({f"errors_{kind}": float(c) for kind, c in self.errors.items()})
        out.update({f"turn_errors_{kind}": float(c) for kind, c in self.turn_errors.items()})
        if self.judged:
            out["filtered"] = self.filtered / self.judged
            out.update({f"filter_{name}": c / self.judged for name, c in self.flagged.items()})
        return out


# -- the inference client, adapted ------------------------------------------------------


def client_generate(client: Any) -> Generate:
    """``client.generate`` as a harness ``Generate``. Its one retry policy is the
    client's (``InferenceClient._request``): no replica subscribed yet (a role starting
    up), a replica lost, each retried until ``inference.request_timeout_s`` is spent."""

    async def generate(
        model: str,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        stop_token_ids: Sequence[int],
        seed: int,
        *,
        env: str | None = None,
        pin_version: int | None = None,
    ) -> Any:
        pin = {} if pin_version is None else {"pin_version": pin_version}
        return await client.generate(
            model, request_id, prompt_ids, sampling, stop_token_ids, seed, env=env, **pin
        )

    return generate


# -- the role ---------------------------------------------------------------------------


class EnvServer(Role):
    role = "env"

    def __init__(
        self,
        bus: Bus,
        instance: str,
        env_id: str,
        renderer: Any,
        generate: Generate,
        *,
        default_args: dict[str, Any] | None = None,
        filters: Sequence[Filter] = (),
        state_columns: Sequence[str] = (),
        turns: dict[str, Any] | None = None,
        models: Sequence[str] = (POLICY,),
        concurrency: int = EnvServerConfig().groups_in_flight,
        metrics_interval_s: float = METRICS_INTERVAL_S,
        heartbeat_interval_s: float = 2.0,
        undispatched: Callable[[TaskRequested], str | None] | None = None,
    ) -> None:
        super().__init__(bus, instance, heartbeat_interval_s)
        self.env_id = env_id
        self.key = env_key(env_id)
        self.renderer = renderer
        self.generate = generate
        self.default_args = dict(default_args or {})
        self.filters = list(filters)
        self.state_columns = tuple(state_columns)
        self.turns = dict(turns or {})  # make_env's schedule, min_turns, max_turns
        self.models = tuple(models)
        self.concurrency = concurrency
        self.metrics_interval_s = metrics_interval_s
        # Why a request is not one the run's orchestrator dispatched (None: it is, or it is
        # adhoc): such a request is dead-lettered, never run (``roles.lib.tasks``).
        self.undispatched = undispatched
        self.stats = RolloutStats()
        self.total_rollouts = 0
        self._envs: dict[str, Environment] = {}
        self._inflight = 0

    def subscriptions(self) -> list[Subscription]:
        return [
            Subscription(
                durable_name("env", self.key),
                [(Topic.TASK_REQUESTED, self.key)],
                self.on_task,
                concurrency=self.concurrency,
                batch=self.concurrency,
            )
        ]

    async def setup(self) -> None:
        self.env_for(self.default_args)  # an unknown env or bad args fail at start, not per message
        self.log.info("env.ready", env=self.env_id, key=self.key)

    def background(self) -> list[Any]:
        return [self.report_every(self.metrics_interval_s, self.metrics)]

    async def teardown(self) -> None:
        # The last window, once in-flight groups have drained (best effort, like the rest).
        if (last := self.metrics(stopping=False)) is not None:
            try:
                await self.bus.publish(last)
            except Exception as e:  # noqa: BLE001 - the last report is best effort too
                self.log.warning("metrics.failed", error=repr(e))

    async def status(self) -> dict[str, object]:
        out = await super().status()
        out["info"] = {"env": self.env_id, "groups_in_flight": str(self._inflight)}
        return out

    def env_for(self, args: dict[str, Any]) -> Environment:
        """The env built with ``args``, recording the config's ``state_columns`` beside its
        own, its turns as the config says (``turns``; cached: one instance per distinct
        args)."""
        cache_key = json.dumps(args, sort_keys=True, default=str)
        if cache_key not in self._envs:
            self._envs[cache_key] = make_env(self.env_id, args, self.state_columns, **self.turns)
        return self._envs[cache_key]

    async def on_task(self, request: TaskRequested, delivery: Delivery) -> list[Event]:
        if self.undispatched is not None and (why := self.undispatched(request)) is not None:
            raise Rejected(f"not the orchestrator's: {why}")
        self._inflight += 1
        t0 = time.monotonic()
        try:
            try:
                env = self.env_for(request.args or self.default_args)
            except Exception as e:  # noqa: BLE001 - bad args in one request: errored traces
                traces = failed_group(
                    request, request.env, "env_exception", f"{type(e).__name__}: {e}"
                )
            else:
                traces = await rollout_group(
                    env, request, self.generate, self.renderer, self.env_id, self.filters,
                    self.models,
                )  # fmt: skip
        except EnvCodeError as bug:  # a bug in env code: dead-letter the task at once
            self.log.error("env.bug", request=request.event_id, error=str(bug))
            raise Rejected(bug_report(bug), error_type="EnvCodeError") from bug
        finally:
            self._inflight -= 1
        self.stats.add(request, traces)
        self.total_rollouts += len(traces)
        self.log.info(
            "group.done",
            request=request.event_id,
            task=request.task.index,
            split=request.task.split,
            rewards=[round(t.reward, 3) for t in traces],
            errors=sum(1 for t in traces if t.errors),
            s=round(time.monotonic() - t0, 3),
            deliveries=delivery.deliveries,
        )
        return outputs_for(request, traces)

    def metrics(self, stopping: bool) -> MetricsReported | None:
        """The window since the last report (None while stopping: teardown reports the
        last window once in-flight groups are done; None without rollouts)."""
        if stopping or not self.stats.rollouts:
            return None
        stats, self.stats = self.stats, RolloutStats(step=self.stats.step)
        return MetricsReported(
            run=self.run, role=f"env-{self.key}", step=stats.step,
            values=stats.values(time.monotonic()),
        )  # fmt: skip


# -- the process entry point (``rlbus role env``) ---------------------------------------


def bug_report(bug: EnvCodeError, limit: int = 3800) -> str:
    """The dead letter's text: the one-line error, then where env code raised (the
    traceback it carries, else its own), cut in the middle if long: the innermost frames
    and the exception line are at the end, and they matter most."""
    trace = bug.traceback or "".join(traceback.format_exception(bug))
    if len(trace) > limit:
        trace = trace[: limit // 4] + "\n...\n" + trace[-(limit * 3 // 4) :]
    return f"{bug}\n{trace}"


def config_args(ctx: RoleContext, env_id: str) -> dict[str, Any]:
    """The env's args from ``orchestrator.train.env``, else from its eval-only entry in
    ``orchestrator.eval.env`` (empty if the env is not listed)."""
    entry = ctx.cfg.orchestrator.served_env(env_id)
    return dict(entry.args or {}) if entry is not None else {}


def server_options(ctx: RoleContext, env_id: str) -> dict[str, Any]:
    """``EnvServer``'s keyword arguments from the run's config: the env's args and
    filters (a train env's; an eval-only env has none: eval traces are never filtered),
    the state columns its entry adds, its turn settings (``turn_options``), the groups in
    flight (the env's
    ``max_concurrent``, else ``env_server.groups_in_flight``), the heartbeat interval."""
    entry = ctx.cfg.orchestrator.served_env(env_id)
    concurrency = entry.max_concurrent if entry is not None else None
    train = ctx.cfg.orchestrator.env(env_id)
    return {
        "default_args": config_args(ctx, env_id),
        "filters": build_filters(train.filters) if train is not None else [],
        "state_columns": list(entry.state_columns) if entry is not None else [],
        "turns": turn_options(entry),
        "models": ctx.cfg.orchestrator.model_keys(),
        "concurrency": concurrency or ctx.cfg.env_server.groups_in_flight,
        "heartbeat_interval_s": ctx.cfg.bus.heartbeat_interval_s,
        # (not under ``rlbus rollout``'s config: another's, with the run's queue shared)
        "undispatched": functools.partial(undispatched, ctx.cfg, ctx.run)
        if ctx.runs_config
        else None,
    }


async def main(ctx: RoleContext, env: str) -> None:
    renderer = await asyncio.to_thread(ctx.load_renderer)
    from roles.lib.clients import InferenceClient

    bus = await ctx.connect()
    client = InferenceClient.from_config(bus, ctx.cfg.inference)
    server = EnvServer(
        bus,
        ctx.instance,
        env,
        renderer,
        client_generate(client),
        **server_options(ctx, env),
    )
    await serve_role(server)


__all__ = [
    "EnvServer",
    "client_generate",
    "config_args",
    "failed_group",
    "main",
    "outputs_for",
    "rollout_group",
    "rollout_id",
    "server_options",
]
