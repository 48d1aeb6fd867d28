"""How long ``rlbus up`` takes to start its roles and to stop them, on a 2-step smoke run.

    just bench-startup                                   # this tree, 3 rounds
    python -m benchmarks.startup_bench --baseline-tree /tmp/before --rounds 3

Each round runs ``rlbus up -c smoke --no-view max_steps=2`` and reads the roles' logs:
when the launcher spawned the role processes (after its preflight and server), when
each role logged ``role.started`` (after the spawn), and how long the ordered stop took
(the orchestrator's ``run.stopped`` to the last ``role.stopped``). Every e2e test pays
these once per run, and so does every ``rlbus up``. With ``--baseline-tree DIR``
(another checkout, e.g. ``git worktree add /tmp/before <commit>``) the rounds alternate
between that tree and this one, so the two are measured side by side on the same
machine; the roles of each run import from its tree (``PYTHONPATH``). Results:
``benchmarks/results/startup.json``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save

# The role processes whose readiness is reported.
WATCHED = ("orchestrator", "env-reverse-text", "teacher-teacher", "trainer", "inference-policy-0")


def one_run(tree: Path | None) -> dict[str, float]:
    """One smoke run from ``tree`` (None: this one); seconds from the command's start."""
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    with tempfile.TemporaryDirectory(prefix="rlbus-startup-") as tmp:
        cmd = [sys.executable, "-m", "roles.cli", "up", "-c", "smoke", "--no-view",
               "--run", "s", f"bus.data_dir={tmp}", "max_steps=2"]  # fmt: skip
        start = time.time()
        done = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True)
        wall = time.time() - start
        if done.returncode != 0:
            raise RuntimeError(f"rlbus up failed ({done.returncode}): {done.stdout[-2000:]}")
        return {"wall_s": wall, **_timeline(Path(tmp) / "s" / "logs", start)}


def _timeline(logs: Path, start: float) -> dict[str, float]:
    spawned: float | None = None
    ready: dict[str, float] = {}
    stopped_at = last_stop = 0.0
    for log in logs.glob("*.log"):
        name = log.stem
        for line in log.read_text().splitlines():
            i = line.find("{")
            try:
                d = json.loads(line[i:]) if i >= 0 else None
            except ValueError:
                continue
            if not isinstance(d, dict) or "timestamp" not in d:
                continue
            t = dt.datetime.fromisoformat(d["timestamp"].replace("Z", "+00:00")).timestamp()
            t -= start
            event = d.get("event")
            if name == "launcher" and event == "role.started":
                spawned = t if spawned is None else min(spawned, t)
            elif event == "role.started":
                ready.setdefault(name, t)
            if name == "orchestrator" and event == "run.stopped":
                stopped_at = t
            if event == "role.stopped":
                last_stop = max(last_stop, t)
    assert spawned is not None, f"no role was started (logs in {logs})"
    out = {"spawn_s": spawned, "stop_s": last_stop - stopped_at}
    out |= {f"{r}_ready_s": ready[r] - spawned for r in WATCHED if r in ready}
    return out


def summarize(runs: list[dict[str, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[k] for r in runs), 2) for k in runs[0]}


def main(rounds: int, baseline: Path | None) -> None:
    trees: dict[str, Path | None] = {"now": None}
    if baseline is not None:
        trees = {"baseline": baseline, "now": None}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for i in range(rounds):
        for name, tree in trees.items():
            runs[name].append(one_run(tree))
            print(f"round {i + 1} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in runs[name][-1].items()), flush=True)  # fmt: skip
    results: dict[str, Any] = {
        "command": "rlbus up -c smoke --no-view max_steps=2",
        "rounds": rounds,
        "medians": {name: summarize(r) for name, r in runs.items()},
        "runs": runs,
    }
    if baseline is not None:
        results["baseline_tree"] = str(baseline)
        b, n = results["medians"]["baseline"], results["medians"]["now"]
        results["wall_ratio"] = round(b["wall_s"] / n["wall_s"], 2)
    path = save("startup", results)
    print(json.dumps(results["medians"], indent=2))
    print(f"-> {path}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="another checkout to measure side by side (its roles import from it)")  # fmt: skip
    a = ap.parse_args()
    main(a.rounds, a.baseline_tree)
