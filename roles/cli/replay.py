"""``rlbus replay``, ``export``, ``import``, ``plot``: the run is its log.

    rlbus replay --run <run> trainer [--until N] [--fork NEW --from N key=value ...]
    rlbus replay --run <run> algorithm <id>
    rlbus replay --run <run> rubric [--env KEY] [--no-eval]
    rlbus replay --run <run> orchestrator
    rlbus export --run <run> run.tar ; rlbus import run.tar [--data-dir D] [--run NEW]
    rlbus plot --run <run> [--out curves.png]

Thin wrappers over ``replay.*``: they find (or start) the run's NATS server
(``server_for``), read what they need, stop the server, then compute. Reading, replaying,
exporting and importing show their progress on stderr (``roles.cli.progress``). Exit
codes: 0 = reproduced / done, 1 = a difference was found, 2 = cannot replay (bad
arguments, missing data). Registered by ``roles.cli`` (``replay_app`` as a group, the
rest as commands). ``rlbus trace`` is ``roles/cli/trace.py``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from roles.cli.common import run_async, run_option, run_paths, server_for

replay_app = typer.Typer(
    help="Replay a recorded run's pure roles (trainer, algorithms, rubric, orchestrator) and diff.",
    no_args_is_help=True,
)
URL = typer.Option(None, "--nats-url", help="NATS URL (default: the run's embedded server).")


def _console() -> Any:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


async def _connect(url: str, run: str, producer: str = "replay") -> Any:
    from bus.runtime import Bus

    return await Bus.connect(url, run=run, producer=producer)


@replay_app.callback()
def _replay(
    ctx: typer.Context, run: str | None = run_option(None), nats_url: str | None = URL
) -> None:
    # Optional here, so that `rlbus replay trainer --help` works; each command asks (_run).
    ctx.obj = {"run": run, "nats_url": nats_url}


def _run(ctx: typer.Context) -> str:
    """The run the replay is of: ``rlbus replay --run R trainer`` (or ``replay R trainer``)."""
    from roles.cli.common import fail

    run: str | None = ctx.obj["run"]
    if run is None:
        fail(f"rlbus replay {ctx.info_name}: which run? --run RUN")
    return run


@contextlib.contextmanager
def fork_server(run: str, nats_url: str | None) -> Iterator[str]:
    """Where a fork is written: the given server, else the new run's own embedded one."""
    from bus.server import reachable_server

    with reachable_server(
        run_paths(run).nats, nats_url, start="always", identity="launcher"
    ) as url:
        assert url is not None
        yield url


