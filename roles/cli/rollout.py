"""``rlbus rollout``: run N rollouts of one environment against a model and show them.

    rlbus rollout --env reverse-text -n 32 --group-size 8
    rlbus rollout --env alphabet-sort -n 4 -g 2 orchestrator.train.sampling.max_completion_tokens=40
    rlbus rollout --env examples.word_count_env:make_env -n 8 -g 4
    rlbus rollout --run demo --split eval -n 8 -g 1     # against a live run's roles

It starts only what is not running already: an embedded nats-server under
``<data_dir>/<run>/nats`` (unless ``--nats-url`` or the run's server is up), the tiny
model (built once under the run directory), one ``rlbus role inference --model <model>``
and one ``rlbus role env --env <env>`` process (``--config`` = the resolved config
written to ``<run>/config.toml``; logs in ``<run>/logs/<name>.log``). A role counts as
running when its heartbeat in the role registry is fresh. Then it publishes
``ceil(n / group_size)`` ``TaskRequested`` events (tasks 0, 1, ... of the split, seeds
derived from the run seed), follows ``trace.completed.<env>`` (``eval.completed.<env>``
for ``--split eval``) for their results, prints a summary and one rendered trace, and
stops what it started (SIGTERM, then waits for the drain).

Registered in the app by ``roles.cli`` (``app.command("rollout")(rollout)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer


def rollout(
    overrides: list[str] = typer.Argument(
        None, help="Config overrides, dotted: bus.data_dir=/tmp/r"
    ),
    env: str = typer.Option(
        "reverse-text", "--env", "-e", help="Env id: built-in name or module:function."
    ),
    n: int = typer.Option(32, "-n", help="Rollouts in all (rounded up to whole groups)."),
    group_size: int = typer.Option(8, "--group-size", "-g", help="Rollouts per task."),
    config: str = typer.Option("smoke", "--config", "-c", help="Preset name or TOML file."),
    nats_url: str | None = typer.Option(None, "--nats-url", help="Use this NATS server."),
    run: str | None = typer.Option(None, "--run", "-r", help="Run id (default: a new one)."),
    split: str = typer.Option("train", "--split", help="train or eval."),
    model: str = typer.Option("policy", "--model", "-m", help="Inference model that acts."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for every trace."),
) -> None:
    """Run N rollouts of one env (starting NATS, inference and the env server if needed)."""
    from configs import ConfigError, dump_toml, load_config
    from roles.lib.envs.registry import UnknownEnv, make_env

    if split not in ("train", "eval"):
        raise typer.BadParameter("--split must be train or eval")
    if n < 1 or group_size < 1:
        raise typer.BadParameter("-n and --group-size must be >= 1")
    try:
        cfg = load_config(config, overrides or [])
    except ConfigError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2) from None
    run = run or cfg.run or time.strftime("rollout-%Y%m%d-%H%M%S", time.gmtime())
    cfg.run = run
    plan = plan_requests(cfg, env, split, n, group_size, model)
    try:
        size = make_env(env, plan.env_args).size(split)
    except (UnknownEnv, ValueError, TypeError) as e:
        typer.echo(f"env error: {e}", err=True)
        raise typer.Exit(2) from None
    run_dir = Path(cfg.bus.data_dir) / run
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.toml"
    text = dump_toml(cfg)
    if config_path.exists() and config_path.read_text() != text:
        config_path = run_dir / "rollout.config.toml"  # never rewrite a live run's config
    config_path.write_text(text)

    from bus.server import EmbeddedServer, running_server_url

    server = None
    url = nats_url or os.environ.get("RLBUS_NATS_URL") or running_server_url(run_dir / "nats")
    if not url:
        server = EmbeddedServer(run_dir / "nats").start()
        url = server.url
    try:
        code = asyncio.run(_main(cfg, run, url, plan, size, config_path, run_dir, timeout))
    except KeyboardInterrupt:
        code = 130
    finally:
        if server is not None:
            server.stop()
    raise typer.Exit(code)


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


def plan_requests(cfg: Any, env: str, split: str, n: int, group_size: int, model: str) -> Plan:
    """Sampling, args and max_turns for ``env`` from the config (its train entry, if any)."""
    from roles.lib.envs.registry import env_key
    from schemas import SamplingParams

    entry = next((e for e in cfg.orchestrator.train.env if e.id == env), None)
    if split == "eval":
        s = cfg.orchestrator.eval.sampling
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


# -- processes we start -------------------------------------------------------------------


async def _needed(bus: Any, cfg: Any, plan: Plan) -> list[tuple[str, list[str]]]:
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


# -- the run --------------------------------------------------------------------------------


async def _main(
    cfg: Any,
    run: str,
    url: str,
    plan: Plan,
    size: int,
    config_path: Path,
    run_dir: Path,
    timeout_s: float,
) -> int:
    from bus.reader import LogReader
    from bus.runtime import Bus
    from bus.subjects import Topic
    from roles.runtime.context import bus_settings, policy_model_dir
    from schemas import EvalCompleted, TraceCompleted

    bus = await Bus.connect(url, run=run, producer="cli-rollout", settings=bus_settings(cfg))
    await bus.ensure_stream()
    from roles.up.processes import RoleProcess, role_argv

    started: list[RoleProcess] = []
    t0 = time.monotonic()
    try:
        todo = await _needed(bus, cfg, plan)
        if todo and cfg.model.path == "tiny":
            # Build the tiny model once, before the roles race to it.
            await asyncio.to_thread(policy_model_dir, cfg, run)
        for name, args in todo:
            role = RoleProcess(
                name, role_argv(args, run, url, config_path), run_dir / "logs" / f"{name}.log"
            )
            role.start()
            started.append(role)
            typer.echo(
                f"started {name} (pid {role.proc.pid if role.proc else '?'}, log {role.log_path})",
                err=True,
            )

        eval_split = plan.split == "eval"
        topic = Topic.EVAL_COMPLETED if eval_split else Topic.TRACE_COMPLETED
        schema = EvalCompleted if eval_split else TraceCompleted
        requests = build_requests(run, cfg.seed, plan, size)
        wanted = {r.event_id for r in requests}
        total = plan.groups * plan.group_size
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
                if len(traces) >= total:
                    done.set()

        collector = asyncio.create_task(collect())
        await bus.publish_many(requests)
        code = 0
        from rich.progress import Progress

        try:
            with Progress(transient=True) as progress:
                bar = progress.add_task(f"{plan.env} rollouts", total=total)
                while not done.is_set():
                    for s in started:
                        if not s.alive and s.proc is not None:
                            typer.echo(
                                f"{s.name} exited with {s.proc.returncode}; log tail:\n{s.tail()}",
                                err=True,
                            )
                            return 1
                    if time.monotonic() - t0 > timeout_s:
                        typer.echo(
                            f"timed out after {timeout_s:.0f}s with {len(traces)}/{total} traces",
                            err=True,
                        )
                        code = 1
                        break
                    if collector.done():
                        collector.result()  # a reader error surfaces here
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(done.wait(), 0.5)
                    progress.update(bar, completed=len(traces))
        finally:
            done.set()
            await asyncio.gather(collector, return_exceptions=True)
        wall = time.monotonic() - t0
        print_summary(plan, list(traces.values()), wall)
        if traces:
            print_trace(pick_trace(list(traces.values())), cfg, run, plan.model)
        return code
    finally:
        for s in reversed(started):
            s.terminate()
            await asyncio.to_thread(s.wait, 30.0)
            typer.echo(f"stopped {s.name} (exit {s.proc.returncode if s.proc else '?'})", err=True)
        await bus.close()


# -- output -------------------------------------------------------------------------------


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


def print_summary(plan: Plan, traces: list[Any], wall_s: float) -> None:
    s = summarize(traces)
    errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"
    typer.echo(
        f"env {plan.env}  split {plan.split}  model {plan.model}  "
        f"groups {plan.groups} x {plan.group_size}"
    )
    typer.echo(f"rollouts: {s['rollouts']}")
    typer.echo(f"mean reward: {s['reward_mean']:.4f}")
    typer.echo(
        f"mean completion tokens: {s['completion_tokens_mean']:.1f}  (truncated: {s['truncated']})"
    )
    typer.echo(f"errors: {errors}")
    typer.echo(f"wall time: {wall_s:.1f}s  ({s['rollouts'] / max(wall_s, 1e-9):.2f} rollouts/s)")


def pick_trace(traces: list[Any]) -> Any:
    """The trace to show: the first without errors (by request, then sample index)."""
    ordered = sorted(traces, key=lambda t: (t.group_id, t.sample_index))
    return next((t for t in ordered if t.ok), ordered[0])


def _token_texts(ids: list[int], cfg: Any, run: str, model: str) -> list[str]:
    """Token strings for display; token ids when the tokenizer cannot be loaded."""
    try:
        endpoint = cfg.orchestrator.models.get(model)
        path = endpoint.path if endpoint is not None and endpoint.path else cfg.model.path
        if path == "tiny":  # the tiny model's tokenizer needs no files
            from roles.lib.model.tokenizer import build_tokenizer

            tokenizer = build_tokenizer()
        else:
            from roles.lib.model.loading import load_tokenizer

            tokenizer = load_tokenizer(path)
        return [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
    except Exception:  # noqa: BLE001 - display only
        return [f"#{i}" for i in ids]


def print_trace(trace: Any, cfg: Any, run: str, model: str) -> None:
    from schemas.arrays import f32, i32, mask

    typer.echo(
        f"\n--- trace {trace.rollout_id[:12]} (task {trace.task.split}/{trace.task.index}, "
        f"sample {trace.sample_index}, reward {trace.reward:.4f}, turns {trace.num_turns}) ---"
    )
    if trace.rewards or trace.metrics:
        typer.echo(f"rewards {trace.rewards}  metrics {trace.metrics}")
    for e in trace.errors:
        typer.echo(f"error {e.kind}: {e.message}")
    for m in trace.messages:
        typer.echo(f"[{m.role}{':' + m.name if m.name else ''}] {m.content!r}")
        sampled = mask(m.sampled)
        if not sampled.any():
            continue
        ids = i32(m.token_ids)[sampled].tolist()
        lps = f32(m.logprobs)[sampled].tolist()
        texts = _token_texts(ids, cfg, run, model)
        typer.echo(
            f"    completion ({len(ids)} tokens, policy v{m.policy_version}, T={m.temperature}):"
        )
        typer.echo("    " + "  ".join(f"{t!r}:{lp:.2f}" for t, lp in zip(texts, lps, strict=True)))
