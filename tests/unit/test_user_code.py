"""User code by name (``roles.lib.plugins``) and the import path role processes get
(``roles.up.processes``): found from the working directory, never hiding rlbus."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
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


def test_a_role_process_imports_rlbus_not_the_users_folders_of_the_same_name(
    tmp_path: Path,
) -> None:
    """A role process starts as the launcher starts it (``PYTHON``, ``import_path_env``)
    in a working directory holding ``configs/`` (TOML files), ``schemas/``, ``bus/``,
    ``roles/`` and ``replay/``: it imports rlbus's packages, and the user's env by name.
    (Started with the working directory first on the path, a folder without
    ``__init__.py`` there is a namespace package that hides an editable install's.)"""
    work = user_dir(tmp_path)
    probe = textwrap.dedent(
        """
        import roles.cli, configs, schemas, bus, replay
        from configs import RunConfig
        from roles.lib.envs.registry import make_env
        print(make_env("my_env:make_env").name)
        print(configs.__file__)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | import_path_env()
    out = subprocess.run(
        [*PYTHON, "-c", probe], cwd=work, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    name, configs_file = out.stdout.split()
    assert name == "my-word-count"
    assert Path(configs_file).resolve().is_relative_to(REPO)
