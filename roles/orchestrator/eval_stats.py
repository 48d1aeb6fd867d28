"""Eval figures: what an eval round's results say per env (pure; the orchestrator's eval
and ``rlbus eval`` both report these).

    values = eval_metrics(round_.results, k=4, version=10)
    values["reverse-text/avg@4"], values["reverse-text/avg@4_stderr"]
    values["reverse-text/pass@4"], values["reverse-text/answered_by_pinned"]

Per env, over the round's tasks (one ``EvalCompleted`` of ``n`` rollouts each):

- ``<env>/avg@k``: the mean over tasks of each task's mean reward;
- ``<env>/avg@k_stderr``: its standard error over tasks (sample standard deviation of
  the per-task means / sqrt(tasks); absent with one task). The eval tasks are one draw of
  the eval split, so two rounds of the same weights on other tasks or seeds differ by
  about this much: a gain smaller than two of these is noise;
- ``<env>/pass@j`` for ``j = k`` and every power of two ``2 <= j < k``, only when every
  reward is 0 or 1 (a reward counts as correct when it is exactly 1.0): the mean over
  tasks of the unbiased estimator of Chen et al. 2021, ``1 - C(n-c, j) / C(n, j)`` with
  ``c`` correct of ``n`` (``pass_at``). pass@1 is avg@k for such rewards, so it is not
  repeated;
- ``<env>/errors``: rollouts with an error;
- ``<env>/answered_by_pinned`` when the round's ``version`` is given: the share of its
  rollouts with a policy turn whose every policy turn ran on that version (the trace's
  ``policy_min == policy_max == version``). Inference holds its weights for requests
  pinned to the round's version (``inference.eval_pin_*``), so this is 1.0 unless a
  hold hit its bound or a replica served a newer version already;
- ``<env>/win_rate`` (and per seat) for multi-agent envs with a learner seat.
"""

from __future__ import annotations

import math
from typing import Any

from configs.orchestrator import POLICY
from schemas.arrays import mask


def pass_at(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with ``c`` correct of ``n`` samples: the chance that
    ``k`` of the ``n`` drawn without replacement hold a correct one,
    ``1 - C(n-c, k) / C(n, k)``, computed as a product (no huge binomials). With fewer than
    ``k`` samples it is whether any is correct (no unbiased value exists)."""
    if c <= 0:
        return 0.0
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def pass_ks(k: int) -> list[int]:
    """The j of the pass@j reported for ``k`` samples: powers of two from 2 below k, and k."""
    out = [j for j in (2**p for p in range(1, k.bit_length())) if j < k]
    return [*out, k]


def eval_metrics(results: list[Any], k: int, version: int | None = None) -> dict[str, float]:
    """The round's figures per env (module docstring); ``version`` is the policy version
    the round evaluates, when the caller knows it."""
    by_env: dict[str, list[Any]] = {}
    for r in results:
        by_env.setdefault(r.env, []).append(r)
    out: dict[str, float] = {}
    for env, tasks in by_env.items():
        per_task = [sum(r.rewards) / len(r.rewards) if r.rewards else 0.0 for r in tasks]
        mean = sum(per_task) / len(per_task)
        out[f"{env}/avg@{k}"] = mean
        if len(per_task) > 1:
            var = sum((x - mean) ** 2 for x in per_task) / (len(per_task) - 1)
            out[f"{env}/avg@{k}_stderr"] = math.sqrt(var / len(per_task))
        flat = [x for r in tasks for x in r.rewards]
        if flat and all(x in (0.0, 1.0) for x in flat):
            for j in pass_ks(k):
                scores = [
                    pass_at(len(r.rewards), sum(x == 1.0 for x in r.rewards), j) for r in tasks
                ]
                out[f"{env}/pass@{j}"] = sum(scores) / len(scores)
        out[f"{env}/errors"] = float(sum(r.errors for r in tasks))
        traces = [t for r in tasks for t in r.traces]
        if version is not None and (share := pinned_share(traces, version)) is not None:
            out[f"{env}/answered_by_pinned"] = share
        out.update(win_rates(env, traces))
    return out


def pinned_share(traces: list[Any], version: int) -> float | None:
    """The share of ``traces`` with a policy turn whose policy turns all ran on
    ``version``; None when no trace has a policy turn (a frozen or scripted actor)."""
    own = [t for t in traces if t.from_policy and t.messages]
    if not own:
        return None
    return sum(t.policy_min == t.policy_max == version for t in own) / len(own)


def answering_versions(traces: list[Any]) -> list[int]:
    """The policy versions that answered ``traces`` (every sampled turn the policy
    played, sorted; a frozen opponent's or a judge's turns are not the policy's)."""
    return sorted(
        {
            m.policy_version
            for t in traces
            for m in t.messages
            if m.policy_version is not None
            and m.model in (None, POLICY)
            and m.sampled
            and mask(m.sampled).any()
        }
    )


def win_rates(env: str, traces: list[Any]) -> dict[str, float]:
    """With a learner seat: the share of rollouts the learner won (its member reward > 0),
    overall and per seat (``<env>/win_rate``, ``<env>/win_rate@<seat>``); {} without."""
    seated = [t for t in traces if t.ok and t.seat is not None and t.seat in t.member_rewards]
    out: dict[str, float] = {}
    for seat in sorted({t.seat for t in seated}):
        mine = [t for t in seated if t.seat == seat]
        out[f"{env}/win_rate@{seat}"] = sum(t.member_rewards[seat] > 0 for t in mine) / len(mine)
    if seated:
        wins = sum(t.member_rewards[t.seat] > 0 for t in seated)
        out[f"{env}/win_rate"] = wins / len(seated)
    return out
