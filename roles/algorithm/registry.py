"""Finding an algorithm by name: a built-in, or your own class by import path.

    create("grpo", {"std_normalize": True})
    create("my_pkg.algos:MyAlgo", {"beta": 0.1})

An unknown name is an ``UnknownAlgorithm`` error that lists the built-ins; bad options
are a ``ValueError`` naming the algorithm, so a worker with a bad config fails at start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from roles.algorithm.base import CHANNELS, Algorithm
from roles.algorithm.builtin import GRPO, RLOO, SFT, MaxRL
from roles.algorithm.channels import OPD, OPSD, RAE, Echo
from roles.lib.plugins import load_named

BUILTINS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (GRPO, MaxRL, RLOO, SFT, Echo, OPD, OPSD, RAE)
}


class UnknownAlgorithm(ValueError):
    """No built-in has this name and it is not an importable ``module:Class``."""


def resolve(name: str) -> type[Algorithm]:
    """The class registered as ``name``, or imported from ``module.path:ClassName``."""
    cls = load_named(name, BUILTINS, "algorithm", "my_pkg.algos:MyAlgo", UnknownAlgorithm)
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
    unknown = [c for c in (algorithm.channel, *algorithm.channels) if c not in CHANNELS]
    if unknown:
        raise ValueError(f"algorithm {name!r} uses channels {unknown}; expected some of {CHANNELS}")
    return algorithm
