"""Finding an algorithm by name: a built-in, or your own class by import path.

    create("grpo", {"std_normalize": True})
    create("my_pkg.algos:MyAlgo", {"beta": 0.1})

An unknown name is an ``UnknownAlgorithm`` error that lists the built-ins; bad options
are a ``ValueError`` naming the algorithm, so a worker with a bad config fails at start.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from roles.algorithm.base import CHANNELS, Algorithm
from roles.algorithm.builtin import GRPO, RLOO, SFT, MaxRL

BUILTINS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (GRPO, MaxRL, RLOO, SFT)}


class UnknownAlgorithm(ValueError):
    """No built-in has this name and it is not an importable ``module:Class``."""


def resolve(name: str) -> type[Algorithm]:
    """The class registered as ``name``, or imported from ``module.path:ClassName``."""
    if name in BUILTINS:
        return BUILTINS[name]
    if ":" not in name:
        raise UnknownAlgorithm(
            f"unknown algorithm {name!r}: built-ins are {sorted(BUILTINS)}; "
            "a custom algorithm is named by import path, e.g. 'my_pkg.algos:MyAlgo'"
        )
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UnknownAlgorithm(f"algorithm {name!r}: cannot import {module_name!r}: {e}") from e
    cls = getattr(module, attr, None)
    if cls is None:
        raise UnknownAlgorithm(f"algorithm {name!r}: module {module_name!r} has no {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise UnknownAlgorithm(
            f"algorithm {name!r} is not a subclass of roles.algorithm.base.Algorithm"
        )
    return cls


def create(name: str, options: Mapping[str, Any] | None = None) -> Algorithm:
    """An instance of algorithm ``name`` configured with ``options``."""
    cls = resolve(name)
    try:
        algorithm = cls(**dict(options or {}))
    except TypeError as e:
        raise ValueError(f"bad options {dict(options or {})} for algorithm {name!r}: {e}") from e
    if algorithm.channel not in CHANNELS:
        raise ValueError(
            f"algorithm {name!r} has channel {algorithm.channel!r}; expected one of {CHANNELS}"
        )
    return algorithm
