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
        # the NATS client outside bus
        (
            "roles/orchestrator/state.py",
            "import nats.errors",
            "Only bus imports the NATS client",
            "roles.orchestrator.state -> nats",
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


def reach_ins(source: str) -> list[tuple[int, str]]:
    """(line, text) of each ``<x>.bus.js``/``.nc`` or ``bus.js``/``.nc`` in ``source``:
    code reaching through a Bus into the NATS client."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in ("js", "nc"):
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if name == "bus":
                found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_module_outside_bus_reaches_into_the_nats_client() -> None:
    """Imports are the contract's; attribute access is this test's: a ``Bus``'s ``js``
    and ``nc`` are the client, for ``bus`` alone (``Bus`` has a method for each need)."""
    assert reach_ins("async def f(self, bus):\n    await bus.js.stream_info(s)\n"
                     "    await self.bus.nc.flush()\n") == [
        (2, "bus.js"), (3, "self.bus.nc")]  # fmt: skip
    offenders = {
        str(path.relative_to(REPO)): hits
        for package in ("schemas", "configs", "roles", "replay")
        for path in sorted((REPO / package).rglob("*.py"))
        if (hits := reach_ins(path.read_text()))
    }
    assert offenders == {}
