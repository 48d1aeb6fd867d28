"""The docs stay true to the code: the topology table, the quickstart, every config key, and
every package docstring's list of its modules."""

from __future__ import annotations

from pathlib import Path

from bus.subjects import topology

ROOT = Path(__file__).resolve().parents[2]


def test_readme_topology_table_matches_the_registry() -> None:
    """Every topic row printed by `rlbus topology` appears verbatim in the README."""
    readme = ROOT.joinpath("README.md").read_text()
    for subject, schema, producer, consumers in topology():
        assert f"| `{subject}` | {schema} | {producer} | {consumers} |" in readme, subject


def test_quickstart_is_two_commands() -> None:
    """The README quickstart is exactly two commands: install+up, and the tests."""
    readme = ROOT.joinpath("README.md").read_text()
    block = readme.split("## Quickstart", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    commands = [line for line in block.strip().splitlines() if line.strip()]
    assert len(commands) == 2
    assert "just up" in commands[0] and commands[1].startswith("just test")


def _leaves(d: dict, prefix: str = ""):  # type: ignore[no-untyped-def]
    for k, v in d.items():
        path = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v and k not in ("args", "options"):
            yield from _leaves(v, path)
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            yield from _leaves(v[0], path + "[]")
        else:
            yield path


def test_every_default_config_key_is_documented() -> None:
    """docs/configuration.md lists every key of the default preset."""
    from configs import load_config

    doc = ROOT.joinpath("docs", "configuration.md").read_text()
    missing = [
        k for k in _leaves(load_config("default").model_dump(mode="json")) if f"`{k}`" not in doc
    ]
    assert missing == []


def test_every_package_docstring_names_each_of_its_modules() -> None:
    """A newcomer reads a package's docstring to find their way: it names every module
    and subpackage there is (``name``), so a module added without a word fails here."""
    import ast
    import re

    missing = {}
    inits = [i for p in ("bus", "schemas", "configs", "replay", "roles") for i in (ROOT / p).rglob("__init__.py")]  # fmt: skip
    for init in sorted(inits):
        package = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        modules = {p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
        modules |= {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}
        absent = [m for m in sorted(modules) if not re.search(rf"`{re.escape(m)}`", doc)]
        if absent:
            missing[str(package.relative_to(ROOT))] = absent
    assert not missing, missing
