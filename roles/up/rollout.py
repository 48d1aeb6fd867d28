"""N rollouts of one environment through the bus: ``rlbus rollout`` without its command line.

    plan = plan_requests(cfg, "reverse-text", "train", n=32, group_size=8, model="policy")
    requests = build_requests(run, cfg.seed, plan, size)        # one TaskRequested per group
    result = await run_rollouts(cfg, plan, size, paths, url, config_path, timeout_s=600)

``run_rollouts`` starts only the role processes that are not running already (one
``rlbus role inference --model <model>`` and one ``rlbus role env --env <env>``; a role
counts as running when its heartbeat in the role registry is fresh), publishes the
requests, follows ``trace.completed.<env>`` (``eval.completed.<env>`` for the eval split)
for their results, and stops what it started (SIGTERM, then waits for the drain). The
command (``roles/cli/rollout.py``) prints; ``benchmarks/rollout_bench.py`` plans.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from configs import RunConfig, dump_toml
from configs.paths import RunPaths
from roles.up.processes import RoleProcess, role_process

Note = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


# -- what to ask for (pure) ---------------------------------------------------------------


@dataclass
class Plan:
    env: str
    key: str
    split: str
    groups: int
    group_size: int
    model: str
    env_args: dict[str, Any]
    sampling: Any  # SamplingParams
    max_turns: int | None

    @property
    def total(self) -> int:
        """Rollouts in all."""
        return self.groups * self.group_size


def plan_requests(
    cfg: RunConfig, env: str, split: str, n: int, group_size: int, model: str
) -> Plan:
    """Sampling, args and max_turns for ``env`` from the config (its train entry, if any)."""
    from roles.lib.envs.registry import env_key
    from schemas import SamplingParams

    entry = cfg.orchestrator.env(env)
    if split == "eval":
        s: Any = cfg.orchestrator.eval.sampling
    else:
        s = (
            entry.sampling
            if entry is not None and entry.sampling is not None
            else cfg.orchestrator.train.sampling
        )
    sampling = SamplingParams(
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        max_completion_tokens=s.max_completion_tokens,
        stop=list(s.stop),
    )
    return Plan(
        env=env,
        key=env_key(env),
        split=split,
        groups=math.ceil(n / group_size),
        group_size=group_size,
        model=model,
        env_args=dict(entry.args) if entry else {},
        sampling=sampling,
        max_turns=entry.max_turns if entry else None,
    )


def build_requests(run: str, seed: int, plan: Plan, size: int) -> list[Any]:
    """One TaskRequested per group: tasks 0, 1, ... of the split, seeds from the run seed."""
    from schemas import TaskRef, TaskRequested, derive_id, new_id, stable_seed

    out = []
    for g in range(plan.groups):
        event_id = new_id()  # a fresh request each time: a rerun must not be deduplicated away
        out.append(
            TaskRequested(
                run=run,
                event_id=event_id,
                env=plan.key,
                task=TaskRef(index=g % size, split=plan.split),
                group_id=derive_id(event_id, "group"),
                group_size=plan.group_size,
                sampling=plan.sampling,
                model=plan.model,
                seed=stable_seed(seed, "rollout", plan.split, g),
                max_turns=plan.max_turns,
                args=plan.env_args,
            )
        )
    return out


def summarize(traces: list[Any]) -> dict[str, Any]:
    """Mean reward, mean completion tokens, errors by kind (pure: easy to test)."""
    from roles.lib.envs.harness import completion_tokens

    errors = Counter(e.kind for t in traces for e in t.errors)
    n = max(len(traces), 1)
    return {
        "rollouts": len(traces),
        "reward_mean": sum(t.reward for t in traces) / n,
        "completion_tokens_mean": sum(completion_tokens(t) for t in traces) / n,
        "errors": dict(sorted(errors.items())),
        "truncated": sum(1 for t in traces if t.truncated),
    }


def write_config(cfg: RunConfig, paths: RunPaths) -> Path:
    """The resolved config the started roles read: the run's ``config.toml``, or
    ``rollout.config.toml`` when the run already has a different one (never rewritten)."""
    paths.dir.mkdir(parents=True, exist_ok=True)
    path = paths.config
    text = dump_toml(cfg)
    if path.exists() and path.read_text() != text:
        path = paths.rollout_config
    path.write_text(text)
    return path


# -- the role processes -------------------------------------------------------------------


async def missing_roles(bus: Any, cfg: RunConfig, plan: Plan) -> list[tuple[str, list[str]]]:
    """The role processes to start: those without a fresh heartbeat in the registry."""
    from bus.registry import is_alive, list_roles
    from bus.subjects import durable_name

    beats = [
        hb for hb in await list_roles(bus.js, bus.run) if is_alive(hb, cfg.bus.heartbeat_interval_s)
    ]
    model_cfg = cfg.orchestrator.models.get(plan.model)
    actor = "teacher" if model_cfg is not None and model_cfg.kind == "teacher" else "inference"
    out = []
    if not any(
        hb.role == actor and hb.instance.startswith(f"{actor}-{plan.model}-") for hb in beats
    ):
        out.append((f"{actor}-{plan.model}", [actor, "--model", plan.model]))
    durable = durable_name("env", plan.key)
    if not any(hb.role == "env" and hb.consumer == durable for hb in beats):
        out.append((f"env-{plan.key}", ["env", "--env", plan.env]))
    return out


async def start_missing_roles(
    bus: Any,
    cfg: RunConfig,
    plan: Plan,
    paths: RunPaths,
    url: str,
    config_path: Path,
    note: Note = _quiet,
) -> list[RoleProcess]:
    """Start the role processes ``plan`` needs that are not running (``missing_roles``)."""
    from roles.runtime.context import policy_model_dir

    todo = await missing_roles(bus, cfg, plan)
    if todo and cfg.model.path == "tiny":
        # Build the tiny model once, before the roles race to it.
        await asyncio.to_thread(policy_model_dir, cfg, paths.run)
    started: list[RoleProcess] = []
    try:
        for name, args in todo:
            role = role_process(name, args, paths, url, config_path)
            role.start()
            started.append(role)
            note(f"started {name} (pid {role.proc.pid if role.proc else '?'}, log {role.log_path})")
    except BaseException:
        await stop_roles(started, note)
        raise
    return started


async def stop_roles(started: list[RoleProcess], note: Note = _quiet) -> None:
    """SIGTERM each role (last started first) and wait for it to drain."""
    for s in reversed(started):
        s.terminate()
        await asyncio.to_thread(s.wait, 30.0)
        note(f"stopped {s.name} (exit {s.proc.returncode if s.proc else '?'})")


# -- the rollouts ---------------------------------------------------------------------------


@dataclass
class RolloutResult:
    traces: list[Any] = field(default_factory=list)
    wall_s: float = 0.0
    code: int = 0  # 0: every trace came back; 1: a started role died, or the wait timed out
    role_died: bool = False  # a role this started exited: no summary to show


async def run_rollouts(
    cfg: RunConfig,
    plan: Plan,
    size: int,
    paths: RunPaths,
    url: str,
    config_path: Path,
    timeout_s: float,
    note: Note = _quiet,
    progress: Callable[[int], None] | None = None,
) -> RolloutResult:
    """Start the missing roles, publish ``plan``'s requests (tasks of a split of ``size``),
    collect their traces (``progress(n)`` as they come), stop what was started."""
    from bus.reader import LogReader
    from bus.runtime import Bus
    from bus.subjects import Topic
    from roles.runtime.context import bus_settings
    from schemas import EvalCompleted, TraceCompleted

    run = paths.run
    bus = await Bus.connect(url, run=run, producer="cli-rollout", settings=bus_settings(cfg))
    await bus.ensure_stream()
    started: list[RoleProcess] = []
    t0 = time.monotonic()
    result = RolloutResult()
    try:
        started = await start_missing_roles(bus, cfg, plan, paths, url, config_path, note)
        eval_split = plan.split == "eval"
        topic = Topic.EVAL_COMPLETED if eval_split else Topic.TRACE_COMPLETED
        schema = EvalCompleted if eval_split else TraceCompleted
        requests = build_requests(run, cfg.seed, plan, size)
        wanted = {r.event_id for r in requests}
        traces: dict[str, Any] = {}
        done = asyncio.Event()
        # Follow the results from just after the log's end before asking: none is missed.
        after = (await bus.js.stream_info(bus.stream)).state.last_seq
        reader = LogReader(
            bus, from_seq=after + 1, topics=[(topic, plan.key)], follow=True,
            idle_timeout_s=0.5, stop=done,
        )  # fmt: skip

        async def collect() -> None:
            async for event in reader.events((schema,)):
                if event.request_id not in wanted:
                    continue  # someone else's rollouts on the same env
                for t in event.traces if eval_split else [event.trace]:
                    traces[t.rollout_id] = t
                if len(traces) >= plan.total:
                    done.set()

        collector = asyncio.create_task(collect())
        try:
            await bus.publish_many(requests)
            while not done.is_set():
                if died := next((s for s in started if not s.alive and s.proc is not None), None):
                    code = died.proc.returncode if died.proc else None
                    note(f"{died.name} exited with {code}; log tail:\n{died.tail()}")
                    result.code, result.role_died = 1, True
                    break
                if time.monotonic() - t0 > timeout_s:
                    note(f"timed out after {timeout_s:.0f}s with {len(traces)}/{plan.total} traces")
                    result.code = 1
                    break
                if collector.done():
                    collector.result()  # a reader error surfaces here
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.5)
                if progress is not None:
                    progress(len(traces))
        finally:
            done.set()
            await asyncio.gather(collector, return_exceptions=True)
        result.traces = list(traces.values())
        result.wall_s = time.monotonic() - t0
        return result
    finally:
        await stop_roles(started, note)
        await bus.close()


__all__ = [
    "Plan",
    "RolloutResult",
    "build_requests",
    "missing_roles",
    "plan_requests",
    "run_rollouts",
    "start_missing_roles",
    "stop_roles",
    "summarize",
    "write_config",
]
