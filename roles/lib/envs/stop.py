"""Why a rollout ended: the stop conditions recorded as ``Trace.stop_condition``, and
the one rule that picks among them when several hold.

    stop_condition(HAS_ERROR if errors else None, MAX_TURNS_REACHED)   # -> "has_error"

The names are verifiers' own stop checks (its ``@vf.stop`` methods, whose name lands in
its ``state["stop_condition"]``), so a prime-rl user reads them as they read verifiers':

- ``has_error``: the rollout errored (``Trace.errors``; reward 0, it never trains);
- ``schedule_exhausted``: the env ended it: its ``env_response`` said done, its turn
  schedule has no one left to speak, an agent env's ``run`` returned, a verifiers
  episode completed;
- ``prompt_too_long``: the next turn's prompt would not fit the model's context
  (inference refused it as ``context_too_long``) after at least one turn was
  generated: the rollout is truncated and scored as far as it got;
- ``max_turns_reached``: it used every turn ``max_turns`` allows.

When several hold at once (the env said done on the turn that reached ``max_turns``, an
error on the last turn) the highest wins, in verifiers' own priorities
(``has_error`` 100, ``schedule_exhausted`` 50, ``prompt_too_long`` 10,
``max_turns_reached`` 0): error > schedule exhausted > prompt too long > max turns.
"""

from __future__ import annotations

HAS_ERROR = "has_error"
SCHEDULE_EXHAUSTED = "schedule_exhausted"
PROMPT_TOO_LONG = "prompt_too_long"
MAX_TURNS_REACHED = "max_turns_reached"
# Highest priority first.
STOP_CONDITIONS = (HAS_ERROR, SCHEDULE_EXHAUSTED, PROMPT_TOO_LONG, MAX_TURNS_REACHED)
# Inference's refusal of a prompt that leaves no room for a completion token
# (``roles.inference.backend.admit_generate``).
CONTEXT_TOO_LONG = "context_too_long"


def stop_condition(*held: str | None) -> str:
    """The highest-priority condition of those that held (None: one that did not)."""
    names = {h for h in held if h is not None}
    unknown = names - set(STOP_CONDITIONS)
    if unknown:
        raise ValueError(f"unknown stop conditions {sorted(unknown)}: not in {STOP_CONDITIONS}")
    for name in STOP_CONDITIONS:
        if name in names:
            return name
    raise ValueError("a rollout ended with no stop condition holding")
