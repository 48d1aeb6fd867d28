"""Finding user code by name: a built-in, ``package.module:attribute`` by import path, or
``path/to/file.py:attribute`` by file.

Environments, algorithms and filters are all registered this way, so users add their own
without touching rlbus (``examples/word_count_env.py``, ``examples/my_algo.py``).

Where user code is found: the working directory is on the import path, after rlbus's
own packages and everything installed (``user_import_path``), so a user's folder named
like one of rlbus's packages (prime-rl keeps its TOML files in ``configs/``) cannot hide
it, and ``my_env:make_env`` or ``examples.word_count_env:make_env`` resolve from where
``rlbus`` was started, in the launcher and in every role process (which run with the
launcher's working directory and never put it first: ``roles.up.processes``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any


def user_import_path() -> None:
    """Put the working directory on the import path, last (see the module docstring).

    A folder without ``__init__.py`` anywhere on the path is a namespace package, which
    wins over an editable install's finder even from the end of the path: rlbus's own
    top-level packages must be imported before (``roles.cli.prepare_imports`` does, first
    thing in every ``rlbus`` process); once imported, their modules are found inside
    them, never on the path again.
    """
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.append(cwd)


def _import(module_name: str) -> ModuleType:
    """The module an import path or a ``.py`` file (relative to the working directory)
    names; a file's module is registered under its stem, so it imports once."""
    if not module_name.endswith(".py"):
        user_import_path()
        return importlib.import_module(module_name)
    path = Path(module_name).resolve()
    if not path.is_file():
        raise ImportError(f"no file {str(path)!r}")
    name = path.stem
    known = sys.modules.get(name)
    if known is not None and Path(getattr(known, "__file__", "") or "").resolve() == path:
        return known
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_named(
    name: str, builtins: Mapping[str, Any], kind: str, example: str, error: type[Exception]
) -> Any:
    """``builtins[name]``, or the attribute an import path or file names; ``error`` otherwise.

    ``kind`` ("env", "algorithm") and ``example`` (an import path) word the messages.
    """
    if name in builtins:
        return builtins[name]
    if ":" not in name:
        raise error(
            f"unknown {kind} {name!r}: built-ins are {', '.join(sorted(builtins))}; "
            f"or give an import path, e.g. {example!r}"
        )
    module_name, _, attr = name.partition(":")
    try:
        module = _import(module_name)
    except ImportError as e:
        raise error(f"{kind} {name!r}: cannot import module {module_name!r}: {e}") from e
    found = getattr(module, attr, None)
    if found is None:
        raise error(f"{kind} {name!r}: module {module_name!r} has no {attr!r}")
    return found
