"""Rollouts and evals through the bus: ``rlbus rollout`` and ``rlbus eval`` without their
command lines.

    plan = plan_requests(cfg, "reverse-text", "train", n=32, group_size=8, model="policy")
    requests = build_requests(run, cfg.seed, plan, split_size(plan))  # one TaskRequested per group
    result = await run_rollouts(cfg, [plan], requests, paths, url, config_path, timeout_s=600)

    plans = [plan_requests(cfg, env, "eval", tasks * k, k, "policy") for env in eval_envs(cfg)]
    result = await run_rollouts(cfg, plans, requests, ...)     # requests of every plan
    scores = eval_scores(plans, result, k)     # env -> tasks, avg@k (± stderr), pass@k, ...

``run_rollouts`` starts only the role processes that are not running already (one
``rlbus role inference --model <model>`` per model and one ``rlbus role env --env <env>``
per env; a role counts as running when its heartbeat in the role registry is fresh),
publishes the requests, follows ``trace.completed.<env>`` (``eval.completed.<env>`` for
the eval split) for their results, reports ``on_progress(done, total)`` as rollouts come
back, and stops what it started (SIGTERM, then waits for the drain). The commands
(``roles/cli/rollout.py``, ``roles/cli/eval.py``) print; ``benchmarks/rollout_bench.py``
plans.

Eval-split requests ask what the orchestrator's eval asks (the same tasks, seeds and,
with ``plan_requests``, the config's eval sampling) and are scored with its formula
(``roles.orchestrator.eval_stats.eval_metrics``), so ``rlbus eval`` of a run's weights
reads like the run's own eval. Every request carries phase ``ADHOC_PHASE``: a live
run's orchestrator folds only its own phases (``rl``, ``sft``, ``eval``), so ad-hoc
rollouts on its log neither become groups it trains on nor count in its eval rounds.
Every request carries the run's newest weights version (``policy_version``; 0 before
any), to which the env server pins an eval's generate requests, so inference answers
the whole eval with those weights (``inference.eval_pin_*``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from bus.reader import Progress  # on_progress(rollouts done, rollouts expected)
from configs import RunConfig, dump_toml
from configs.paths import RunPaths
from roles.up.eval_journal import EvalJournal
from roles.up.processes import RoleProcess, role_process

if TYPE_CHECKING:
    from schemas.rollout import Phase

Note = Callable[[str], None]
# What to publish about a finished collection (``rlbus eval``: its figures).
Report = Callable[["RolloutResult"], list[Any]]

# The phase of requests made outside a run's schedule (``schemas.TaskRequested.phase``).
ADHOC_PHASE: Phase = "adhoc"


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
    seating: Any = None  # Seating of a multi-agent env's config entry, or None
    seed: int | None = None  # the sampling table's own seed (None: the run seed)

    @property
    def total(self) -> int:
        """Rollouts in all."""
        return self.groups * self.group_size


def plan_requests(
    cfg: RunConfig, env: str, split: str, n: int, group_size: int, model: str
) -> Plan:
    """Sampling, args and max_turns for ``env`` from the config: for the eval split, as
    the run evaluates it (``OrchestratorConfig.eval_targets``: its eval entry's sampling,
    args and max_turns, else the eval defaults), else its train entry, if any."""
    from roles.lib.envs.registry import env_key
    from roles.lib.envs.seats import seating_of
    from roles.lib.tasks import sampling_params

    o = cfg.orchestrator
    entry = o.env(env)
    target = o.eval_target(env) if split == "eval" else None
    if split == "eval":
        s: Any = target.sampling if target is not None else o.eval.sampling
    else:
        s = entry.sampling if entry is not None and entry.sampling is not None else o.train.sampling
    args = target.args if target is not None else dict(entry.args) if entry else {}
    max_turns = target.max_turns if target is not None else entry.max_turns if entry else None
    sampling = sampling_params(s)
    return Plan(
        env=env,
        key=env_key(env),
        split=split,
        groups=math.ceil(n / group_size),
        group_size=group_size,
        model=model,
        env_args=args,
        sampling=sampling,
        max_turns=max_turns,
        seating=seating_of(entry, o.eval.learner_seat if split == "eval" else None)
        if entry
        else None,
        seed=s.seed,
    )


def eval_envs(cfg: RunConfig) -> list[str]:
    """The env ids a run evaluates: ``orchestrator.eval.env`` (empty: every train env)."""
    return [t.id for t in cfg.orchestrator.eval_targets()]


def eval_tasks(cfg: RunConfig, env: str) -> int:
    """Eval tasks of ``env`` per round: its eval entry's ``num_tasks``, else the default."""
    target = cfg.orchestrator.eval_target(env)
    return target.num_tasks if target is not None else cfg.orchestrator.eval.num_tasks


