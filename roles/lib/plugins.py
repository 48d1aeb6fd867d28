"""Finding user code by name: a built-in, or ``package.module:attribute`` by import path.

Environments and algorithms are both registered this way, so users add their own
without touching rlbus (``examples/word_count_env.py``, ``examples/my_algo.py``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any


def load_named(
    name: str, builtins: Mapping[str, Any], kind: str, example: str, error: type[Exception]
) -> Any:
    """``builtins[name]``, or the attribute an import path names; ``error`` otherwise.

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
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise error(f"{kind} {name!r}: cannot import module {module_name!r}: {e}") from e
    found = getattr(module, attr, None)
    if found is None:
        raise error(f"{kind} {name!r}: module {module_name!r} has no {attr!r}")
    return found
