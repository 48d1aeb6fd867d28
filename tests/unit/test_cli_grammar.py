"""The CLI's grammar: the run id spelled the same way in every command (``--run R``, or the
first positional), prime-rl's config spellings, help text that keeps every word, and log
lines that are JSON only for machines (issue 31, items 7, 8 and 11)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import structlog
import typer
from typer.testing import CliRunner

from bus.log import configure, get_logger
from roles.cli import app, prime_rl_argv
from roles.cli.common import (
    RunCommand,
    RunConflict,
    RunGroup,
    accept_positional_run,
    run_in_args,
    run_option,
)
from roles.cli.core import run_state_line
from roles.up.launcher import log_as_json
from schemas import RunStopped

runner = CliRunner()


# --- the run id: run_in_args, pure ----------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["R", "--limit", "3"],
        ["--run", "R", "--limit", "3"],
        ["--limit", "3", "-r", "R"],
        ["--run=R", "--limit", "3"],
        ["-rR", "--limit", "3"],
        ["R", "--run", "R", "--limit", "3"],  # the same id twice is one
    ],
)
def test_every_spelling_of_the_run_becomes_one_run_option(args: list[str]) -> None:
    """``rlbus events R`` and ``rlbus events --run R`` (and -r, --run=) parse the same."""
    assert run_in_args(args, valued={"--limit"}, slots=0) == ["--run", "R", "--limit", "3"]


def test_an_option_value_is_not_taken_for_the_run() -> None:
    """``--topic trace.completed`` is an option's value, not a positional run id."""
    args = ["--topic", "trace.completed", "--follow"]
    assert run_in_args(args, valued={"--topic"}, slots=0) == args


def test_the_first_positional_is_the_run_only_when_there_is_one_too_many() -> None:
    """``export R f.tar`` (one argument slot: the file) vs ``export f.tar --run R``; the
    query of ``sql`` stays a query; ``up``'s overrides (variadic) are never a run."""
    assert run_in_args(["R", "f.tar"], slots=1) == ["--run", "R", "f.tar"]
    assert run_in_args(["f.tar", "--run", "R"], slots=1) == ["--run", "R", "f.tar"]
    assert run_in_args(["select 1"], slots=1) == ["select 1"]
    assert run_in_args(["a=1", "b=2"], slots=math.inf) == ["a=1", "b=2"]


def test_two_different_runs_are_refused() -> None:
    with pytest.raises(RunConflict, match="'R1' and 'R2'"):
        run_in_args(["R1", "--run", "R2"], slots=0)
    with pytest.raises(RunConflict):
        run_in_args(["--run", "R1", "-r", "R2"], slots=0)


def test_a_group_takes_the_run_before_or_after_its_subcommand() -> None:
    """``rlbus replay R trainer`` and ``rlbus replay trainer --run R``; the subcommand's
    own positionals (fork overrides) stay where they are."""
    subs = {"trainer", "rubric"}
    want = ["--run", "R", "trainer", "--until", "3", "a=1"]
    assert run_in_args(["R", "trainer", "--until", "3", "a=1"], subcommands=subs) == want
    assert run_in_args(["trainer", "--until", "3", "a=1", "--run", "R"], subcommands=subs) == want
    assert run_in_args(["trainer", "a=1"], subcommands=subs) == ["trainer", "a=1"]


def test_a_literal_after_double_dash_is_a_positional() -> None:
    assert run_in_args(["--", "-x"], slots=1) == ["--", "-x"]


# --- the run id through typer ---------------------------------------------------------


def _toy() -> typer.Typer:
    toy = typer.Typer()

    @toy.command("show")
    def show(
        file: str = typer.Argument(...),
        run: str = run_option(),
        n: int = typer.Option(1, "-n"),
    ) -> None:
        typer.echo(f"run={run} file={file} n={n}")

    sub = typer.Typer()

    @sub.callback()
    def group(ctx: typer.Context, run: str = run_option()) -> None:
        ctx.obj = run

    @sub.command("go")
    def go(ctx: typer.Context, x: str = typer.Argument("-")) -> None:
        typer.echo(f"run={ctx.obj} x={x}")

    toy.add_typer(sub, name="grp")
    accept_positional_run(toy)
    return toy


