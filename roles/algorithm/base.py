"""The algorithm interface: a pure function from one complete group to advantages.

An algorithm sees the non-errored traces of one group (sorted by ``sample_index``, so
the arrival order never matters) and returns one scalar advantage per trace, which the
sample builder broadcasts over that trace's trainable tokens. It must not read the
clock, the global RNG or anything outside its arguments: replaying an algorithm over a
run's recorded traces must reproduce its recorded advantages exactly.

A stateful algorithm (e.g. a running baseline across groups) keeps ``state`` as a
fold over its own output log: ``fold(state, scored)`` is applied to every
``SamplesScored`` it published, in log order, starting from ``initial_state()``. A
restarted worker rebuilds the state by folding over ``samples.scored.<name>``, so the
state is never anything the log cannot reproduce.

Room to grow, not built yet: ``advantages`` may later return per-token arrays instead
of scalars, and ``channel`` may gain more loss channels (e.g. ``ref_kl``).

    class MyAlgo(Algorithm):
        name = "my_algo"
        def advantages(self, group, state):
            return [t.reward - 0.5 for t in group]
"""

from __future__ import annotations

from typing import Any, ClassVar

from schemas import SamplesScored, Trace

# Loss channels a sample can feed: "rl" = policy gradient weighted by the advantage,
# "ce" = cross-entropy on the actor's sampled tokens (``Sample.sft_mask``).
CHANNELS = ("rl", "ce")


class Algorithm:
    """Base class of every algorithm; subclasses set ``name`` and write ``advantages``."""

    name: ClassVar[str] = ""
    stateful: ClassVar[bool] = False
    channel: ClassVar[str] = "rl"

    def __init__(self, **options: Any) -> None:
        # Subclasses with options declare them as keyword arguments; reaching here with
        # leftovers means a typo in `orchestrator.algorithms.options`.
        if options:
            raise TypeError(f"algorithm {self.name!r} takes no options, got {sorted(options)}")

    def advantages(self, group: list[Trace], state: Any) -> list[float]:
        """One advantage per trace of ``group`` (the group's non-errored traces), in order."""
        raise NotImplementedError

    def initial_state(self) -> Any:
        """The state before any group was scored (stateful algorithms only)."""
        return None

    def fold(self, state: Any, scored: SamplesScored) -> Any:
        """The state after ``scored`` was published (stateful algorithms only)."""
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"