@replay_app.command("trainer")
def trainer(
    ctx: typer.Context,
    overrides: list[str] = typer.Argument(None, help="Fork config overrides: trainer.lr=0.01"),
    until: int | None = typer.Option(None, "--until", help="Stop after this step."),
    fork: str | None = typer.Option(None, "--fork", help="Write a fork as this new run."),
    from_step: int | None = typer.Option(None, "--from", help="Fork: last step replayed exactly."),
) -> None:
    """Re-train the recorded batches on CPU; every step's metrics and digest must match."""
    from replay.diff import print_verdict, step_printer
    from replay.trainer import ReplayError, publish_fork, replay_run, run_fork
    from roles.cli.progress import progress

    run, nats_url, console = _run(ctx), ctx.obj["nats_url"], _console()
    if (fork is None) != (from_step is None) or (overrides and fork is None):
        raise typer.BadParameter("--fork NEW and --from STEP go together (overrides need them)")
    try:
        log, model_dir = _load_trainer(run, nats_url)
        if not log.batches:
            raise ReplayError(f"run {run} has no batches")
    except ReplayError as e:
        console.print(f"[red]cannot replay:[/] {e}")
        raise typer.Exit(2) from None
    console.print(f"replaying {len(log.batches)} batches of {run} on CPU from {model_dir}")
    on_step = step_printer(console, log.recorded)
    if fork is None:
        with progress(f"replay {run} trainer", unit="steps") as update:
            r = replay_run(log, model_dir, until, on_step, update)
        raise typer.Exit(print_verdict(console, r.steps, r.divergence, r.stopped, r.wall_s))
    assert from_step is not None
    on_fork = step_printer(console, log.recorded, fork=True)
    with progress(f"replay {run} trainer, fork {fork}", unit="steps") as update:
        forked = run_fork(log, model_dir, from_step, overrides or [], until, on_step, on_fork, update)  # fmt: skip
    if not forked.prefix.ok:
        print_verdict(console, forked.prefix.steps, forked.prefix.divergence)
        console.print("[red]not forking:[/] the exact prefix does not reproduce")
        raise typer.Exit(1)
    weights = sorted(model_dir.glob("*.safetensors"))
    initial = weights[0].read_bytes() if len(weights) == 1 else None

    async def publish(url: str) -> int:
        bus = await _connect(url, fork)
        try:
            return await publish_fork(bus, log, forked, from_step, overrides or [], model_dir, initial)  # fmt: skip
        finally:
            await bus.close()

    try:
        with fork_server(fork, nats_url) as url:
            n = run_async(publish(url))
    except ReplayError as e:
        console.print(f"[red]cannot write the fork:[/] {e}")
        raise typer.Exit(2) from None
    from configs import dump_toml

    run_paths(fork).dir.mkdir(parents=True, exist_ok=True)
    run_paths(fork).config.write_text(dump_toml(forked.config.model_copy(update={"run": fork})))  # fmt: skip
    console.print(f"fork {fork}: {n} events written; {len(forked.fork.steps)} steps after step {from_step} under {list(overrides or [])}")  # fmt: skip
    first, loss = forked.first_difference, forked.first_loss_difference
    if first is None:
        console.print(f"the fork never differs from {run}: no override took effect")
    else:
        console.print(f"first differing step: {first[0].step} ({', '.join(m.name for m in first)})")
        for m in first:
            console.print("  " + m.describe())
    if loss is not None:
        console.print(f"loss first diverges at step {loss[0].step}: {loss[0].describe()}")


def _reading(run: str) -> Any:
    """The progress of reading ``run``'s log (stderr)."""
    from roles.cli.progress import progress

    return progress(f"read {run}", unit="events")


def _load_trainer(run: str, nats_url: str | None) -> Any:
    """(TrainerLog, model dir) of ``run``; the server is stopped before training starts."""
    from replay.portable import PortableError, locate_model_dir
    from replay.trainer import ReplayError, read_trainer_log

    async def load(url: str, update: Any) -> Any:
        bus = await _connect(url, run)
        try:
            log = await read_trainer_log(bus, update)
            return log, await locate_model_dir(bus, log.started, log.config(), run_paths(run).dir)
        except PortableError as e:
            raise ReplayError(str(e)) from e
        finally:
            await bus.close()

    with server_for(run, nats_url, existing=True) as url, _reading(run) as update:
        return run_async(load(url, update))


@replay_app.command("algorithm")
def algorithm(ctx: typer.Context, name: str = typer.Argument(..., help="Algorithm id (config id or registered name).")) -> None:  # fmt: skip
    """Recompute scored samples from the recorded traces; diff (recorded) or shadow table."""
    from replay.algorithm import (
        diff_scored,
        read_algorithm_log,
        recompute,
        shadow_rows,
        write_shadow,
    )
    from roles.cli.progress import progress

    run, console = _run(ctx), _console()

    async def load(url: str, update: Any) -> Any:
        bus = await _connect(url, run)
        try:
            return await read_algorithm_log(bus, name, update)
        finally:
            await bus.close()

    with server_for(run, ctx.obj["nats_url"], existing=True) as url, _reading(run) as update:
        log = run_async(load(url, update))
    try:
        with progress(f"replay {run} algorithm {name}", unit="traces") as update:
            scored = run_async(recompute(name, log, on_progress=update))
    except ValueError as e:  # an unknown algorithm or bad options
        console.print(f"[red]cannot replay:[/] {e}")
        raise typer.Exit(2) from None
    if not log.recorded:
        path = write_shadow(run_paths(run).dir, name, shadow_rows(run, scored))
        n = sum(len(s.samples) for _, s in scored)
        console.print(f"{name} is not recorded in {run}: shadow table with {len(scored)} groups, {n} samples: {path}")  # fmt: skip
        return
    d = diff_scored(log, scored)
    if d.unscored_tail:
        console.print(f"note: {d.unscored_tail} groups completed after the worker's last output (not scored before the run stopped)")  # fmt: skip
    for line in d.advantages.summary("advantages (per rollout/branch)"):
        console.print(line)
    for item in (d.groups + d.arrays)[:10]:
        console.print(f"  [red]differs[/] {item}")
    if d.ok:
        console.print(f"[green bold]MATCH[/] {name}: {d.groups_compared} groups, every advantage exactly equal")  # fmt: skip
        return
    console.print(f"[red bold]MISMATCH[/] {name}: {len(d.advantages.changed)} advantages, {len(d.arrays)} arrays, {len(d.groups)} groups differ")  # fmt: skip
    raise typer.Exit(1)


