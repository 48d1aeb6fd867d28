"""``rlbus algorithm attach|detach|list``: algorithm workers on a live run.

    rlbus algorithm attach max_rl --run R --shadow --from-start   # compare on the same rollouts
    rlbus algorithm attach rloo --run R --env reverse-text        # train on it from now on
    rlbus algorithm detach rloo --run R
    rlbus algorithm list --run R

``attach`` publishes ``algorithm.attached`` (the routing change is an event on the log,
so the orchestrator, a restart and a replay all see it) and then runs the worker in the
foreground until Ctrl-C or ``detach``. Attaching an id that is already attached resumes
its worker (same consumer, same routing). Without ``--from-start`` the worker scores
traces stored from the attach on; with it, the whole log first. That catch-up runs in
the worker (``roles.algorithm.role``), which this command runs in the foreground, so its
progress is the worker's own log on this command's stderr: an ``algorithm.catch_up`` line
every few seconds (traces read of those stored), then ``algorithm.caught_up``. The same
lines land in the role's log file when ``rlbus up`` runs the worker.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import typer

from roles.cli.common import run_async, run_option, server_for

if TYPE_CHECKING:
    from bus.reader import Progress
    from schemas import AlgorithmAttached

app = typer.Typer(help="Attach, detach and list algorithm workers of a run.", no_args_is_help=True)

RUN = run_option()
URL = typer.Option(None, "--nats-url", help="NATS URL (default: the run's embedded server).")


def _options(pairs: list[str]) -> dict[str, object]:
    """``--option beta=0.5`` pairs as a dict; values parse as TOML (numbers, bools, lists)."""
    import tomllib

    out: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise typer.BadParameter(f"--option {pair!r}: expected key=value")
        try:
            out[key] = tomllib.loads(f"v = {value}")["v"]
        except tomllib.TOMLDecodeError:
            out[key] = value  # a bare word: a string
    return out


@app.command("attach")
def attach(
    name: str = typer.Argument(..., help="Registered algorithm name or pkg.module:Class."),
    run: str = RUN,
    nats_url: str | None = URL,
    env: list[str] = typer.Option(None, "--env", "-e", help="Train on these envs only (default: all)."),
    shadow: bool = typer.Option(False, "--shadow", help="Score only: samples go to the log and the lake, never to training."),
    from_start: bool = typer.Option(False, "--from-start", help="Score every trace of the log, not only new ones."),
    algorithm_id: str | None = typer.Option(None, "--id", help="Worker id (default: the name's last part)."),
    option: list[str] = typer.Option(None, "--option", "-o", help="Algorithm option key=value (repeatable)."),
    as_json: bool = typer.Option(False, "--json", help="The worker's log lines as JSON (default: plain lines)."),
) -> None:  # fmt: skip
    """Attach an algorithm worker to a live run and run it here until Ctrl-C or detach."""
    from bus.log import configure
    from bus.subjects import check_token, token_for
    from roles.runtime.context import role_context

    wid = algorithm_id or token_for(name.rsplit(":", 1)[-1])
    check_token(wid, "algorithm id")
    options = _options(option or [])
    with server_for(run, nats_url, existing=True, identity="attach") as url:
        ctx = run_async(role_context(run, url, "algorithm", None, wid))
        configure(run=run, role="algorithm", instance=ctx.instance, json=as_json)
        attached = run_async(
            _publish_attach(ctx, wid, name, options, env or [], shadow, from_start)
        )
        typer.echo(
            f"attached {wid} ({name}, {'shadow' if shadow else 'training'}) to {run}; "
            f"scoring traces from seq {attached.from_seq}, stored ones first. Ctrl-C stops "
            f"this worker (it stays attached); `rlbus algorithm detach {wid} --run {run}` "
            "detaches it.",
            err=True,
        )
        from roles.algorithm.core import ScoringCore
        from roles.algorithm.role import serve_worker

        core = ScoringCore.attached(ctx.cfg, attached)  # the worker runs as the log says
        with _catch_up_progress(wid) as on_catch_up:
            run_async(serve_worker(ctx, core, exit_when_done=True, on_catch_up=on_catch_up))


@contextlib.contextmanager
def _catch_up_progress(wid: str) -> Iterator[Progress]:
    """The catch-up's progress (traces read of those stored), closed once it has read
    them all: the worker then goes on scoring new traces as they come."""
    from roles.cli.progress import progress

    with contextlib.ExitStack() as stack:
        update = stack.enter_context(progress(f"catch-up {wid}", unit="traces"))

        def on_catch_up(done: int, total: int | None) -> None:
            update(done, total)
            if total is not None and done >= total:
                stack.close()

        yield on_catch_up


async def _publish_attach(ctx, wid, name, options, envs, shadow, from_start) -> AlgorithmAttached:  # type: ignore[no-untyped-def]
    """Publish the attach event, or find the standing one (a resume), and return it: the
    worker runs as the log says, whatever this command line repeats."""
    from roles.algorithm.checks import algorithm_problems
    from roles.cli.attachments import attachment_events, current
    from schemas import AlgorithmAttached

    cfg = ctx.cfg
    env_keys = []
    for e in envs:
        entry = cfg.orchestrator.env(e)
        if entry is None:
            ids = sorted(env.id for env in cfg.orchestrator.train.env)
            raise typer.BadParameter(f"--env {e!r} is not an env of this run ({ids})")
        env_keys.append(entry.key)
    bus = await ctx.connect()
    try:
        standing = current(await attachment_events(bus)).get(wid)
        if standing is not None:
            if (standing.name, standing.options, standing.shadow) != (name, options, shadow):
                raise typer.BadParameter(
                    f"{wid!r} is attached as {standing.name} {standing.options} "
                    f"(shadow={standing.shadow}); detach it first or pick another --id"
                )
            return standing  # resume the standing attachment
        if (spec := cfg.orchestrator.algorithm(wid)) is not None and not spec.shadow:
            raise typer.BadParameter(
                f"{wid!r} is a training algorithm of the config; pick another --id"
            )
        problems = algorithm_problems(cfg, f"attach {wid}", name, options, env_keys)
        if problems:
            raise typer.BadParameter("; ".join(problems))
        # Not from the start: from the next stored event on (the attach event itself).
        from_seq = 1 if from_start else await bus.last_seq() + 1
        event = AlgorithmAttached(
            run=ctx.run, algorithm=wid, name=name, options=options, envs=env_keys,
            shadow=shadow, from_seq=from_seq,
        )  # fmt: skip
        await bus.publish(event)
        return event
    finally:
        await bus.close()


@app.command("detach")
def detach(
    algorithm_id: str = typer.Argument(..., help="The attached worker's id."),
    run: str = RUN,
    nats_url: str | None = URL,
) -> None:
    """Stop training on an algorithm's samples; its worker stops by itself."""

    async def main(url: str) -> None:
        from roles.cli.attachments import attachment_events, routing
        from roles.runtime.context import role_context
        from schemas import AlgorithmAttached, AlgorithmDetached

        ctx = await role_context(run, url, "cli", None)
        bus = await ctx.connect()
        try:
            events = await attachment_events(bus)
            route = routing(ctx.cfg, events)
            known = {a.id for a in ctx.cfg.orchestrator.algorithms} | {
                e.algorithm for e in events if isinstance(e, AlgorithmAttached)
            }
            if algorithm_id not in known:
                raise typer.BadParameter(f"{algorithm_id!r} is not an algorithm of run {run!r}")
            orphaned = [env for env, ids in route.items() if ids == {algorithm_id}]
            if orphaned:
                raise typer.BadParameter(
                    f"{algorithm_id!r} is the only training algorithm of {orphaned}: attach "
                    "another one first, or the run would stall"
                )
            await bus.publish(AlgorithmDetached(run=run, algorithm=algorithm_id))
            typer.echo(f"detached {algorithm_id} from {run}")
        finally:
            await bus.close()

    with server_for(run, nats_url, existing=True, identity="attach") as url:
        run_async(main(url))


@app.command("list")
def list_algorithms(run: str = RUN, nats_url: str | None = URL) -> None:
    """Every algorithm of the run: config or attached, training or shadow, envs and lag."""
    from roles.cli.common import wide_console

    async def main(url: str) -> None:
        from roles.runtime.context import role_context

        ctx = await role_context(run, url, "cli", None)
        bus = await ctx.connect()
        try:
            wide_console().print(await algorithm_rich_table(bus, ctx.cfg))
        finally:
            await bus.close()

    with server_for(run, nats_url, existing=True) as url:
        run_async(main(url))


async def algorithm_rich_table(bus, cfg):  # type: ignore[no-untyped-def]
    """The algorithms table of ``list`` and ``rlbus status``."""
    from rich.table import Table

    from roles.cli.attachments import algorithm_table

    table = Table("algorithm", "name", "source", "mode", "envs", "lag", title="algorithms")
    for row in await algorithm_table(bus, cfg):
        table.add_row(
            row.id, row.name, row.source, "shadow" if row.shadow else "train",
            ", ".join(row.envs) or "-", "-" if row.lag is None else str(row.lag),
        )  # fmt: skip
    return table
