"""Algorithm workers: complete groups of traces in, scored samples out.

    rlbus role algorithm --run demo --name grpo

``base`` holds the interface, ``Algorithm`` (a pure function from a group to per-token
loss-channel targets, such as advantages), ``registry`` resolves names (built-ins, or
``pkg.module:Class`` for your own), ``samples`` is the pure core that turns a group into a
``SamplesScored`` event, and ``role`` is the process that feeds it from the log.

- ``builtin``: the built-ins with a scalar per trace (group baselines for RL, and SFT)
- ``channels``: the built-ins beyond one scalar per trace (``echo``, ``opd``, ``opsd``,
  ``rae``)
- ``checks``: start-time checks of which algorithm runs on which env (``rlbus up``,
  ``attach``)
- ``core``: ``ScoringCore``, the worker's pure core: route, buffer per group, score, fold
  the algorithm's state (algorithm replay drives it too)
- ``scoring``: fetching the logprobs a distillation algorithm asks for, from inference
"""

from roles.algorithm.base import Algorithm
from roles.algorithm.registry import BUILTINS, UnknownAlgorithm, create, resolve

__all__ = ["BUILTINS", "Algorithm", "UnknownAlgorithm", "create", "resolve"]