@pytest.mark.parametrize(
    "argv",
    [
        ["show", "R", "f.tar", "-n", "2"],
        ["show", "f.tar", "--run", "R", "-n", "2"],
        ["show", "-n", "2", "-r", "R", "f.tar"],
    ],
)
def test_a_command_reads_the_run_either_way(argv: list[str]) -> None:
    r = runner.invoke(_toy(), argv)
    assert r.exit_code == 0, r.output
    assert r.output.strip() == "run=R file=f.tar n=2"


@pytest.mark.parametrize(
    "argv",
    [["grp", "R", "go", "y"], ["grp", "--run", "R", "go", "y"], ["grp", "go", "y", "-r", "R"]],
)
def test_a_group_reads_the_run_either_way(argv: list[str]) -> None:
    r = runner.invoke(_toy(), argv)
    assert r.exit_code == 0, r.output
    assert r.output.strip() == "run=R x=y"


@pytest.mark.parametrize(
    "argv",
    [
        ["events", "R1", "--run", "R2"],
        ["status", "R1", "-r", "R2"],
        ["trace", "R1", "abc", "--run=R2"],
        ["replay", "R1", "trainer", "--run", "R2"],
        ["algorithm", "list", "R1", "--run", "R2"],
        ["role", "env", "R1", "--run", "R2"],
    ],
)
def test_rlbus_refuses_two_runs_in_one_line(argv: list[str]) -> None:
    """Caught before any server is looked for: a usage error naming both ids."""
    r = runner.invoke(app, argv)
    assert r.exit_code == 2
    assert "two run ids, 'R1' and 'R2'" in r.output


def _commands(group: typer.core.TyperGroup, path: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    for name, cmd in group.commands.items():
        yield (*path, name), cmd
        if isinstance(cmd, typer.core.TyperGroup):
            yield from _commands(cmd, (*path, name))


def test_every_command_that_takes_a_run_spells_it_run_r() -> None:
    """One grammar: each command with a run id has ``--run``/``-r`` and accepts the
    positional spelling (no command left with the run as an argument)."""
    root = typer.main.get_command(app)
    seen = []
    for path, cmd in _commands(root):  # type: ignore[arg-type]
        for p in cmd.params:
            if p.name == "run":
                assert isinstance(p, typer.core.TyperOption), path
                assert {"--run", "-r"} <= set(p.opts), path
                assert isinstance(cmd, (RunCommand, RunGroup)), path
                seen.append(path[-1])
    assert {"events", "status", "trace", "export", "plot", "monitor", "sql", "up"} <= set(seen)
    assert {"replay", "attach", "detach", "list", "env", "eval"} <= set(seen)


# --- prime-rl's spellings ------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["up", "@", "my.toml"], ["up", "-c", "my.toml"]),
        (["up", "@my.toml", "--no-view"], ["up", "-c", "my.toml", "--no-view"]),
        (["up", "--trainer.lr", "1e-4"], ["up", "trainer.lr=1e-4"]),
        (["up", "--trainer.lr=1e-4", "x.y=2"], ["up", "trainer.lr=1e-4", "x.y=2"]),
        (["up", "--orchestrator.max-off-policy-steps", "2"], ["up", "orchestrator.max_off_policy_steps=2"]),
        (["up", "--trainer.lr", "-1"], ["up", "trainer.lr=-1"]),
        (["up", "-c", "smoke", "--run", "R", "--config-x"], ["up", "-c", "smoke", "--run", "R", "--config-x"]),
        (["eval", "@", "f.toml", "--json"], ["eval", "-c", "f.toml", "--json"]),
        (["events", "--trainer.lr", "1"], ["events", "--trainer.lr", "1"]),  # not a config command
    ],
)  # fmt: skip
def test_prime_rl_spellings_become_rlbus_ones(argv: list[str], want: list[str]) -> None:
    assert prime_rl_argv(argv) == want


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["up", "--trainer.lr"], "trainer.lr=VALUE"),
        (["up", "--model.trust", "--no-view"], "model.trust=VALUE"),
        (["up", "-c", "smoke", "@", "my.toml"], "one config at a time"),
        (["up", "@"], "@ needs a config file"),
    ],
)
def test_a_prime_rl_spelling_that_cannot_translate_says_the_rlbus_one(
    argv: list[str], says: str
) -> None:
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        prime_rl_argv(argv)


