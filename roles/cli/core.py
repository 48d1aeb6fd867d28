"""Core commands: up, status, events, topology."""

from __future__ import annotations

from typing import Any, NoReturn

import typer

from roles.cli.common import run_async, run_option, server_for


def register(app: typer.Typer) -> None:
    app.command("up")(up)
    app.command("status")(status)
    app.command("events")(events)
    app.command("topology")(topology)


def up(
    overrides: list[str] = typer.Argument(None, help="Config overrides, dotted: trainer.lr=1e-4"),
    config: str = typer.Option("default", "--config", "-c", help="Preset name or TOML file."),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Print the fully resolved config and exit."
    ),
    nats_url: str | None = typer.Option(
        None, "--nats-url", help="Use this NATS server instead of an embedded one."
    ),
    run: str | None = run_option(None, "Run id (default: generated)."),
    no_view: bool = typer.Option(
        False, "--no-view", help="Plain log lines instead of the live view."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="The launcher's log lines as JSON (no live view)."
    ),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue run --run with its own config (an interrupted one, or a finished one "
        "with a higher max_steps=N; only keys safe mid-run may be overridden).",
    ),
    fresh: bool = typer.Option(
        False, "--fresh", help="Delete the existing run --run and start it over."
    ),
    cluster: int | None = typer.Option(
        None,
        "--cluster",
        min=1,
        max=9,
        help="Run on an embedded N-node JetStream cluster (bus.cluster).",
    ),
) -> None:
    """Start a run: embedded NATS, every role as a process, a live view; Ctrl-C drains.

    A run id that is live or already has data is refused unless --resume or --fresh.
    prime-rl's spellings work too: @ file.toml for -c file.toml, --trainer.lr 1e-4 for
    trainer.lr=1e-4. Log lines are plain on a terminal; JSON with --json, or with
    --no-view on a pipe; always JSON in runs/<run>/logs/launcher.log."""
    from configs import ConfigError, dump_toml, load_config
    from configs.paths import settle_data_dir
    from roles.algorithm.checks import check_routing
    from roles.cli.common import fail

    for o in overrides or []:
        if "=" not in o:  # the one positional that is not an override: a run id, likely
            fail(f"rlbus up: {o!r} is not an override (dotted.key=value); a run id is --run {o}")

    if resume or fresh:
        config = _resumed_config(config, overrides or [], run, resume, fresh)
    if cluster is not None:
        if resume:
            fail("rlbus up: --resume keeps the run's own cluster: drop --cluster")
        overrides = [*(overrides or []), f"bus.cluster={cluster}"]

    try:
        cfg = settle_data_dir(load_config(config, overrides or []), overrides or [])
        from roles.up.preflight import check, device_problems  # models, names, disk, GPU

        # first: check_routing builds every env and algorithm it names. A dry run resolves
        # a GPU config on any machine (preflight's docstring); it only notes the devices.
        check(cfg, devices=not dry_run)
        check_routing(cfg)
    except ConfigError as e:
        typer.echo(f"config error: {e}", err=True)
        raise typer.Exit(2) from None
    if run:
        cfg.run = run
    if dry_run:
        if problems := device_problems(cfg):
            typer.echo(f"note: rlbus up would refuse this here: {'; '.join(problems)}", err=True)
        typer.echo(dump_toml(cfg), nl=False)
        return
    from roles.up.launcher import launch
    from roles.up.run_guard import Mode

    mode: Mode = "resume" if resume else "fresh" if fresh else "new"
    live_view = not (no_view or as_json)
    raise typer.Exit(
        launch(cfg, nats_url=nats_url, live_view=live_view, mode=mode, json_lines=as_json)
    )


