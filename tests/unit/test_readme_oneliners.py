"""The `rlbus up` one-liners of README.md and docs/*.md resolve as written.

A user copies these lines first; one that fails, or that silently resolves to another
config than its comment promises (issue 31: the elastic-pool line dropped the env's
filters), is the first thing they meet. Each README line runs through `rlbus up
--dry-run` in this process (the CLI's own option parsing, `configs.load_config`, the
preflight checks); a line whose config is an existing run's (`--resume`, `--fresh`) or
that needs what an earlier command on its line made (`a && rlbus up ...`) is parsed and
its config part loaded. The docs' lines name users' files and models (`-c my_run.toml`,
`model.path=/models/my-qwen3`), so only their config part is loaded, where its `-c` is a
preset. No server, no model built but the tokenizers the preflight checks build.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from configs import RunConfig, list_presets, load_config, resolve
from roles.cli import app

ROOT = Path(__file__).resolve().parents[2]
RUN_BOUND = ("resume", "fresh")  # the config is an existing run's, under runs/<run>/
POOL = "max_replicas="  # the README's elastic env pool one-liner


@dataclass(frozen=True)
class OneLiner:
    where: str  # file:line
    args: list[str]  # what follows `rlbus up`
    after_another: bool  # `a && rlbus up ...`: may need what `a` made


def one_liners(path: Path) -> Iterator[OneLiner]:
    """Every `rlbus up` command in the file's fenced code blocks (continuations joined)."""
    text = path.read_text(encoding="utf-8")
    for block in re.finditer(r"^ *```[^\n]*\n(.*?)^ *```", text, re.S | re.M):
        lines = iter(
            enumerate(block.group(1).splitlines(), text.count("\n", 0, block.start(1)) + 1)
        )
        for n, line in lines:
            while line.endswith("\\"):  # a continuation: the command goes on below
                line = line[:-1] + next(lines)[1]
            for i, part in enumerate(line.split("&&")):
                if part.strip().startswith("rlbus up"):
                    argv = shlex.split(part, comments=True)
                    yield OneLiner(f"{path.name}:{n}", argv[2:], after_another=i > 0)


README = list(one_liners(ROOT / "README.md"))
DOCS = [line for doc in sorted((ROOT / "docs").glob("*.md")) for line in one_liners(doc)]


def parsed(args: list[str]) -> dict[str, Any]:
    """`rlbus up`'s parameters for these arguments, parsed by the CLI itself."""
    up = typer.main.get_command(app).commands["up"]  # type: ignore[attr-defined]
    return dict(up.make_context("up", list(args)).params)


def config_part(args: list[str]) -> RunConfig:
    """What `rlbus up` loads for these arguments (roles/cli/core.py `up`), without the run."""
    params = parsed(args)
    overrides = list(params["overrides"] or [])
    if params["cluster"] is not None:
        overrides.append(f"bus.cluster={params['cluster']}")
    return load_config(params["config"], overrides)


def dry_run(args: list[str], data_dir: Path) -> RunConfig:
    """`rlbus up --dry-run <args>` as a user runs it: its printed config, loaded back."""
    result = CliRunner().invoke(
        app, ["up", "--dry-run", *args], env={"RLBUS_DATA_DIR": str(data_dir)}
    )
    assert result.exit_code == 0, result.output
    return resolve(tomllib.loads(result.stdout))


def test_the_readme_and_docs_have_the_lines_this_test_reads() -> None:
    """The extraction finds the lines (an empty list would pass every test below)."""
    assert len(README) >= 10 and sum(POOL in " ".join(x.args) for x in README) == 1
    assert len(DOCS) >= 5


@pytest.mark.parametrize("line", README, ids=[x.where for x in README])
def test_every_readme_one_liner_resolves(line: OneLiner, tmp_path: Path) -> None:
    """A README `rlbus up` line passes the dry run (its config part, where it needs a run)."""
    params = parsed(line.args)
    if line.after_another or any(params[flag] for flag in RUN_BOUND):
        config_part(line.args)
    else:
        dry_run(line.args, tmp_path)


@pytest.mark.parametrize("line", DOCS, ids=[x.where for x in DOCS])
def test_every_docs_one_liner_loads(line: OneLiner) -> None:
    """A docs `rlbus up` line's config loads (a line with a user's own `-c` file is parsed only)."""
    if parsed(line.args)["config"] in list_presets():
        config_part(line.args)


@pytest.mark.parametrize("preset", [None, "smoke"])
def test_the_elastic_pool_one_liner_keeps_the_presets_env(
    preset: str | None, tmp_path: Path
) -> None:
    """The pool line changes the env's pool and nothing else of it: the preset's filters
    and group_size stay (a list override merges entries by id, configs/loading.py)."""
    (line,) = (x for x in README if POOL in " ".join(x.args))
    args = line.args if preset is None else ["-c", preset, *line.args]
    (env,) = dry_run(args, tmp_path).orchestrator.train.env
    (own,) = load_config(preset).orchestrator.train.env
    assert (env.id, env.pool) == ("reverse-text", (1, 3))
    assert env.group_size == own.group_size
    assert env.filters == own.filters
    assert env.model_dump(exclude={"max_replicas"}) == own.model_dump(exclude={"max_replicas"})
    if preset is None:  # the default preset's env has filters to lose
        assert [f.type for f in env.filters] == ["gibberish", "repetition", "length"]
