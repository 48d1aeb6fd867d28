"""Algorithm workers: complete groups of traces in, scored samples out.

    rlbus role algorithm --run demo --name grpo

``base.Algorithm`` is the interface (a pure function from a group to advantages),
``registry`` resolves names (built-ins, or ``pkg.module:Class`` for your own),
``samples`` is the pure core that turns a group into a ``SamplesScored`` event, and
``worker`` is the role that feeds it from the log.
"""

from roles.algorithm.base import Algorithm
from roles.algorithm.registry import BUILTINS, UnknownAlgorithm, create, resolve

__all__ = ["BUILTINS", "Algorithm", "UnknownAlgorithm", "create", "resolve"]
