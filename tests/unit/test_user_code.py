"""User code by name (``roles.lib.plugins``) and the import path role processes get
(``roles.up.processes``): found from the working directory, never hiding rlbus."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from roles.lib.envs.registry import UnknownEnv, make_env
from roles.up.processes import PYTHON, import_path_env
from tests.samples import user_dir

REPO = Path(__file__).resolve().parents[2]
WORD_COUNT = (REPO / "examples" / "word_count_env.py").read_text()


def test_user_env_by_module_name_and_by_file_from_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``my_env:make_env`` and ``my_env.py:make_env`` (and a path to a file) load the user's
    env from where rlbus was started, with the working directory not on the import path."""
    work = user_dir(tmp_path)
    (work / "envs").mkdir()
    (work / "envs" / "counting.py").write_text(WORD_COUNT.replace("word-count", "counting"))
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(work))])
    monkeypatch.delitem(sys.modules, "my_env", raising=False)
    monkeypatch.delitem(sys.modules, "counting", raising=False)
    assert make_env("my_env:make_env", {"max_words": 3}).name == "my-word-count"
    assert sys.path[-1] == str(work)  # found last: rlbus's packages come first
    assert make_env("my_env.py:make_env").name == "my-word-count"
    assert make_env("envs/counting.py:make_env").name == "counting"
    with pytest.raises(UnknownEnv, match="cannot import module 'nowhere.py'.*no file"):
        make_env("nowhere.py:make_env")


PROBE = """
import sys
from roles.cli import prepare_imports
prepare_imports()  # what `rlbus` does first (roles.cli.main)
from configs import RunConfig  # rlbus's packages, imported after it
import schemas, bus, replay
from roles.lib.envs.registry import make_env
print(make_env("my_env:make_env").name, sys.modules["configs"].__file__, RunConfig.__name__)
"""


def probe(work: Path, env: dict[str, str]) -> list[str]:
    """Run ``PROBE`` as rlbus starts Python (``PYTHON``: the working directory not first)."""
    out = subprocess.run(
        [*PYTHON, "-c", PROBE], cwd=work, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.split()


@pytest.mark.parametrize("process", ["launcher", "role"])
def test_rlbus_imports_its_own_packages_not_the_users_folders_of_the_same_name(
    tmp_path: Path, process: str
) -> None:
    """In a working directory holding ``configs/`` (TOML files), ``schemas/``, ``bus/``,
    ``roles/`` and ``replay/``: the launcher (``rlbus``, as installed) and a role process
    (as the launcher starts it: ``PYTHON`` and ``import_path_env``) import rlbus's
    packages, also after the working directory is on the path, and the user's env by
    name. (A folder without ``__init__.py`` there is a namespace package that hid an
    editable install's package, from the front of the path or from its end.)"""
    work = user_dir(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if process == "role":
        env |= import_path_env()
    elif (
        importlib.util.find_spec("roles") is None
        or subprocess.run(
            [*PYTHON, "-c", "import roles"], cwd=tmp_path, env=env, capture_output=True
        ).returncode
    ):
        pytest.skip("rlbus is not installed here (only importable from its checkout)")
    name, configs_file, config_class = probe(work, env)
    assert (name, config_class) == ("my-word-count", "RunConfig")
    assert Path(configs_file).resolve().is_relative_to(REPO)
