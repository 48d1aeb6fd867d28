"""The algorithm interface: a pure function from one complete group to loss-channel targets.

An algorithm sees the non-errored traces of one group (sorted by ``sample_index``, so
arrival order inside a group never matters) and returns, for every trainable branch of
every trace, a ``Targets``: per-token weights on the trainer's loss channels.

- ``rl``: per-token advantages on the branch's trainable (sampled) tokens, trained by
  the importance-weighted policy gradient with the trust-region mask;
- ``ce``: per-token cross-entropy weights (e.g. tool-output tokens, or the sampled
  tokens of a frozen teacher);
- ``ref_kl``: per-token coefficients and a reference model's logprobs, pulling the
  policy toward the reference.

The trainer knows channels, never algorithm names (``roles/trainer/loss.py``).

Most algorithms only need one scalar per trace: write ``advantages`` and the default
``targets`` broadcasts it over each branch's trainable tokens (``channel = "ce"`` puts
it on the ce channel instead). Algorithms that need a model's opinion of a branch
(distillation) return a ``ScoreSpec`` from ``score_spec``; the worker asks the
inference role for those logprobs and hands them to ``targets`` as ``refs``. The
logprobs are recorded in the samples, so everything downstream replays from the log.

An algorithm must not read the clock, the global RNG or anything outside its
arguments. A stateful algorithm keeps ``state`` as a fold over its own output:
``fold(state, scored)`` is applied to every ``SamplesScored`` it published, in log
order, from ``initial_state()``; a restarted worker rebuilds it from the log.

    class MyAlgo(Algorithm):
        name = "my_algo"
        def advantages(self, group, state):
            return [t.reward - 0.5 for t in group]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from schemas import Branch, SamplesScored, Trace

# The trainer's loss channels (docs/algorithms.md).
CHANNELS = ("rl", "ce", "ref_kl")


@dataclass(frozen=True)
class BranchView:
    """One trainable branch of a trace, as flat per-token arrays."""

    trace: Trace
    index: int  # position in trace.branches
    branch: Branch
    token_ids: np.ndarray  # int32
    trainable: np.ndarray  # bool: the actor's sampled tokens this branch trains
    logprobs: np.ndarray  # float32: inference logprobs (0 where not sampled)
    temperatures: np.ndarray  # float32
    reward: float  # the branch's reward (its member's, in multi-agent traces)

    @property
    def member(self) -> str | None:
        return self.branch.member

    def __len__(self) -> int:
        return len(self.token_ids)


@dataclass
class Targets:
    """Channel weights of one branch; ``None`` = the channel is not used.

    ``advantages`` and ``ref_weights`` may be scalars: they are broadcast over the
    branch's trainable tokens. Arrays have one entry per token of the branch.
    """

    advantages: float | np.ndarray | None = None  # rl
    ce: np.ndarray | None = None  # ce weight per token (0 = not trained)
    ref_weights: float | np.ndarray | None = None  # ref_kl coefficient
    ref_logprobs: np.ndarray | None = None  # ref_kl target, per token


@dataclass(frozen=True)
class ScoreSpec:
    """Which model scores a branch, and whether the env's demonstration is prepended.

    ``model`` is an inference model key ("policy" or a key of ``orchestrator.models``).
    With ``hint``, the env's ``demonstration(task)`` messages are rendered before the
    branch and their logprobs sliced off (self-distillation).
    """

    model: str
    hint: bool = False


# Refs handed to ``targets``: (rollout id, branch index) -> per-token logprobs.
Refs = dict[tuple[str, int], np.ndarray]


class Algorithm:
    """Base class of every algorithm; subclasses set ``name`` and write ``advantages``
    (one scalar per trace) or ``targets`` (per-token channel weights)."""

    name: ClassVar[str] = ""
    stateful: ClassVar[bool] = False
    channel: ClassVar[str] = "rl"  # where the default ``targets`` puts ``advantages``
    channels: ClassVar[tuple[str, ...]] = ("rl",)  # every channel it may emit
    needs_members: ClassVar[bool] = False  # only for envs whose traces name members
    # Scores multi-agent traces right (per-branch rewards, per-member baselines); an
    # algorithm that does not is refused on a member env at start.
    handles_members: ClassVar[bool] = False
    needs_demonstration: ClassVar[bool] = False  # only for envs with a demonstration

    def models(self) -> list[str]:
        """Keys of ``orchestrator.models`` this algorithm scores with (checked at start)."""
        return []

    def __init__(self, **options: Any) -> None:
        # Subclasses with options declare them as keyword arguments; reaching here with
        # leftovers means a typo in `orchestrator.algorithms.options`.
        if options:
            raise TypeError(f"algorithm {self.name!r} takes no options, got {sorted(options)}")

    def advantages(self, group: list[Trace], state: Any) -> list[float]:
        """One advantage per trace of ``group`` (the group's non-errored traces), in order."""
        raise NotImplementedError(f"{type(self).__name__} defines neither advantages nor targets")

    def targets(
        self, group: list[Trace], views: list[list[BranchView]], state: Any, refs: Refs
    ) -> list[list[Targets]]:
        """``Targets`` for each branch (``views[i][j]`` = branch j of trace i)."""
        adv = self.advantages(group, state)
        if len(adv) != len(group):
            raise ValueError(
                f"algorithm {self.name!r} returned {len(adv)} advantages for {len(group)} traces"
            )
        if self.channel == "ce":
            return [
                [Targets(ce=v.trainable * float(a)) for v in vs]
                for a, vs in zip(adv, views, strict=True)
            ]
        return [
            [Targets(advantages=float(a)) for _ in vs] for a, vs in zip(adv, views, strict=True)
        ]

    def score_spec(self, trace: Trace) -> ScoreSpec | None:
        """The model whose logprobs ``targets`` needs for ``trace``'s branches (None: none)."""
        return None

    def initial_state(self) -> Any:
        """The state before any group was scored (stateful algorithms only)."""
        return None

    def fold(self, state: Any, scored: SamplesScored) -> Any:
        """The state after ``scored`` was published (stateful algorithms only)."""
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
