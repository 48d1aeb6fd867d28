"""Core commands: up, status, events, topology."""

from __future__ import annotations

from typing import NoReturn

import typer

from roles.cli.common import run_async, server_for


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
    run: str | None = typer.Option(None, "--run", help="Run id (default: generated)."),
    no_view: bool = typer.Option(
        False, "--no-view", help="Plain log lines instead of the live view."
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Continue the interrupted run --run, with its own config."
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

    A run id that is live or already has data is refused unless --resume or --fresh."""
    from configs import ConfigError, dump_toml, load_config
    from configs.paths import settle_data_dir
    from roles.algorithm.checks import check_routing

    if resume or fresh:
        config = _resumed_config(config, overrides or [], run, resume, fresh)
    if cluster is not None:
        if resume:
            from roles.cli.common import fail

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
    raise typer.Exit(launch(cfg, nats_url=nats_url, live_view=not no_view, mode=mode))


def _resumed_config(
    config: str, overrides: list[str], run: str | None, resume: bool, fresh: bool
) -> str:
    """The config ``up`` loads with --resume (the run's own ``config.toml``) or --fresh."""
    from configs.paths import RunPaths, data_dir_override, resolve_data_dir
    from roles.cli.common import fail

    def refuse(msg: str) -> NoReturn:
        fail(f"rlbus up: {msg}")

    if resume and fresh:
        refuse("--resume and --fresh exclude each other")
    if not run:
        refuse(f"--{'resume' if resume else 'fresh'} needs --run")
    if not resume:
        return config
    data_dir = data_dir_override(overrides)
    if config != "default" or any(not o.startswith("bus.data_dir=") for o in overrides):
        refuse("--resume continues a run with its own config: drop -c and overrides")
    own = RunPaths(resolve_data_dir(data_dir), run).config
    return str(own) if own.exists() else config  # missing: the launcher says why


def status(
    run: str | None = typer.Option(None, "--run", "-r", help="Run id; without it, list runs."),
    nats_url: str | None = typer.Option(None, "--nats-url"),
) -> None:
    """List live roles of a run (heartbeats, lag), its env and inference pools (replicas,
    backlog), or the runs on the server."""
    from rich.console import Console
    from rich.table import Table

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
                Console().print(table)
                return
            from configs import load_config, resolve

            started = await read_run_started(bus)
            # Liveness is judged against the run's own heartbeat interval.
            cfg = resolve(started.config) if started is not None else load_config()
            interval = cfg.bus.heartbeat_interval_s
            table = Table(
                "role", "instance", "state", "last seen", "policy", "lag", "consumer", "host:pid"
            )
            now = time.time_ns()
            beats = await bus.live_roles()
            for hb in beats:
                state = (
                    "alive"
                    if is_alive(hb, interval, now)
                    else ("stopped" if hb.status == "stopped" else "stale")
                )
                table.add_row(
                    hb.role, hb.instance, state, f"{(now - hb.last_seen_ns) / 1e9:.1f}s ago",
                    "" if hb.policy_version is None else str(hb.policy_version),
                    "" if hb.pending is None else str(hb.pending), hb.consumer or "", f"{hb.host}:{hb.pid}",
                )  # fmt: skip
            Console().print(table)
            for hb in beats:  # the orchestrator's stall report (roles/orchestrator/role.py)
                if hb.status != "stopped" and "stalled_s" in hb.info:
                    Console().print(
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
                Console().print(pools)
                Console().print(await algorithm_rich_table(bus, cfg))
        finally:
            await bus.close()

    with server_for(run, nats_url, existing=True) as url:
        run_async(main(url))


def events(
    run: str = typer.Argument(..., help="Run id."),
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
    for row in permission_rows():
        perms.add_row(*row)
    console.print(perms)
