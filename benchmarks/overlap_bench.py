"""rlbus against a single-process synchronous GRPO loop, on the same work, side by side.

rlbus's roles overlap: inference generates step s+1 while the trainer trains step s. This
bench measures whether that pays on this machine, against the loop it must beat: one
process with 2 threads that generates all completions, scores them, trains, repeats
(``benchmarks.sync_grpo``: the same model, batch, sampling, reward, advantages and loss).

1. A warm start: ``rlbus up`` on the default preset for its 120 SFT steps, exported as a
   model directory (``rlbus model export``); both sides start RL from it.
2. rlbus RL runs from that model (``model.path``, no warm start, no eval: eval is not
   throughput), one per set-up (``SETUPS``): ``now`` (this version's defaults), and one
   change each: ``pinned`` (inference on CPU 1, the trainer on CPU 0),
   ``trainer-2-threads``, ``keep-equal`` (``orchestrator.skip_zero_advantage_groups =
   false``: groups whose rewards are all equal train with zero advantage instead of being
   regenerated). With ``--baseline-tree DIR`` (another checkout, e.g. ``git worktree add
   /tmp/before <commit>``), set-up ``before`` runs ``now`` with that tree's code, so a
   change is measured against the code before it in the same interleaved rounds.
3. The sync loop from the same model, same number of steps.

Steady state only: rlbus from its 5th published version to its last; the sync loop from
its 3rd step. Each set-up runs ``--rounds`` times, interleaved, and the median counts (a
single run on this shared 2-core machine varies by up to ~15%). Reported per set-up: seconds per step, completions generated/s and trained/s
(rlbus regenerates what it skips, so generated >= trained; the sync loop trains what it
generates), and the ratios to the sync loop, printed and saved to
``benchmarks/results/overlap.json``.

    python -m benchmarks.overlap_bench [--steps 80] [--setups now,pinned,keep-equal]
    python -m benchmarks.overlap_bench --setups now --baseline-tree /tmp/before --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import run_events, save
from bus.subjects import Topic
from schemas import BatchAssembled, TraceCompleted, WeightsPublished

WARM_STEPS = 120
SKIP_VERSIONS = 5  # rlbus: versions before the steady state (start-up, first swaps)
SKIP_SYNC_STEPS = 2

SETUPS: dict[str, list[str]] = {
    "now": [],  # this version's defaults
    "pinned": ["cpus.roles.inference.cpus=[1]", "cpus.roles.trainer.cpus=[0]"],
    "trainer-2-threads": ["cpus.roles.trainer.threads=2"],
    "keep-equal": ["orchestrator.skip_zero_advantage_groups=false"],
}


def up(root: Path, run: str, overrides: list[str], tree: Path | None = None) -> None:
    """``rlbus up`` of ``run``; with ``tree``, that checkout's code (its directory first on
    the path of the launcher and of every role it starts)."""
    cmd = [sys.executable, "-m", "roles.cli", "up", "--no-view", "--fresh", "--run", run,
           f"bus.data_dir={root}", *overrides]  # fmt: skip
    env = None
    if tree is not None:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
        }
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, cwd=tree, env=env)
    if out.returncode != 0:
        raise RuntimeError(f"rlbus up {run} failed:\n{out.stdout[-3000:]}\n{out.stderr[-2000:]}")


def warm_model(root: Path) -> Path:
    """The default preset's post-warm-start policy, as a model directory."""
    model = root / "warm-model"
    if (model / "model.safetensors").exists():
        return model
    up(root, "warm", [f"max_steps={WARM_STEPS}", "orchestrator.eval.interval=0"])
    subprocess.run(
        [sys.executable, "-m", "roles.cli", "model", "export", "--run", "warm", "--out", str(model),
         "--data-dir", str(root)],
        check=True, capture_output=True,
    )  # fmt: skip
    return model


def rates(root: Path, run: str) -> dict[str, float]:
    """Steady-state rates of one rlbus run, read from its log."""
    log = run_events(
        root / run,
        {
            "weights": (Topic.WEIGHTS_PUBLISHED, WeightsPublished),
            "traces": (Topic.TRACE_COMPLETED, TraceCompleted),
            "batches": (Topic.BATCH_ASSEMBLED, BatchAssembled),
        },
    )
    weights, traces, batches = log["weights"], log["traces"], log["batches"]
    published = {w.version: w.ts_ns for w in weights}
    first, last = SKIP_VERSIONS, max(published)
    t0, t1 = published[first], published[last]
    wall = (t1 - t0) / 1e9
    generated = sum(1 for t in traces if t0 < t.ts_ns <= t1)
    trained = sum(len(b.samples) for b in batches if first < b.step <= last)
    steps = last - first
    return {
        "steps": steps,
        "wall_s": round(wall, 2),
        "s_per_step": round(wall / steps, 4),
        "generated_per_s": round(generated / wall, 1),
        "trained_per_s": round(trained / wall, 1),
        "skipped_equal_groups": sum(b.skipped_zero_advantage for b in batches if b.step > first),
    }