def split_size(plan: Plan) -> int:
    """Tasks in the plan's split; ``UnknownEnv``, ``ValueError`` or ``TypeError`` for an
    env that cannot be made with the plan's args."""
    from roles.lib.envs.registry import make_env

    return make_env(plan.env, plan.env_args).size(plan.split)


def build_requests(
    run: str, seed: int, plan: Plan, size: int, policy_version: int = 0
) -> list[Any]:
    """One TaskRequested per group: tasks 0, 1, ... of the split (of ``size`` tasks).
    Train seeds derive from the run seed; eval seeds are the orchestrator's eval seeds
    (``roles.lib.tasks``: both from the sampling table's ``seed`` when it sets one).
    ``policy_version``: the weights version asked at (an eval pins its turns to it)."""
    from roles.lib.tasks import eval_seed
    from schemas import TaskRef, TaskRequested, derive_id, new_id, stable_seed

    eval_split = plan.split == "eval"
    seed = seed if plan.seed is None else plan.seed  # plan.seed: the table's (seed_root)
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
                phase=ADHOC_PHASE,
                policy_version=policy_version,
                seed=eval_seed(seed, plan.env, g)
                if eval_split
                else stable_seed(seed, "rollout", plan.split, g),
                max_turns=plan.max_turns,
                args=plan.env_args,
                seating=plan.seating,
            )
        )
    return out


def summarize(traces: list[Any]) -> dict[str, Any]:
    """Mean reward, mean completion tokens, errors by kind, rollouts by stop condition
    (pure: easy to test)."""
    from roles.lib.envs.harness import completion_tokens

    errors = Counter(e.kind for t in traces for e in t.errors)
    stopped = Counter(t.stop_condition for t in traces if t.stop_condition)
    n = max(len(traces), 1)
    return {
        "rollouts": len(traces),
        "reward_mean": sum(t.reward for t in traces) / n,
        "completion_tokens_mean": sum(completion_tokens(t) for t in traces) / n,
        "errors": dict(sorted(errors.items())),
        "truncated": sum(1 for t in traces if t.truncated),
        "stopped": dict(stopped.most_common()),
    }


def eval_scores(plans: Sequence[Plan], result: RolloutResult, k: int) -> dict[str, Any]:
    """Per env id, by the orchestrator's ``eval_metrics`` over ``result``'s
    ``EvalCompleted`` answers: tasks answered, ``k``, ``avg@k`` and ``avg@k_stderr``,
    ``pass@j`` (None unless every reward is 0 or 1), rollouts with errors,
    ``answered_by_pinned`` (the share answered wholly by ``result.policy_version``) and
    the ``policy_versions`` that answered."""
    from roles.orchestrator.eval_stats import answering_versions, eval_metrics, pass_ks

    values = eval_metrics(list(result.results), k, result.policy_version)
    out: dict[str, Any] = {}
    for p in plans:
        mine = [r for r in result.results if r.env == p.key]
        scores: dict[str, Any] = {"tasks": len(mine), "k": k}
        for name in [f"avg@{k}", f"avg@{k}_stderr", *(f"pass@{j}" for j in pass_ks(k))]:
            scores[name] = values.get(f"{p.key}/{name}")
        scores["errors"] = int(values.get(f"{p.key}/errors", 0))
        scores["answered_by_pinned"] = values.get(f"{p.key}/answered_by_pinned")
        scores["policy_versions"] = answering_versions([t for r in mine for t in r.traces])
        out[p.env] = scores
    return out


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


async def missing_roles(
    bus: Any, cfg: RunConfig, plans: Sequence[Plan]
) -> list[tuple[str, list[str]]]:
    """The role processes to start: each model's and each env's, unless one has a fresh
    heartbeat in the registry (and, on this host, its process still exists: a killed
    ``rlbus eval``'s roles leave fresh beats for a few seconds, and a ``--resume`` right
    after it must start its own)."""
    from bus.registry import is_alive
    from bus.subjects import durable_name

    beats = [
        hb
        for hb in await bus.live_roles()
        if is_alive(hb, cfg.bus.heartbeat_interval_s) and not _gone(hb)
    ]
    out: list[tuple[str, list[str]]] = []
    for model in dict.fromkeys(p.model for p in plans):
        model_cfg = cfg.orchestrator.models.get(model)
        actor = "teacher" if model_cfg is not None and model_cfg.kind == "teacher" else "inference"
        if not any(
            hb.role == actor and hb.instance.startswith(f"{actor}-{model}-") for hb in beats
        ):
            out.append((f"{actor}-{model}", [actor, "--model", model]))
    for key, env in dict.fromkeys((p.key, p.env) for p in plans):
        durable = durable_name("env", key)
        if not any(hb.role == "env" and hb.consumer == durable for hb in beats):
            out.append((f"env-{key}", ["env", "--env", env]))
    return out


