"""The architecture's import rules ([tool.importlinter] in pyproject.toml) hold, and can fail.

``lint-imports`` runs in a subprocess (its graph builder and CLI stay out of the test
process) with ``--no-cache``, so nothing is written into the tree. The second test copies
the packages to a temporary directory, adds one forbidden import, and checks that the
linter names the broken contract and the import, which proves the contracts are live
(a typo in a module name, or a wildcard that matches nothing, would not catch it).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "bus", "configs", "roles", "replay")

# `python -m importlinter` does not exist; this is what the `lint-imports` script runs.
LINT = (
    "import sys; from importlinter.cli import lint_imports_command; "
    "sys.exit(lint_imports_command())"
)


def lint_imports(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", LINT, "--no-cache", "--no-logo", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def contract_names() -> list[str]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [c["name"] for c in config["tool"]["importlinter"]["contracts"]]


def test_the_repository_keeps_every_import_contract() -> None:
    result = lint_imports(REPO)
    report = result.stdout + result.stderr
    assert result.returncode == 0, f"lint-imports failed:\n{report}"
    names = contract_names()
    assert len(names) >= 8
    assert f"Contracts: {len(names)} kept, 0 broken." in report, report


@pytest.mark.parametrize(
    ("path", "line", "contract", "chain"),
    [
        # one role package importing another (independence)
        (
            "roles/orchestrator/state.py",
            "import roles.trainer.core",
            "No role package imports another role package",
            "roles.orchestrator.state -> roles.trainer.core",
        ),
        # the launcher machinery from anywhere but the CLI
        (
            "replay/sql.py",
            "from roles.up import launcher",
            "Only the CLI imports the launcher machinery",
            "replay.sql -> roles.up",
        ),
        # a role's process module from replay (matched by the `roles.*.role` wildcard)
        (
            "replay/trainer.py",
            "import roles.trainer.role",
            "replay uses the roles' pure cores, never a role's process code",
            "replay.trainer -> roles.trainer.role",
        ),
        # something heavy from configs
        (
            "configs/models.py",
            "import torch",
            "configs imports nothing heavy",
            "configs.models -> torch",
        ),
        # a library reaching up into a role
        (
            "roles/lib/plugins.py",
            "import roles.algorithm.samples",
            "roles.lib and roles.runtime import no role package",
            "roles.lib.plugins -> roles.algorithm.samples",
        ),
    ],
)
def test_a_forbidden_import_breaks_its_contract(
    tmp_path: Path, path: str, line: str, contract: str, chain: str
) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=ignore)
    shutil.copy2(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / path
    target.write_text(target.read_text() + f"\n{line}  # deliberately wrong\n")

    result = lint_imports(tmp_path)
    report = result.stdout + result.stderr

    assert result.returncode != 0, report
    broken = report.split("Broken contracts", 1)[-1]
    assert contract in broken, report
    assert chain in broken, report