def _resumed_config(
    config: str, overrides: list[str], run: str | None, resume: bool, fresh: bool
) -> str:
    """The config ``up`` loads with --resume (the run's own ``config.toml``) or --fresh.

    ``overrides`` with --resume may change only the keys a run may change mid-way
    (``roles.up.run_guard.RESUMABLE``, e.g. ``max_steps=600`` to train a finished run on);
    any other is refused by name. ``up`` applies them over the run's own config, the
    launcher writes the result as the run's ``config.toml``, and the orchestrator records
    it on the log (a ``run.started`` with ``resumed=True``)."""
    from configs.paths import RunPaths, data_dir_override, resolve_data_dir
    from roles.cli.common import fail
    from roles.up.run_guard import RESUMABLE, resume_override_problem

    def refuse(msg: str) -> NoReturn:
        fail(f"rlbus up: {msg}")

    if resume and fresh:
        refuse("--resume and --fresh exclude each other")
    if not run:
        refuse(f"--{'resume' if resume else 'fresh'} needs --run")
    if not resume:
        return config
    data_dir = data_dir_override(overrides)
    if config != "default":
        refuse(
            "--resume continues a run with its own config: drop -c and overrides "
            f"(it may change only {', '.join(RESUMABLE)})"
        )
    if problem := resume_override_problem(overrides):
        refuse(problem)
    own = RunPaths(resolve_data_dir(data_dir), run).config
    return str(own) if own.exists() else config  # missing: the launcher says why


def status(
    run: str | None = run_option(None, "Run id; without it, the runs on the server."),
    nats_url: str | None = typer.Option(None, "--nats-url"),
) -> None:
    """Whether a run is running, finished or failed (and why), its step and phase, its
    live roles (heartbeats, lag), env and inference pools (replicas, backlog) and
    algorithms; without --run, the runs on the server."""
    from rich.table import Table

    from roles.cli.common import wide_console

    console = wide_console()

    async def main(url: str) -> None:
        import time

        from bus.registry import is_alive
        from bus.runtime import Bus
        from roles.runtime.context import read_run_started

        bus = await Bus.connect(url, run=run or "status", producer="cli")
        try:
            if run is None:
                table = Table("stream", "messages", "bytes")
                for s in await bus.run_streams():
                    table.add_row(s.stream, str(s.messages), str(s.bytes))
                console.print(table)
                return
            from configs import load_config, resolve

            started = await read_run_started(bus)
            # Liveness is judged against the run's own heartbeat interval.
            cfg = resolve(started.config) if started is not None else load_config()
            interval = cfg.bus.heartbeat_interval_s
            now = time.time_ns()
            beats = await bus.live_roles()
            alive = [hb for hb in beats if is_alive(hb, interval, now)]
            line = run_state_line(run, *await _progress(bus), len(alive), cfg.max_steps)
            console.print(line, highlight=False, markup=False)
            table = Table(
                "role", "instance", "state", "last seen", "policy", "lag", "consumer", "host:pid"
            )
            for hb in beats:
                state = (
                    "alive" if hb in alive else ("stopped" if hb.status == "stopped" else "stale")
                )
                table.add_row(
                    hb.role, hb.instance, state, f"{(now - hb.last_seen_ns) / 1e9:.1f}s ago",
                    "" if hb.policy_version is None else str(hb.policy_version),
                    "" if hb.pending is None else str(hb.pending), hb.consumer or "", f"{hb.host}:{hb.pid}",
                )  # fmt: skip
            console.print(table)
            for hb in beats:  # the orchestrator's stall report (roles/orchestrator/role.py)
                if hb.status != "stopped" and "stalled_s" in hb.info:
                    console.print(
                        f"[bold red]stalled[/] for {hb.info['stalled_s']} s, waiting for: "
                        + hb.info.get("waiting_for", "?"),
                        highlight=False,
                    )
            if started is not None:
                from roles.cli.algorithm import algorithm_rich_table
                from roles.up.pools import env_backlogs, pool_rows

                # Each env's pool (replicas alive, bounds, groups waiting + in flight) and
                # each model's inference replicas (docs/running.md#env-pools).
                pools = Table("pool", "replicas", "min..max", "backlog (groups)")
                backlogs = await env_backlogs(bus, cfg)
                for row in pool_rows(cfg, beats, backlogs, interval, now):
                    pools.add_row(*row)
                console.print(pools)
                console.print(await algorithm_rich_table(bus, cfg))
        finally:
            await bus.close()

    with server_for(run, nats_url, existing=True) as url:
        run_async(main(url))


