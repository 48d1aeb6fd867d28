"""Eval figures: what an eval round's results say per env (pure; the orchestrator's eval
and ``rlbus eval`` both report these)."""

from __future__ import annotations

from typing import Any


def eval_metrics(results: list[Any], k: int) -> dict[str, float]:
    """avg@k per env; pass@k too when every reward is 0 or 1."""
    by_env: dict[str, list[list[float]]] = {}
    for r in results:
        by_env.setdefault(r.env, []).append(list(r.rewards))
    out: dict[str, float] = {}
    for env, tasks in by_env.items():
        per_task = [sum(rs) / len(rs) if rs else 0.0 for rs in tasks]
        out[f"{env}/avg@{k}"] = sum(per_task) / len(per_task)
        flat = [x for rs in tasks for x in rs]
        if flat and all(x in (0.0, 1.0) for x in flat):
            out[f"{env}/pass@{k}"] = sum(1.0 for rs in tasks if any(x == 1.0 for x in rs)) / len(
                tasks
            )
        out[f"{env}/errors"] = float(sum(r.errors for r in results if r.env == env))
        out.update(win_rates(env, [t for r in results if r.env == env for t in r.traces]))
    return out


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
