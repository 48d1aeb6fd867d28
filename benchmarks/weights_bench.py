"""Weights delivery, trainer to inference, per ``trainer.weights_via``: side by side.

The same short run (``rlbus up``, preset ``smoke`` unless ``--preset``, ``--steps``
trainer steps, no evals and no checkpoints) once per way of shipping weights
(``--via``; on a CPU ``object,shm,ipc,broadcast``, with ``--device cuda`` ``shm,ipc``), the runs
interleaved over ``--rounds`` so a noisy neighbour hits every way alike. From each run's
inference logs (``logs/inference-*.log``) it reads every ``weights.swapped`` line and
reports per way:

- ``swaps``: all of them; the stats leave out each replica's first (its warm-up);
- ``lag_s``: publish -> live, seconds from the trainer's announcement to serving it
  (median, p99, max);
- ``pause_s``: how long generation paused for the swap (median, max);
- ``load_s``: fetch + verify + load (median); ``bytes`` per version; ``via_counts``: how
  the swaps actually came (an ``ipc`` run falls back to stored bytes when it must);
- ``wall_s`` of the run (median over rounds) and, from its ``summary.json``, its train
  ``rollouts_per_s`` (rollouts that can train, per second) and ``trainer_tokens_per_s``.

Swaps of all rounds are pooled for the stats. Results go to
``benchmarks/results/weights.json`` and ``weights.md``:

    python -m benchmarks.weights_bench [--steps 20] [--via object,shm,ipc,broadcast] [--rounds 1]
    python -m benchmarks.weights_bench --device cuda --preset gpu --steps 30
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, save
from configs.paths import RunPaths

CPU_VIAS = "object,shm,ipc,broadcast"
CUDA_VIAS = "shm,ipc"


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values``, linearly interpolated."""
    s = sorted(values)
    at = (len(s) - 1) * q / 100
    lo = int(at)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (at - lo)


def swap_stats(lines: Iterable[str]) -> dict[str, Any]:
    """Stats of the ``weights.swapped`` log lines among ``lines`` (JSON, one a line; other
    lines are skipped). Each replica's (``run`` and ``instance``'s) first swap is counted
    in ``swaps`` but left out of the stats."""
    swaps: list[dict[str, Any]] = []
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == "weights.swapped":
            swaps.append(entry)
    seen: set[Any] = set()
    steady = []
    for s in swaps:
        replica = (s.get("run"), s.get("instance"))
        if replica in seen:
            steady.append(s)
        seen.add(replica)
    via_counts: dict[str, int] = {}
    for s in swaps:
        via_counts[s.get("via", "?")] = via_counts.get(s.get("via", "?"), 0) + 1
    out: dict[str, Any] = {"swaps": len(swaps), "measured": len(steady), "via_counts": via_counts}
    if not steady:
        return out
    lag = [float(s["lag_s"]) for s in steady]
    pause = [float(s["pause_s"]) for s in steady]
    return {
        **out,
        "lag_s_median": round(statistics.median(lag), 4),
        "lag_s_p99": round(percentile(lag, 99), 4),
        "lag_s_max": round(max(lag), 4),
        "pause_s_median": round(statistics.median(pause), 5),
        "pause_s_max": round(max(pause), 5),
        "load_s_median": round(statistics.median(float(s["load_s"]) for s in steady), 4),
        "bytes": int(statistics.median(int(s["bytes"]) for s in steady)),
    }


def overrides(args: argparse.Namespace, via: str) -> list[str]:
    out = [
        f"max_steps={args.steps}",
        "orchestrator.eval.interval=0",
        "orchestrator.eval.at_start=false",
        "trainer.checkpoint_interval=0",
        f'trainer.weights_via="{via}"',
    ]
    if args.device:
        out += [f'trainer.device="{args.device}"', f'inference.device="{args.device}"']
    return out + list(args.overrides)


def run_once(args: argparse.Namespace, root: Path, via: str, round_: int) -> dict[str, Any]:
    """One ``rlbus up`` with ``via``; its swaps' lines, wall time and summary figures."""
    run = f"weights-{via}-{round_}"
    cmd = [
        sys.executable, "-m", "roles.cli", "up", "-c", args.preset, "--run", run, "--fresh",
        "--no-view", f"bus.data_dir={root}", *overrides(args, via),
    ]  # fmt: skip
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
    wall = time.perf_counter() - started
    if out.returncode != 0:
        raise SystemExit(f"rlbus up {run} exited {out.returncode}:\n{out.stdout[-3000:]}")
    lines = [
        line
        for log in sorted((root / run / "logs").glob("inference-*.log"))
        for line in log.read_text(errors="replace").splitlines()
    ]
    summary = json.loads((root / run / "summary.json").read_text())
    shutil.rmtree(RunPaths(root, run).shm_weights, ignore_errors=True)  # memory, not the run dir
    return {
        "run": run,
        "wall_s": round(wall, 1),
        "rollouts_per_s": summary.get("rollouts_per_s"),
        "trainer_tokens_per_s": summary.get("trainer_tokens_per_s"),
        "lines": lines,
        **swap_stats(lines),
    }