@replay_app.command("rubric")
def rubric(
    ctx: typer.Context,
    env: str | None = typer.Option(None, "--env", help="Only this env key."),
    no_eval: bool = typer.Option(False, "--no-eval", help="Skip eval traces."),
) -> None:
    """Re-score recorded traces with the current reward functions; diff the rewards."""
    from replay.rubric import read_rubric_log, rescore
    from roles.cli.progress import progress

    run, console = _run(ctx), _console()

    async def load(url: str, update: Any) -> Any:
        bus = await _connect(url, run)
        try:
            return await read_rubric_log(bus, env, evals=not no_eval, on_progress=update)
        finally:
            await bus.close()

    with server_for(run, ctx.obj["nats_url"], existing=True) as url, _reading(run) as update:
        log = run_async(load(url, update))
    with progress(f"replay {run} rubric", unit="traces") as update:
        result = rescore(log, update)
    grouped = f", {result.groups} groups scored together" if result.groups else ""
    console.print(f"{result.scored} traces rescored ({result.errored} errored traces skipped{grouped}), {len(result.changed_traces)} changed")  # fmt: skip
    for line in result.diff.summary("rewards"):
        console.print(line)
    for f in result.failures[:5]:
        console.print(f"  [red]rubric raised[/] {f}")
    if len(result.failures) > 5:
        console.print(f"  ... the rubric raised on {len(result.failures)} traces in all")
    if result.failures or not result.diff.ok:
        console.print(f"[red bold]MISMATCH[/] rubric: {len(result.changed_traces)} traces changed, {len(result.failures)} not rescored")  # fmt: skip
        raise typer.Exit(1)
    console.print(f"[green bold]MATCH[/] rubric: {result.scored} traces, every reward exactly equal")  # fmt: skip


@replay_app.command("orchestrator")
def orchestrator(ctx: typer.Context) -> None:
    """Re-make the orchestrator's decisions from the recorded log; diff them with the run's."""
    from replay.orchestrator import describe, diff_decisions, read_orchestrator_log, redecide
    from roles.cli.progress import progress

    run, console = _run(ctx), _console()

    async def load(url: str, update: Any) -> Any:
        bus = await _connect(url, run)
        try:
            return await read_orchestrator_log(bus, update)
        finally:
            await bus.close()

    try:
        with server_for(run, ctx.obj["nats_url"], existing=True) as url, _reading(run) as update:
            log = run_async(load(url, update))
    except ValueError as e:  # no run.started
        console.print(f"[red]cannot replay:[/] {e}")
        raise typer.Exit(2) from None
    with progress(f"replay {run} orchestrator", unit="inputs") as update:
        redone = redecide(log, update)
    d = diff_decisions(log, redone)
    console.print(f"{redone.inputs} inputs stepped: {sum(d.compared.values())} decisions compared ({describe(d.compared)}), {d.dead_letters} refusals dead-lettered alike")  # fmt: skip
    if d.tail:
        console.print(f"note: {d.tail} decisions or refusals past the last input the run's orchestrator acted on (it stopped before reading them)")  # fmt: skip
    for item in (d.changed + d.unrecorded + d.refusals)[:10]:
        console.print(f"  [red]differs[/] {item}")
    if d.ok:
        console.print(f"[green bold]MATCH[/] orchestrator: every decision of {run} re-made exactly")
        return
    console.print(f"[red bold]MISMATCH[/] orchestrator: {len(d.changed)} decisions changed, {len(d.unrecorded)} not on the log, {len(d.refusals)} refusals differ")  # fmt: skip
    raise typer.Exit(1)


