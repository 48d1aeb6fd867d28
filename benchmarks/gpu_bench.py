"""The `gpu` preset on one GPU: rollout and trainer throughput, MFU, weights lag, mismatch.

Starts ``python -m roles.cli up -c gpu`` for ``--steps`` trainer steps (a short SFT warm
start, then GRPO; no evals and no checkpoints, which would only stall the loop being
measured) under a wall-clock cap (``--max-wall-s``: on the cap the run gets SIGINT and
drains, like Ctrl-C, and what it logged so far is measured). Then it reads the finished
run's log, with an embedded server started again on the run's store as
``benchmarks/loop_bench.py`` does, and reports:

- ``rollouts_per_s``, ``generated_tokens_per_s``: GRPO rollouts (traces of tasks requested
  in phase "rl") and their sampled tokens, over the span from the first to the last one;
- ``inference_tokens_per_s``: the mean of the inference role's own ``tokens_per_s``
  reports (completion tokens per second over each 10 s window with traffic);
- ``trainer_tokens_per_s``: the median over GRPO steps of the trainer's ``tokens_per_s``
  (the median leaves out the first step's CUDA warm-up), and ``mfu`` =
  6 x n_params x trainer_tokens_per_s / (``--peak-tflops`` x 1e12), n_params counted from
  the run's model (tied embeddings once; the default peak, 989, is the H100 SXM's dense
  bf16 figure);
- ``weights_lag_s``: seconds from ``weights.published`` to a replica serving it (median
  and max over every swap, from the ``lag_s`` of the replicas' ``weights.swapped`` log
  lines; the role's ``weights_lag_s`` metric only samples the last swap of each report);
- ``mismatch_kl``: the trainer's ``mismatch_kl`` (inference logprobs vs the trainer's
  recomputation, k3 per rl token), mean over GRPO steps. With the preset's
  ``max_async_level = 1`` it holds the policy lag as well as the numerics (bf16
  inference vs the trainer); ``orchestrator.max_async_level=0`` leaves the numerics.

Results go to ``benchmarks/results/gpu.json`` and ``gpu.md``. It needs a GPU (``just
bench-gpu``), but runs anywhere for its plumbing:

    python -m benchmarks.gpu_bench [--steps 40] [--peak-tflops 989]
    python -m benchmarks.gpu_bench --preset smoke --device cpu --steps 6 --warmup-steps 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, save
from bus.reader import read_log
from bus.runtime import Bus
from bus.server import EmbeddedServer
from bus.subjects import Topic
from configs import RunConfig, load_config
from configs.paths import RunPaths
from roles.lib.model import materialize_model
from roles.lib.model.tiny import count_params
from schemas import BatchAssembled, MetricsReported, TaskRequested, TraceCompleted
from schemas.arrays import mask

RUN = "gpu-bench"
DRAIN_S = 90  # after the cap's SIGINT, how long the roles get to drain


def overrides(args: argparse.Namespace) -> list[str]:
    """The preset shrunk to ``--steps`` (measured GRPO steps after a short warm start)."""
    warmup = min(args.warmup_steps, max(args.steps - 1, 0))
    out = [
        f"max_steps={args.steps}",
        f"orchestrator.warmup.steps={warmup}",
        "orchestrator.eval.interval=0",
        "orchestrator.eval.at_start=false",
        "trainer.checkpoint_interval=0",
    ]
    if args.device:
        out += [f'trainer.device="{args.device}"', f'inference.device="{args.device}"']
    return out + list(args.overrides)


def start_run(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    """``rlbus up`` to max_steps or the wall-clock cap; its output goes to ``up.log``."""
    cmd = [
        sys.executable, "-m", "roles.cli", "up", "-c", args.preset, "--run", RUN, "--fresh",
        "--no-view", f"bus.data_dir={root}", *overrides(args),
    ]  # fmt: skip
    log = root / "up.log"
    started = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        capped = False
        try:
            proc.wait(timeout=args.max_wall_s)
        except subprocess.TimeoutExpired:
            capped = True
            proc.send_signal(signal.SIGINT)  # the launcher drains its roles, as on Ctrl-C
            try:
                proc.wait(timeout=DRAIN_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    wall = time.perf_counter() - started
    if proc.returncode != 0 and not capped:
        tail = log.read_text()[-4000:]
        raise SystemExit(f"rlbus up exited {proc.returncode}:\n{tail}")
    command = " ".join(["python", *cmd[1:]])
    return {"process_wall_s": round(wall, 1), "capped": capped, "command": command}


async def read_run(paths: RunPaths) -> dict[str, list[Any]]:
    """The run's task requests, traces and metrics, read from its own store."""
    with EmbeddedServer(paths.nats) as server:
        bus = await Bus.connect(server.url, run=paths.run, producer="gpu-bench")
        try:

            async def read(topic: Topic, kind: type) -> list[Any]:
                return [e async for e in read_log(bus, [(topic, None)], (kind,))]

            return {
                "tasks": await read(Topic.TASK_REQUESTED, TaskRequested),
                "traces": await read(Topic.TRACE_COMPLETED, TraceCompleted),
                "metrics": await read(Topic.METRICS_REPORTED, MetricsReported),
                "batches": await read(Topic.BATCH_ASSEMBLED, BatchAssembled),
            }
        finally:
            await bus.close()


