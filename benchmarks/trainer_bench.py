"""Trainer throughput on 1 vs 2 ranks (CPU, gloo, FSDP2), side by side in one run.

Three set-ups train the same synthetic reverse-text batches on the same model, in turn,
``--rounds`` times (interleaved, so a noisy neighbour hits all of them alike):

- ``1 rank x 1 thread``: today's single-process trainer (``RLBUS_TORCH_THREADS=1``);
- ``1 rank x 2 threads``: the same process given both cores of intra-op threads;
- ``2 ranks x 1 thread``: ``trainer.world_size = 2`` (each rank trains half the
  micro-batches; gradients are reduce-scattered, weights gathered for publishing).

Reported: trained tokens/s per set-up (median over rounds of the steady steps, the
first step is warm-up), the ratio to 1 rank x 1 thread, and the cost of gathering the
full weights (what publishing a step adds on 2 ranks).

    python -m benchmarks.trainer_bench [--steps 6] [--rounds 2] [--hidden 256]

With ``--device cuda`` it measures the one-GPU trainer alone instead (bf16 autocast over
fp32 weights; ranks need a GPU each): tokens/s and MFU = 6 x params x tokens/s over
``--peak-tflops`` (989 = an H100 SXM's dense bf16), results in ``trainer_cuda.json``:

    python -m benchmarks.trainer_bench --device cuda --hidden 768 --layers 12 --samples 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save
from configs import load_config
from roles.lib.model.loading import load_model
from roles.lib.model.tiny import build_tiny_model, count_params
from roles.trainer.group import make_trainer, start_ranks
from tests.unit.test_trainer_core import synthetic_batch

SETUPS = {"1 rank x 1 thread": (1, 1), "1 rank x 2 threads": (1, 2), "2 ranks x 1 thread": (2, 1)}


def run_setup(
    model_dir: Path, ranks: int, threads: int, steps: int, samples: int, device: str = "cpu"
) -> dict[str, Any]:
    os.environ["RLBUS_TORCH_THREADS"] = str(threads)  # read by every rank at start
    seq_len, mbs = (1024, 4) if device == "cpu" else (16384, 256)
    cfg = load_config(
        "smoke",
        [f"trainer.device={device}", f"trainer.seq_len={seq_len}",
         f"trainer.micro_batch_size={mbs}", f"trainer.world_size={ranks}"],
    )  # fmt: skip
    core = make_trainer(cfg, model_dir, start_ranks(cfg, model_dir))
    try:
        rates, gathers = [], []
        for step in range(1, steps + 1):
            metrics = core.train_step(synthetic_batch("bench", step, n_samples=samples))
            t0 = time.perf_counter()
            core.weights_bytes()
            if step > 1:  # the first step pays for lazy initialisation
                rates.append(metrics["tokens_per_s"])
                gathers.append(time.perf_counter() - t0)
        return {"tokens_per_s": statistics.median(rates), "gather_s": statistics.median(gathers)}
    finally:
        core.close()


def build_model(tmp: Path, args: argparse.Namespace) -> tuple[Path, int]:
    """The benchmark's model (64-wide heads, a 4x MLP) and its parameter count."""
    model_dir = build_tiny_model(
        tmp / "model", seed=0, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=max(1, args.hidden // 64), intermediate_size=4 * args.hidden,
    )  # fmt: skip
    return model_dir, count_params(load_model(model_dir))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--samples", type=int, default=32, help="samples per batch")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    args = ap.parse_args()
    if args.device != "cpu":
        return cuda(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, params = build_model(Path(tmp), args)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in SETUPS}
        for r in range(args.rounds):
            for name, (ranks, threads) in SETUPS.items():
                result = run_setup(model_dir, ranks, threads, args.steps, args.samples)
                runs[name].append(result)
                print(f"round {r + 1} {name:20s} {result['tokens_per_s']:9.0f} tokens/s  "
                      f"gather {result['gather_s'] * 1e3:6.1f} ms", flush=True)  # fmt: skip
    base = statistics.median(x["tokens_per_s"] for x in runs["1 rank x 1 thread"])
    summary = {}
    for name, results in runs.items():
        tps = statistics.median(x["tokens_per_s"] for x in results)
        summary[name] = {
            "tokens_per_s": round(tps, 1),
            "vs_1_rank_1_thread": round(tps / base, 3),
            "gather_ms": round(1e3 * statistics.median(x["gather_s"] for x in results), 2),
        }
        print(f"{name:20s} {tps:9.0f} tokens/s  x{tps / base:.2f}")
    path = save(
        "trainer",
        {"model_params": params, "samples_per_batch": args.samples, "steps": args.steps,
         "rounds": args.rounds, "setups": summary},
    )  # fmt: skip
    print(f"results: {path}")


def cuda(args: argparse.Namespace) -> None:
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        model_dir, params = build_model(Path(tmp), args)
        result = run_setup(model_dir, 1, 1, args.steps, args.samples, args.device)
    tps = result["tokens_per_s"]
    mfu = 6 * params * tps / (args.peak_tflops * 1e12)
    print(f"{params / 1e6:.1f} M params  {tps:9.0f} tokens/s  MFU {mfu:.1%}  "
          f"gather {result['gather_s'] * 1e3:.1f} ms")  # fmt: skip
    path = save(
        "trainer_cuda",
        {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
         "model_params": params, "samples_per_batch": args.samples,
         "tokens_per_s": round(tps, 1), "mfu": round(mfu, 4), "peak_tflops": args.peak_tflops,
         "gather_ms": round(result["gather_s"] * 1e3, 2)},
    )  # fmt: skip
    print(f"results: {path}")


if __name__ == "__main__":
    main()