def test_up_with_a_bare_word_says_the_run_is_an_option() -> None:
    """``rlbus up my-run``: the run id is --run, in one line, before any config loads."""
    r = runner.invoke(app, ["up", "my-run", "--dry-run"])
    assert r.exit_code == 2
    assert "a run id is --run my-run" in r.output


def test_a_missing_config_file_names_the_presets(tmp_path: Path) -> None:
    r = runner.invoke(app, ["up", "-c", str(tmp_path / "nope.toml"), "--dry-run"])
    assert r.exit_code == 2
    assert "not a preset: " in r.output and "smoke" in r.output


# --- help keeps every word -----------------------------------------------------------


def test_help_keeps_every_word_of_every_help_text() -> None:
    """``[gateway]``, ``[monitor]`` (config sections) and ``<run>`` survive ``--help`` in
    every command: no markup eats them. Click only rewraps, so each help text appears in
    the output once whitespace is set aside."""
    root = typer.main.get_command(app)
    for path, cmd in _commands(root):  # type: ignore[arg-type]
        r = runner.invoke(app, [*path, "--help"], terminal_width=200)
        assert r.exit_code == 0, (path, r.output)
        flat = "".join(r.output.split())
        texts = [cmd.help or ""] + [getattr(p, "help", None) or "" for p in cmd.params]
        for text in texts:
            body = text.split("\f")[0]
            assert "".join(body.split()) in flat, (path, body)


# --- log lines: plain for a person, JSON for a machine -------------------------------


@pytest.mark.parametrize(
    ("live_view", "json_lines", "tty", "want"),
    [
        (True, False, True, False),  # the live view on a terminal
        (False, False, True, False),  # --no-view on a terminal: plain lines
        (True, False, False, False),  # `just up` piped, no --no-view: a person still reads
        (False, False, False, True),  # --no-view on a pipe: machine lines (the e2e tests)
        (True, True, True, True),  # --json
    ],
)
def test_the_launcher_writes_json_only_for_machines(
    live_view: bool, json_lines: bool, tty: bool, want: bool
) -> None:
    assert log_as_json(live_view, json_lines, tty) is want


def test_plain_lines_on_stderr_json_in_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The launcher on a terminal: a plain ``run.failed`` line a person reads; the JSON
    line (and the INFO lines the terminal hides) in ``logs/launcher.log``."""
    file = tmp_path / "logs" / "launcher.log"
    try:
        configure(json=False, level="WARNING", json_file=file, run="r1", role="launcher")
        log = get_logger()
        log.info("role.started", name="trainer", pid=7)
        log.error("run.failed", reason="trainer died 6 times")
        err = capsys.readouterr().err
    finally:
        structlog.contextvars.clear_contextvars()
        configure(json=True, level="WARNING")  # as tests/conftest.py has it
    assert "run.failed" in err and "trainer died 6 times" in err
    assert "role.started" not in err  # below the terminal's level
    assert not any(line.lstrip().startswith("{") for line in err.splitlines())
    records = [json.loads(line) for line in file.read_text().splitlines()]
    assert [r["event"] for r in records] == ["role.started", "run.failed"]
    assert records[0]["pid"] == 7 and records[1]["run"] == "r1"


# --- rlbus status's first line -------------------------------------------------------


def test_status_says_finished_failed_running_or_interrupted() -> None:
    done = RunStopped(run="r", reason="max_steps", step=500, detail="trained 500 steps")
    failed = RunStopped(run="r", reason="no_learning_signal", step=40)
    assert run_state_line("r", done, 500, "rl", 0, 500) == (
        "run r finished (max_steps: trained 500 steps) at step 500/500, RL"
    )
    assert run_state_line("r", failed, 40, "rl", 0, 500).startswith(
        "run r failed (no_learning_signal) at step 40/500"
    )
    assert run_state_line("r", None, 12, "sft", 7, 500) == (
        "run r running: step 12/500, warm start (sft)"
    )
    assert run_state_line("r", None, None, None, 3, 500) == "run r running: starting (no step yet)"
    assert "not running" in run_state_line("r", None, 12, "rl", 0, 500)
    assert "--run r --resume" in run_state_line("r", None, 12, "rl", 0, 500)