def device_name(device: str | None) -> str:
    if device and device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()})"


def table(results: dict[str, Any]) -> str:
    """The per-way figures as a markdown table, ways side by side."""
    rows = [
        ("swaps (measured)", lambda r: f"{r['swaps']} ({r['measured']})"),
        ("came via", lambda r: ", ".join(f"{k} {n}" for k, n in r["via_counts"].items())),
        ("publish->live lag_s median", lambda r: r.get("lag_s_median")),
        ("publish->live lag_s p99", lambda r: r.get("lag_s_p99")),
        ("publish->live lag_s max", lambda r: r.get("lag_s_max")),
        ("pause_s median", lambda r: r.get("pause_s_median")),
        ("pause_s max", lambda r: r.get("pause_s_max")),
        ("load_s median", lambda r: r.get("load_s_median")),
        ("bytes per version", lambda r: r.get("bytes")),
        ("run wall_s", lambda r: r["wall_s"]),
        ("train rollouts/s", lambda r: r["rollouts_per_s"]),
        ("trainer tokens/s", lambda r: r["trainer_tokens_per_s"]),
    ]
    vias = list(results["vias"])
    head = f"| | {' | '.join(f'`{v}`' for v in vias)} |\n|---|{'---|' * len(vias)}\n"
    body = "\n".join(
        f"| {name} | {' | '.join(str(get(results['vias'][v])) for v in vias)} |"
        for name, get in rows
    )
    return head + body + "\n"


def write_markdown(results: dict[str, Any]) -> Path:
    path = RESULTS / "weights.md"
    path.write_text(
        f"# weights_bench: `{results['preset']}` preset, {results['steps']} steps, "
        f"{results['rounds']} round(s)\n\n"
        f"Device: {results['device']}; torch {results['torch']}; {results['when']}; "
        f"`{results['command']}`.\n\n{table(results)}\n"
        "Stats leave out each run's first swap; wall_s and rates: median over rounds. "
        "How each figure is computed: `benchmarks/weights_bench.py`'s docstring.\n"
    )
    return path


def main(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    vias = (args.via or (CUDA_VIAS if (args.device or "").startswith("cuda") else CPU_VIAS)).split(
        ","
    )
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in vias}
    with tempfile.TemporaryDirectory(prefix="rlbus-weights-bench-") as d:
        root = Path(args.data_dir) if args.data_dir else Path(d)
        root.mkdir(parents=True, exist_ok=True)
        for i in range(args.rounds):  # interleaved: noise hits every way alike
            for via in vias:
                r = run_once(args, root, via, i)
                runs[via].append(r)
                shown = {k: v for k, v in r.items() if k != "lines"}
                print(f"round {i + 1}: {via} {shown}", flush=True)
    per_via = {}
    for via, rs in runs.items():
        lines = [line for r in rs for line in r.pop("lines")]
        per_via[via] = {
            **swap_stats(lines),
            **{
                k: round(statistics.median(r[k] for r in rs if r[k] is not None), 2)
                if any(r[k] is not None for r in rs)
                else None
                for k in ("wall_s", "rollouts_per_s", "trainer_tokens_per_s")
            },
        }
    return {
        "preset": args.preset,
        "steps": args.steps,
        "rounds": args.rounds,
        "device": device_name(args.device),
        "torch": torch.__version__,
        "command": " ".join(["python -m benchmarks.weights_bench", *sys.argv[1:]]),
        "overrides": overrides(args, "<via>"),
        "vias": per_via,
        "runs": runs,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--via", default=None, help=f"ways, comma-separated (default {CPU_VIAS}; cuda: {CUDA_VIAS})")  # fmt: skip
    p.add_argument("--preset", default="smoke", help="preset name or TOML file")
    p.add_argument("--steps", type=int, default=20, help="trainer steps per run (max_steps)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved repeats")
    p.add_argument("--device", default=None, help="trainer and inference device (default: the preset's)")  # fmt: skip
    p.add_argument("--data-dir", default=None, help="keep the runs here (default: a temporary dir)")  # fmt: skip
    p.add_argument("--timeout-s", type=float, default=900.0, help="wall-clock limit of one run")
    p.add_argument("overrides", nargs="*", help="more config overrides, dotted: trainer.lr=1e-4")
    return p.parse_args(argv)


if __name__ == "__main__":
    results = main(parse_args())
    saved = save("weights", results)
    md = write_markdown(json.loads(saved.read_text()))
    print()
    print(table(results))
    print("saved", saved, md)