def swap_lags(paths: RunPaths) -> list[float]:
    """``lag_s`` of every ``weights.swapped`` line of the policy replicas' logs."""
    lags = []
    for log in sorted(paths.logs.glob("inference-policy-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("event") == "weights.swapped":
                lags.append(float(entry["lag_s"]))
    return lags


def n_params(cfg: RunConfig, paths: RunPaths) -> int:
    """Distinct parameters of the run's model, built on the meta device (no memory)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = materialize_model(cfg, cfg.model.path, paths.dir)
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        return count_params(AutoModelForCausalLM.from_config(config))


def figures(log: dict[str, list[Any]], lags: list[float], params: int, peak: float) -> dict:
    rl_tasks = {t.event_id for t in log["tasks"] if t.phase == "rl"}
    traces = [t for t in log["traces"] if t.request_id in rl_tasks]
    tokens = sum(int(mask(m.sampled).sum()) for t in traces for m in t.trace.messages)
    span = (max(t.ts_ns for t in traces) - min(t.ts_ns for t in traces)) / 1e9 if traces else 0
    by_role: dict[str, list[dict[str, float]]] = {}
    for m in log["metrics"]:
        by_role.setdefault(m.role, []).append(m.values)
    grpo = [v for v in by_role.get("trainer", []) if v.get("rl_tokens", 0) > 0]
    inference = [v["tokens_per_s"] for v in by_role.get("inference", []) if "tokens_per_s" in v]
    tps = statistics.median(v["tokens_per_s"] for v in grpo) if grpo else None
    mismatch = [v["mismatch_kl"] for v in grpo if "mismatch_kl" in v]
    # Policy lag of the trained rl samples: versions between the weights a step starts
    # from (step - 1) and the oldest that sampled the sample. mismatch_kl holds the lag
    # as well as the numerics; on-policy samples have none.
    lags_v = [
        b.step - 1 - s.policy_min for b in log["batches"] if b.phase == "rl" for s in b.samples
    ]
    return {
        "grpo_steps": len(grpo),
        "grpo_rollouts": len(traces),
        "rollouts_per_s": round(len(traces) / span, 1) if span else None,
        "generated_tokens_per_s": round(tokens / span, 1) if span else None,
        "inference_tokens_per_s": round(statistics.mean(inference), 1) if inference else None,
        "trainer_tokens_per_s": None if tps is None else round(tps, 1),
        "n_params": params,
        "peak_tflops": peak,
        "mfu": None if tps is None else round(6 * params * tps / (peak * 1e12), 4),
        "weights_swaps": len(lags),
        "weights_lag_s_median": round(statistics.median(lags), 3) if lags else None,
        "weights_lag_s_max": round(max(lags), 3) if lags else None,
        "mismatch_kl_mean": float(f"{statistics.mean(mismatch):.4g}") if mismatch else None,
        "policy_lag_mean": round(statistics.mean(lags_v), 3) if lags_v else None,
        "on_policy_fraction": round(sum(v == 0 for v in lags_v) / len(lags_v), 3)
        if lags_v
        else None,
    }


def device_name(cfg: RunConfig) -> str:
    if cfg.trainer.device != "cpu" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()})"


def write_markdown(results: dict[str, Any]) -> Path:
    """``gpu.md``: the saved record (``common.save`` adds ``when``) as a short table."""
    f = results["figures"]
    rows = "\n".join(f"| `{k}` | {v} |" for k, v in f.items())
    path = RESULTS / f"{results['name']}.md"
    path.write_text(
        f"# gpu_bench: `{results['preset']}` preset, {results['steps']} steps\n\n"
        f"Device: {results['device']}; torch {results['torch']}; "
        f"{results['when']}; `{results['command']}`"
        f"{' (stopped by the wall-clock cap)' if results['capped'] else ''}.\n\n"
        f"| figure | value |\n|---|---|\n{rows}\n\n"
        "How each figure is computed: `benchmarks/gpu_bench.py`'s docstring.\n"
    )
    return path


def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="rlbus-gpu-bench-") as d:
        root = Path(args.data_dir) if args.data_dir else Path(d)
        root.mkdir(parents=True, exist_ok=True)
        run = start_run(args, root)
        paths = RunPaths(root, RUN)
        cfg = load_config(str(paths.config))
        log = asyncio.run(read_run(paths))
        params = n_params(cfg, paths)
        found = figures(log, swap_lags(paths), params, args.peak_tflops)
    return {
        "name": args.name,
        "preset": args.preset,
        "steps": args.steps,
        "warmup_steps": cfg.orchestrator.warmup.steps,
        "device": device_name(cfg),
        "torch": torch.__version__,
        **run,
        "figures": found,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="trainer steps (warm start included)")
    p.add_argument("--warmup-steps", type=int, default=5, help="SFT warm-start steps first")
    p.add_argument("--preset", default="gpu", help="preset name or TOML file")
    p.add_argument("--device", default=None, help="trainer and inference device (default: the preset's)")  # fmt: skip
    p.add_argument("--peak-tflops", type=float, default=989.0, help="peak dense bf16 TFLOP/s of the GPU")  # fmt: skip
    p.add_argument("--max-wall-s", type=float, default=420.0, help="wall-clock cap of the run")
    p.add_argument("--data-dir", default=None, help="keep the run here (default: a temporary dir)")  # fmt: skip
    p.add_argument("--name", default="gpu", help="results file name (benchmarks/results/NAME.json)")  # fmt: skip
    p.add_argument("overrides", nargs="*", help="more config overrides, dotted: trainer.lr=1e-4")
    return p.parse_args(argv)


if __name__ == "__main__":
    results = main(parse_args())
    print(json.dumps(results, indent=2))
    saved = save(results["name"], results)
    print("saved", saved, write_markdown(json.loads(saved.read_text())))