def _gone(hb: Any) -> bool:
    """Whether the process that beat ``hb`` ran on this host and exited (a zombie
    counts: a killed parent's children can stay unreaped where nothing reaps orphans)."""
    import os
    import socket

    if hb.host != socket.gethostname():
        return False
    if Path("/proc/self/stat").exists():
        try:
            stat = Path(f"/proc/{hb.pid}/stat").read_text()
        except FileNotFoundError:
            return True
        return stat.rsplit(")", 1)[-1].split()[:1] in (["Z"], ["X"])
    try:  # no /proc here: ask the process table
        os.kill(hb.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process
        return False
    return False


async def start_missing_roles(
    bus: Any,
    cfg: RunConfig,
    plans: Sequence[Plan],
    paths: RunPaths,
    url: str,
    config_path: Path,
    note: Note = _quiet,
) -> list[RoleProcess]:
    """Start the role processes ``plans`` need that are not running (``missing_roles``)."""
    from roles.runtime.context import policy_model_dir

    todo = await missing_roles(bus, cfg, plans)
    if todo and cfg.model.path == "tiny":
        # Build the tiny model once, before the roles race to it.
        await asyncio.to_thread(policy_model_dir, cfg, paths.run)
    started: list[RoleProcess] = []
    try:
        for name, args in todo:
            role = role_process(name, args, paths, url, config_path, sandbox=cfg.bus.sandbox)
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


async def newest_version(bus: Any) -> int:
    """The run's newest announced weights version (0 before the first): what the policy
    serves, and what an eval asks at."""
    from bus.reader import last_event
    from bus.subjects import Topic
    from schemas import WeightsPublished

    latest = await last_event(bus, Topic.WEIGHTS_PUBLISHED, (WeightsPublished,))
    return latest.version if latest is not None else 0


@dataclass
class RolloutResult:
    traces: list[Any] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)  # EvalCompleted, one per eval task
    policy_version: int = 0  # the newest weights version when asked: the requests' own
    wall_s: float = 0.0
    # 0: every trace came back; 1: a started role died, or the wait timed out; 2: an env
    # server dead-lettered a request (a bug in env code: ``env_error`` says which)
    code: int = 0
    role_died: bool = False  # a role this started exited: no summary to show
    env_error: str | None = None


async def run_rollouts(
    cfg: RunConfig,
    plans: Sequence[Plan],
    requests: Sequence[Any],
    paths: RunPaths,
    url: str,
    config_path: Path,
    timeout_s: float,
    note: Note = _quiet,
    on_progress: Progress | None = None,
    report: Report | None = None,
    journal: EvalJournal | None = None,
) -> RolloutResult:
    """Start the missing roles, publish ``requests`` (``build_requests`` of ``plans``; each
    gets the run's newest weights version), collect their traces (``on_progress(done,
    total)`` as they come), publish what ``report(result)`` makes of them (when every
    trace came back), stop what was started. With an eval ``journal``
    (``roles.up.eval_journal``) each answer is recorded as it comes, the tasks it holds
    answers of are not asked again, and the result holds its answers and the new ones
    (``JournalMismatch`` before anything starts when the run's weights moved on)."""
    from bus.runtime import Bus
    from roles.runtime.context import bus_settings

    run = paths.run
    bus = await Bus.connect(url, run=run, producer="cli-rollout", settings=bus_settings(cfg))
    await bus.ensure_stream()
    started: list[RoleProcess] = []
    t0 = time.monotonic()
    result = RolloutResult(policy_version=await newest_version(bus))
    requests = [msgspec.structs.replace(r, policy_version=result.policy_version) for r in requests]
    # Follow the results from just after the log's end before asking: none is missed.
    from_seq = await bus.last_seq() + 1
    earlier: list[Any] = []
    try:
        if journal is not None:
            requests, after = journal.ask(requests, result.policy_version, from_seq - 1)
            from_seq, earlier = after + 1, list(journal.answers.values())
        if requests:
            started = await start_missing_roles(bus, cfg, plans, paths, url, config_path, note)
            await _collect(
                bus, plans, requests, started, result, timeout_s, note, from_seq,
                on_progress, journal.answered if journal is not None else None,
                done_before=sum(len(a.traces) for a in earlier),
            )  # fmt: skip
        _merge(result, earlier)
        result.wall_s = time.monotonic() - t0
        if report is not None and result.code == 0:
            await bus.publish_many(report(result))
        return result
    finally:
        await stop_roles(started, note)
        await bus.close()


