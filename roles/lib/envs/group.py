"""Group rubrics: the finished rollouts of a group scored together, then recorded.

An env whose rubric has ``group_funcs`` (``roles.lib.envs.base.Rubric``) is scored in two
steps. Each rollout is scored alone as it finishes (``run_rollout``: its reward
functions and metrics); once every rollout of the group is done, the env server hands
the group to ``score_group`` here, before any trace is published, so every trace of the
group carries its final reward and algorithms, the lake and algorithm replay read it as
they read any reward. Rules, the same live and in ``rlbus replay <run> rubric``:

- **Who is scored together** (``members``): the group's finished rollouts, those without
  an error, in sample order (``Trace.sample_index``), whatever order they finished in.
  An errored rollout is left out of the group function's lists and keeps reward 0; a
  group with no finished rollout is not group-scored; a group of one is (the function
  decides what a lone rollout gets).
- **What a group function gets**: the finished rollouts' messages (as their rubric
  scored them), the task, their states; it returns one number per rollout, in the same
  order.
- **What lands on the trace**: each group function's value under its name, in
  ``Trace.rewards`` (weight > 0) or ``Trace.metrics`` (weight 0), after the per-rollout
  ones, so the lake has a ``reward_<name>`` column for it; ``Trace.reward`` is the
  weighted mean over both kinds (``Rubric.total``). Member rewards are the per-rollout
  rubric's alone.
- **Errors**: a group function that raises, or returns anything but one finite number
  per rollout, is a bug in env code (``EnvCodeError``: the task is dead-lettered).

A verifiers env (``vf:``) is scored inside verifiers' episode and has no group rubric
here.

    traces = await score_group(env, task_data, traces, seen, "reverse-text")
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from roles.lib.envs.base import EnvCodeError, Environment, Messages, Score, State
from roles.lib.envs.harness import scored
from schemas import Trace


def members(traces: Sequence[Trace]) -> list[Trace]:
    """The rollouts a group function sees: the finished ones (no error), by sample index."""
    return sorted((t for t in traces if not t.errors), key=lambda t: t.sample_index)


def recorded_score(trace: Trace) -> Score:
    """A trace's per-rollout score, as ``run_rollout`` recorded it."""
    return Score(
        reward=trace.reward,
        rewards=dict(trace.rewards),
        metrics=dict(trace.metrics),
        member_rewards=dict(trace.member_rewards),
    )


async def score_group(
    env: Environment,
    task: dict[str, Any],
    traces: Sequence[Trace],
    seen: Mapping[int, tuple[Messages, State]],
    env_name: str,
) -> list[Trace]:
    """``traces`` (a group, any order) with the env's group functions folded into each
    finished one (module docstring); errored ones unchanged. ``seen`` holds what each
    finished rollout's rubric scored, by sample index (``run_rollout``'s ``on_scored``)."""
    group = members(traces)
    if not env.group_scored or not group:
        return list(traces)
    missing = [t.sample_index for t in group if t.sample_index not in seen]
    if missing:  # a rollout scored outside the harness (verifiers): nothing to group
        raise EnvCodeError(
            env_name, "TypeError",
            f"rollouts {missing} were scored where a group rubric cannot see them "
            "(a verifiers env scores inside its episode): drop the group functions",
        )  # fmt: skip
    try:
        scores = await env.ascore_group(
            [seen[t.sample_index][0] for t in group],
            task,
            [seen[t.sample_index][1] for t in group],
            [recorded_score(t) for t in group],
        )
        if not isinstance(scores, list) or len(scores) != len(group):
            raise TypeError(f"score_group returned {scores!r}, not {len(group)} Scores")
        scores = [scored(s) for s in scores]
    except Exception as e:  # noqa: BLE001 - env code is user code: its bug, with its traceback
        raise EnvCodeError.from_exception(env_name, e) from e
    final = {t.sample_index: s for t, s in zip(group, scores, strict=True)}
    return [t if t.errors else rescored(t, final[t.sample_index]) for t in traces]


def rescored(trace: Trace, score: Score) -> Trace:
    """``trace`` with ``score``'s reward, named rewards and metrics."""
    return msgspec.structs.replace(
        trace, reward=float(score.reward), rewards=dict(score.rewards), metrics=dict(score.metrics)
    )


__all__ = ["members", "recorded_score", "rescored", "score_group"]