def bus_run(
    root: Path, model: Path, name: str, steps: int, tree: Path | None = None
) -> dict[str, float]:
    run = f"bus-{name}"
    base = [f"model.path={model}", "orchestrator.warmup.steps=0", "orchestrator.eval.interval=0",
            f"max_steps={steps + SKIP_VERSIONS}"]  # fmt: skip
    up(
        root,
        run,
        base + SETUPS["now" if name == "before" else name],
        tree if name == "before" else None,
    )
    return rates(root, run)


def sync_run(model: Path, steps: int) -> dict[str, float]:
    from benchmarks.sync_grpo import run_sync_grpo
    from configs import load_config

    cfg = load_config("default", [f"model.path={model}", "trainer.device=cpu"])
    out = run_sync_grpo(cfg, start=None, steps=steps + SKIP_SYNC_STEPS, threads=2, progress=False)
    steady = out["steps"][SKIP_SYNC_STEPS:]
    wall = sum(s["gen_s"] + s["score_s"] + s["train_s"] for s in steady)
    done = sum(s["completions"] for s in steady)
    trained = sum(s["trained"] for s in steady)
    return {
        "steps": len(steady),
        "wall_s": round(wall, 2),
        "s_per_step": round(wall / len(steady), 4),
        "generated_per_s": round(done / wall, 1),
        "trained_per_s": round(trained / wall, 1),
        "equal_group_share": round(sum(s["flat_group_share"] for s in steady) / len(steady), 3),
        "split": {
            k: round(sum(s[k] for s in steady) / wall, 3) for k in ("gen_s", "score_s", "train_s")
        },
    }


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per numeric key, the median over rounds (the rounds themselves are kept beside)."""
    keys = [k for k, v in runs[0].items() if isinstance(v, int | float)]
    return {k: round(statistics.median(r[k] for r in runs), 4) for k in keys}


def main(
    steps: int, setups: list[str], root: Path | None, rounds: int, tree: Path | None = None
) -> dict[str, Any]:
    root = root or Path(tempfile.mkdtemp(prefix="rlbus-overlap-"))
    if tree is not None:
        setups = [*setups, "before"]
    model = warm_model(root)
    print(f"warm-started model: {model}", flush=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in ["sync", *setups]}
    for i in range(rounds):  # interleaved: a noisy neighbour hits every set-up alike
        runs["sync"].append(sync_run(model, steps))
        print(f"round {i + 1}: sync loop {runs['sync'][-1]}", flush=True)
        for name in setups:
            runs[name].append(bus_run(root, model, name, steps, tree))
            print(f"round {i + 1}: rlbus {name} {runs[name][-1]}", flush=True)
    results: dict[str, Any] = {"steps": steps, "rounds": rounds, "runs": runs}
    sync = results["sync"] = median_of(runs["sync"])
    lines = [f"  {'sync loop':<26} {sync['generated_per_s']:>7} / {sync['trained_per_s']:<7}"
             f" {'x1.0 / x1.0':<17} {sync['s_per_step']:.3f} s/step"]  # fmt: skip
    for name in setups:
        r = results[f"rlbus_{name}"] = median_of(runs[name])
        r["vs_sync_generated"] = round(r["generated_per_s"] / sync["generated_per_s"], 3)
        r["vs_sync_trained"] = round(r["trained_per_s"] / sync["trained_per_s"], 3)
        ratio = f"x{r['vs_sync_generated']} / x{r['vs_sync_trained']}"
        lines.append(
            f"  {'rlbus ' + name:<26} {r['generated_per_s']:>7} / {r['trained_per_s']:<7}"
            f" {ratio:<17} {r['s_per_step']:.3f} s/step"
        )
    if tree is not None and "now" in setups:
        now, before = results["rlbus_now"], results["rlbus_before"]
        results["now_vs_before"] = {
            k: round(now[k] / before[k], 3) for k in ("generated_per_s", "trained_per_s")
        }
        results["baseline_tree"] = str(tree)
        lines.append(f"  now / before (same rounds): {results['now_vs_before']}")
    print(f"\ncompletions/s generated / trained, ratio to the sync loop (median of {rounds}):")
    print("\n".join(lines))
    save("overlap", results)
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--steps", type=int, default=80, help="steady-state steps per set-up")
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--root", type=Path, default=None, help="reuse this directory (its warm model)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved repeats (median)")
    ap.add_argument("--baseline-tree", type=Path, default=None,
                    help="another checkout: set-up 'before' runs 'now' with its code")  # fmt: skip
    a = ap.parse_args()
    main(a.steps, a.setups.split(","), a.root, a.rounds, a.baseline_tree)