async def _collect(
    bus: Any,
    plans: Sequence[Plan],
    requests: Sequence[Any],
    started: list[RoleProcess],
    result: RolloutResult,
    timeout_s: float,
    note: Note,
    from_seq: int,
    on_progress: Progress | None,
    on_answer: Callable[[Any], None] | None = None,
    done_before: int = 0,
) -> None:
    """Publish the requests and fill ``result`` with their answers (read from the log from
    ``from_seq``; each eval answer also to ``on_answer`` as it comes) until every rollout
    is back, a started role dies, or ``timeout_s`` passes. ``done_before``: rollouts
    answered before (a resumed eval's), for the progress."""
    from bus.reader import LogReader
    from bus.subjects import Topic
    from schemas import DeadLettered, EvalCompleted, TraceCompleted

    t0, total = time.monotonic(), sum(r.group_size for r in requests)
    topics = [
        (Topic.EVAL_COMPLETED if p.split == "eval" else Topic.TRACE_COMPLETED, p.key) for p in plans
    ] + [(Topic.DEAD_LETTERED, "env")]  # a request an env server could not run
    wanted = {r.event_id for r in requests}
    traces: dict[str, Any] = {}
    answers: dict[str, Any] = {}  # request id -> EvalCompleted
    done = asyncio.Event()
    reader = LogReader(
        bus, from_seq=from_seq, topics=list(dict.fromkeys(topics)), follow=True,
        idle_timeout_s=0.5, stop=done,
    )  # fmt: skip

    async def collect() -> None:
        async for event in reader.events((TraceCompleted, EvalCompleted, DeadLettered)):
            if isinstance(event, DeadLettered):
                if event.causation_id in wanted:
                    result.env_error = event.headline
                    done.set()
                continue
            if event.request_id not in wanted:
                continue  # someone else's rollouts on the same env
            if isinstance(event, EvalCompleted):
                if event.request_id in answers:
                    continue  # a republished answer (a redelivered request)
                answers[event.request_id] = event
                if on_answer is not None:
                    on_answer(event)
                for t in event.traces:
                    traces[t.rollout_id] = t
            else:
                traces[event.trace.rollout_id] = event.trace
            if len(traces) >= total:
                done.set()

    collector = asyncio.create_task(collect())
    try:
        await bus.publish_many(list(requests))
        while not done.is_set():
            if died := next((s for s in started if not s.alive and s.proc is not None), None):
                code = died.proc.returncode if died.proc else None
                note(f"{died.name} exited with {code}; log tail:\n{died.tail()}")
                result.code, result.role_died = 1, True
                break
            if time.monotonic() - t0 > timeout_s:
                note(f"timed out after {timeout_s:.0f}s with {len(traces)}/{total} traces")
                result.code = 1
                break
            if collector.done():
                collector.result()  # a reader error surfaces here
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), 0.5)
            if on_progress is not None:
                on_progress(done_before + len(traces), done_before + total)
    finally:
        done.set()
        await asyncio.gather(collector, return_exceptions=True)
    if result.env_error is not None:
        note(f"an env server dead-lettered a request: {result.env_error}")
        result.code = 2
    result.traces = list(traces.values())
    result.results = list(answers.values())


def _merge(result: RolloutResult, earlier: Sequence[Any]) -> None:
    """Add ``earlier`` answers (a resumed eval's) to ``result``, and put its answers and
    traces in one order whatever order they came in (env, task, sample), so an eval's
    figures, whose sums are over that order, are the same to the last bit from one
    collection or several."""
    results = [*earlier, *result.results]
    traces = [*(t for r in earlier for t in r.traces), *result.traces]
    result.results = sorted(results, key=lambda r: (r.env, r.task_index))
    result.traces = sorted(traces, key=lambda t: (t.env, t.task.index, t.group_id, t.sample_index))


__all__ = [
    "ADHOC_PHASE",
    "Plan",
    "RolloutResult",
    "build_requests",
    "eval_envs",
    "eval_scores",
    "eval_tasks",
    "missing_roles",
    "newest_version",
    "plan_requests",
    "run_rollouts",
    "split_size",
    "start_missing_roles",
    "stop_roles",
    "summarize",
    "write_config",
]
