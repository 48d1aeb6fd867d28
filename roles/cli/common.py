"""Shared CLI plumbing: the run id's grammar (``RUN``, ``RunCommand``), finding (or
starting) the run's NATS server, running coroutines, and failing in one line (``fail``;
an unknown run: ``no_run``, ``require_run``).

The run id has one documented spelling, ``--run R`` (``-r R``), in every command that
names a run; the id as the command's first positional (``rlbus events R``, ``rlbus
status R``, ``rlbus replay R trainer``) is accepted too, wherever the command's own
positionals leave room for it (not ``up`` or ``eval``, whose positionals are overrides).
``RunCommand``/``RunGroup`` rewrite the positional spelling into ``--run R`` before click
parses (``run_in_args``); ``accept_positional_run`` gives every command of the app that
grammar."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import Collection, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

if TYPE_CHECKING:
    from configs.paths import RunPaths


RUN_FLAGS = ("--run", "-r")


def run_option(default: Any = ..., help: str = "Run id.") -> Any:
    """The run id's option, ``--run``/``-r`` (a command's ``run`` parameter): the one
    documented spelling (the first positional is accepted too: ``RunCommand``)."""
    return typer.Option(default, *RUN_FLAGS, help=help)


class RunConflict(ValueError):
    """The run id given twice, two different ways."""


def run_in_args(
    args: list[str],
    valued: Collection[str] = (),
    slots: float = 0,
    subcommands: Collection[str] = (),
) -> list[str]:
    """``args`` with the run id as ``--run R`` in front, however it was given: ``--run R``,
    ``--run=R``, ``-r R``, ``-rR``, or as the first positional when there is one more
    positional than the command takes (``slots``: its arguments' count, ``math.inf`` with
    a variadic one) or, for a group, when it is not one of its ``subcommands`` (there any
    ``--run`` after the subcommand's name moves in front of it too). ``valued``: the
    command's options that take a value (their values are not positionals). The same id
    given twice is one; two different ids are a ``RunConflict``. Pure: the tests call it."""
    given: list[str] = []
    rest: list[str] = []
    positionals: list[int] = []  # indexes into rest
    sub = False  # past a group's subcommand name: only --run is taken from there on
    literal = False  # after "--"
    i = 0
    while i < len(args):
        a = args[i]
        if literal:
            positionals.append(len(rest))
        elif a == "--":
            literal = True
        elif a in RUN_FLAGS and i + 1 < len(args):
            given.append(args[i + 1])
            i += 2
            continue
        elif a.startswith("--run="):
            given.append(a.removeprefix("--run="))
            i += 1
            continue
        elif a.startswith("-r") and len(a) > 2 and not a.startswith("--"):
            given.append(a[2:])
            i += 1
            continue
        elif sub:
            pass
        elif a in valued and i + 1 < len(args):
            rest += [a, args[i + 1]]
            i += 2
            continue
        elif not a.startswith("-") or a == "-":
            if a in subcommands:
                sub = True
            else:
                positionals.append(len(rest))
        rest.append(a)
        i += 1
    if positionals and (len(positionals) > slots or subcommands):
        given.append(rest.pop(positionals[0]))
    if not given:
        return args
    if len(ids := sorted(set(given))) > 1:
        raise RunConflict(f"two run ids, {' and '.join(map(repr, ids))}: give one, as --run RUN")
    return ["--run", ids[0], *rest]


def _takes_run(command: TyperCommand | TyperGroup) -> bool:
    return any(isinstance(p, TyperOption) and p.name == "run" and "--run" in p.opts for p in command.params)  # fmt: skip


def _valued(command: TyperCommand | TyperGroup) -> set[str]:
    return {
        o
        for p in command.params
        if isinstance(p, TyperOption) and not p.is_flag and not p.count
        for o in p.opts
    }


class RunCommand(TyperCommand):
    """A command whose ``--run`` may also be its first positional (``run_in_args``)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if _takes_run(self):
            nargs = [p.nargs for p in self.params if isinstance(p, TyperArgument)]
            slots = math.inf if any(n < 0 for n in nargs) else sum(nargs)
            try:
                args = run_in_args(args, _valued(self), slots)
            except RunConflict as e:
                ctx.fail(str(e))
        return super().parse_args(ctx, args)


class RunGroup(TyperGroup):
    """A group whose ``--run`` may also be the positional before its subcommand's name
    (``rlbus replay R trainer``), or follow that name (``rlbus replay trainer --run R``)."""

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        if _takes_run(self):
            try:
                args = run_in_args(args, _valued(self), 0, set(self.commands))
            except RunConflict as e:
                ctx.fail(str(e))
        return super().parse_args(ctx, args)


def accept_positional_run(app: typer.Typer) -> None:
    """Every command and group of ``app`` (and of its sub-apps) parses its run id with
    ``RunCommand``/``RunGroup``: a no-op where a command takes no ``--run``. Called once,
    after the commands are registered (``roles.cli``)."""
    for command in app.registered_commands:
        if command.cls in (None, TyperCommand):  # typer's default: no class of our own
            command.cls = RunCommand
    for group in app.registered_groups:
        sub = group.typer_instance
        if sub is not None:
            if not isinstance(sub.info.cls, type):  # unset (typer's default placeholder)
                sub.info.cls = RunGroup
            accept_positional_run(sub)


def wide_console() -> Any:
    """A rich console as wide as the terminal, or 160 columns when not one (rich's 80
    would cut a status table's instance names and pids)."""
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def run_paths(run: str, data_dir: str | Path | None = None) -> RunPaths:
    """``run``'s paths under ``data_dir`` (a ``--data-dir`` flag; resolved by
    ``configs.paths.resolve_data_dir``: the flag, else $RLBUS_DATA_DIR, else ``runs``)."""
    from configs.paths import RunPaths, resolve_data_dir

    return RunPaths(resolve_data_dir(data_dir), run)


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr and a non-zero exit: the cause, without a usage box or traceback."""
    typer.echo(message, err=True)
    raise typer.Exit(code)


def no_run(run: str, why: str, runs: list[str]) -> NoReturn:
    """Exit saying ``run`` does not exist, why we think so, and which runs do."""
    fail(f"no run {run!r} ({why}; runs here: {', '.join(runs) or 'none'})")


def local_runs(data_dir: str | Path | None = None) -> list[str]:
    """Runs with data under the data directory: a JetStream store or a lake."""
    from configs.paths import RunPaths, resolve_data_dir

    root = resolve_data_dir(data_dir)
    if not root.is_dir():
        return []
    found = [RunPaths(root, p.name) for p in root.iterdir() if p.is_dir()]
    return sorted(r.run for r in found if r.nats.is_dir() or r.lake.is_dir())


async def _stream_check(url: str, run: str) -> list[str] | None:
    """None if the server at ``url`` has ``run``'s stream, else the runs it has."""
    from bus.runtime import Bus

    bus = await Bus.connect(url, run=run, producer="cli")
    try:
        return None if await bus.has_stream() else await bus.runs()
    finally:
        await bus.close()


def require_run(url: str, run: str) -> None:
    """Exit in one line unless the server at ``url`` holds ``run``'s stream (``RL_<run>``):
    a read command on a typo must say so, not print an empty table or a traceback."""
    from bus.subjects import stream_name

    try:
        stream = stream_name(run)
    except ValueError as e:  # not a valid run id: it can have no stream
        fail(str(e))
    others = run_async(_stream_check(url, run))
    if others is not None:
        no_run(run, f"no stream {stream} on {url}", others)


@contextlib.contextmanager
def server_for(
    run: str | None,
    nats_url: str | None,
    data_dir: str | Path | None = None,
    *,
    existing: bool = False,
    identity: str = "reader",
) -> Iterator[str]:
    """The URL to use: --nats-url, $RLBUS_NATS_URL, the run's running embedded server, or
    a temporary embedded server started on the run's data (stopped afterwards).

    ``existing``: the command reads ``run``, so the run's stream must be on that server
    (``require_run``); a role attaching to a run that has not started yet passes False.
    ``identity``: the run's role kind the command connects as (``bus.auth``) when the
    run has credentials; the read commands are ``reader``."""
    from bus.server import reachable_server

    store = None if run is None else run_paths(run, data_dir).nats
    with reachable_server(store, nats_url, identity=identity) as url:
        if url is None:
            if run is None:
                raise typer.BadParameter("give --run or --nats-url")
            no_run(run, f"no NATS URL given and no run data at {store}", local_runs(data_dir))
        if existing and run is not None:
            require_run(url, run)
        yield url


def run_async(coro: Coroutine[Any, Any, Any]) -> Any:
    from bus.errors import ServerUnreachable

    try:
        return asyncio.run(coro)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except ServerUnreachable as e:  # a wrong --nats-url: one line, not a traceback
        fail(str(e), code=1)