async def _progress(bus: Any) -> tuple[Any, int | None, str | None]:
    """(the run's ``run.stopped``, unless a resume started it again since; the step of its
    newest weights; the phase of its newest batch) from the log."""
    from bus.reader import last_event, last_seq
    from bus.subjects import Topic
    from schemas import BatchAssembled, RunStopped, WeightsPublished

    stopped = await last_event(bus, Topic.RUN_STOPPED, (RunStopped,))
    if stopped is not None and await last_seq(bus, Topic.RUN_STARTED) > await last_seq(
        bus, Topic.RUN_STOPPED
    ):
        stopped = None  # resumed after it stopped
    weights = await last_event(bus, Topic.WEIGHTS_PUBLISHED, (WeightsPublished,))
    batch = await last_event(bus, Topic.BATCH_ASSEMBLED, (BatchAssembled,))
    return stopped, None if weights is None else weights.version, batch and batch.phase


def run_state_line(
    run: str, stopped: Any, step: int | None, phase: str | None, alive: int, max_steps: int
) -> str:
    """The run in one line: finished, failed (and why) or stopped by its user, running,
    or neither (interrupted: no role alive and no ``run.stopped``); its step and phase
    (warm start or RL). ``stopped``: its ``run.stopped`` event (reasons: schemas/run.py)."""
    named = {"sft": "warm start (sft)", "rl": "RL"}.get(phase or "", "")
    at = "" if step is None else f"step {step}/{max_steps}{f', {named}' if named else ''}"
    if stopped is not None:
        why = f"{stopped.reason}{f': {stopped.detail}' if stopped.detail else ''}"
        if stopped.reason == "max_steps":
            what = "finished"
        elif stopped.reason == "user":
            what = "stopped by its user"
        else:
            what = "failed"
        return f"run {run} {what} ({why}) at step {stopped.step}/{max_steps}{f', {named}' if named else ''}"
    if alive:
        return f"run {run} running: {at or 'starting (no step yet)'}"
    return (
        f"run {run} not running: no role alive and no run.stopped (interrupted{f' at {at}' if at else ''});"
        f" `rlbus up --run {run} --resume` continues it"
    )


def events(
    run: str = run_option(),
    topic: list[str] = typer.Option(
        None, "--topic", "-t", help="Only these topics (e.g. trace.completed)."
    ),
    from_seq: int = typer.Option(1, "--from-seq", help="Start at this stream sequence."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events."),
    limit: int = typer.Option(
        0, "--limit", "-n", help="Stop after this many events (0: no limit)."
    ),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per line."),
    nats_url: str | None = typer.Option(None, "--nats-url"),
) -> None:
    """Pretty-print (or follow) a run's log: sequence, time, subject, event summary."""
    from roles.cli.events import print_events

    with server_for(run, nats_url, existing=True) as url:
        run_async(print_events(url, run, topic or [], from_seq, follow, limit, as_json))


def topology() -> None:
    """The topic table (subject, schema, producer, consumers) and what each role kind's
    identity may publish and consume (``bus.auth``)."""
    from rich.console import Console
    from rich.table import Table

    from bus.auth import permission_rows
    from bus.subjects import topology as rows

    table = Table("subject", "schema", "producer", "consumers", title="rlbus topology")
    for row in rows():
        table.add_row(*row)
    console = Console(width=160)
    console.print(table)
    perms = Table("identity", "may publish", "may consume", title="identities (per run)")
    for perm in permission_rows():
        perms.add_row(*perm)
    console.print(perms)