def export(
    run: str = run_option(),
    file: Path = typer.Argument(..., help="Archive to write (.tar, or .tar.gz to compress)."),
    model: bool = typer.Option(True, "--model/--no-model", help="Include the initial model dir."),
    all_weights: bool = typer.Option(
        False,
        "--all-weights",
        help="Every stored weights version (default: the initial and newest, what replay needs).",
    ),
    nats_url: str | None = URL,
) -> None:
    """Write a run (log, what replay needs of its objects, config, initial model) to one
    portable file."""
    from replay.portable import export_run
    from roles.cli.progress import progress
    from roles.runtime.context import read_run_started

    async def main(url: str, update: Any) -> dict[str, Any]:
        bus = await _connect(url, run)
        try:
            model_dir = run_paths(run).initial_model
            started = await read_run_started(bus)
            if not model_dir.is_dir() and started is not None:
                model_dir = Path(started.model_path)
            return await export_run(
                bus, file, run_paths(run).dir, model_dir if model else None, all_weights, update
            )
        finally:
            await bus.close()

    with server_for(run, nats_url, existing=True) as url:
        with progress(f"export {run}", unit="events and objects") as update:
            manifest = run_async(main(url, update))
    size = file.stat().st_size
    typer.echo(f"exported {run}: {manifest['stream']['messages']} messages, {len(manifest['objects'])} objects, {len(manifest['model'])} model files -> {file} ({size / 1e6:.1f} MB)")  # fmt: skip


def import_run(
    file: Path = typer.Argument(..., help="Archive written by `rlbus export`."),
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="Root of run directories (default: $RLBUS_DATA_DIR or runs)."
    ),
    new_run: str | None = typer.Option(None, "--run", help="Import under this run id."),
    nats_url: str | None = URL,
) -> None:
    """Load an exported run: its stream, objects, config and model, verified by digest."""
    from bus.server import reachable_server
    from replay.portable import PortableError, read_archive
    from replay.portable import import_run as load
    from roles.cli.progress import progress

    try:
        manifest, members = read_archive(file)
    except PortableError as e:
        typer.echo(f"import failed: {e}", err=True)
        raise typer.Exit(2) from None
    run = new_run or manifest["run"]
    paths = run_paths(run, data_dir)

    async def main(url: str, update: Any) -> dict[str, Any]:
        bus = await _connect(url, run, producer="")  # a renamed event keeps its producer
        try:
            return await load(file, bus, paths.dir, manifest, members, update)
        finally:
            await bus.close()

    try:
        with reachable_server(paths.nats, nats_url, start="always", identity="launcher") as url:
            assert url is not None
            with progress(f"import {run}", unit="events and objects") as update:
                summary = run_async(main(url, update))
    except PortableError as e:
        typer.echo(f"import failed: {e}", err=True)
        raise typer.Exit(2) from None
    seq_map = summary.pop("seq_map")
    paths.import_record.write_text(json.dumps({**summary, "archive": str(file), "seq_map": seq_map}))  # fmt: skip
    typer.echo(f"imported {summary['from_run']} as {run}: {summary['messages']} messages, {summary['objects']} objects, {summary['model_files']} model files into {paths.dir}")  # fmt: skip


def plot(
    run: str = run_option(),
    out: Path | None = typer.Option(None, "--out", help="PNG to write (default <run>/plot.png)."),
    nats_url: str | None = URL,
) -> None:
    """Reward, eval, loss, staleness and throughput curves of a run in one PNG."""
    from replay.plots import plot_run, read_curves

    async def main(url: str) -> Any:
        bus = await _connect(url, run)
        try:
            return await read_curves(bus)
        finally:
            await bus.close()

    with server_for(run, nats_url, existing=True) as url:
        curves = run_async(main(url))
    path = plot_run(curves, out or run_paths(run).plot)
    if path is None:
        typer.echo(f"run {run} has no metrics yet: nothing to plot", err=True)
        raise typer.Exit(2)
    typer.echo(f"wrote {path}")
