"""LoRA against full fine-tuning: memory, trained tokens/s and bytes published per step.

Each set-up trains the same synthetic reverse-text batches on the same model in a fresh
process of its own (so its peak memory is its own), in turn, ``--rounds`` times
(interleaved, so a noisy neighbour hits both alike):

- ``full``: today's trainer, every weight trained (AdamW moments for all of them);
- ``lora``: ``trainer.lora = {rank, alpha}`` on the seven projections (peft): the base
  frozen, only the adapters trained, and published.

Reported per model and set-up (medians over rounds): trained tokens/s over the steady
steps (the first pays for lazy initialisation), the process's peak resident memory, the
trainer's state in bytes (weights, AdamW moments and trainable-weight gradients as
tensors), the bytes one published version takes and the time to make them (serialise +
digest), and the time a serving model takes to load that version (digest, decode, and
for LoRA the merge into its base weights: ``roles.lib.model.weights.load_state_bytes``).

    python -m benchmarks.lora_bench [--rounds 2] [--steps 6] [--rank 16]

Results: ``benchmarks/results/lora.json`` and ``lora.md``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, save

# (name, hidden, layers): the default preset's tiny model, and a wider, deeper one.
MODELS = (("default (tiny)", 128, 2), ("wide (512 x 4)", 512, 4))
SETUPS = ("full", "lora")


def measure(model_dir: Path, setup: str, steps: int, samples: int, rank: int) -> dict[str, Any]:
    """One set-up in this process (run as a child by ``main``)."""
    import torch

    from configs import load_config
    from roles.lib.model.loading import load_model
    from roles.lib.model.weights import digest, load_state_bytes
    from roles.trainer.core import TrainerCore
    from tests.unit.test_trainer_core import synthetic_batch

    overrides = ["trainer.device=cpu", "trainer.seq_len=1024", "trainer.micro_batch_size=4"]
    if setup == "lora":
        overrides.append(f"trainer.lora={{rank={rank}, alpha={2 * rank}}}")
    core = TrainerCore(load_config("smoke", overrides), model_dir)
    rates, make_s, load_s, sizes = [], [], [], []
    served = load_model(model_dir, dtype="float32", device="cpu")
    for step in range(1, steps + 1):
        metrics = core.train_step(synthetic_batch("bench", step, n_samples=samples))
        t0 = time.perf_counter()
        blob = core.weights_bytes()
        d = digest(blob)
        t1 = time.perf_counter()
        load_state_bytes(served, blob, d)
        t2 = time.perf_counter()
        if step > 1:
            rates.append(metrics["tokens_per_s"])
            make_s.append(t1 - t0)
            load_s.append(t2 - t1)
        sizes.append(len(blob))
    params = list(core.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    moments = [t for s in core.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    state_bytes = sum(t.numel() * t.element_size() for t in params + trainable + moments)
    return {
        "tokens_per_s": statistics.median(rates),
        "publish_bytes": statistics.median(sizes),
        "make_ms": 1e3 * statistics.median(make_s),
        "serve_load_ms": 1e3 * statistics.median(load_s),
        "state_mb": state_bytes / 1e6,
        "params": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in trainable),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3,
    }


def child(model_dir: Path, setup: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.lora_bench", "--one", setup, "--model-dir",
           str(model_dir), "--steps", str(args.steps), "--samples", str(args.samples),
           "--rank", str(args.rank)]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def table(results: dict[str, dict[str, dict[str, Any]]], rank: int) -> str:
    lines = [
        f"# LoRA (rank {rank}, alpha {2 * rank}, seven projections) vs full fine-tuning",
        "",
        "| model | set-up | trainable / params | tokens/s | peak RSS MB | trainer state MB "
        "| bytes published per step | make ms | serving load ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, setups in results.items():
        for setup, r in setups.items():
            lines.append(
                f"| {model} | {setup} | {int(r['trainable']):,} / {int(r['params']):,} "
                f"| {r['tokens_per_s']:,.0f} ({r['tokens_per_s_ratio']:.2f}x) "
                f"| {r['peak_rss_mb']:,.0f} | {r['state_mb']:.1f} "
                f"| {int(r['publish_bytes']):,} ({r['publish_bytes_ratio']:.3f}x) "
                f"| {r['make_ms']:.1f} | {r['serve_load_ms']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--samples", type=int, default=32, help="samples per batch")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--one", choices=SETUPS, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args.model_dir, args.one, args.steps, args.samples, args.rank)))
        return
    from roles.lib.model.tiny import build_tiny_model

    results: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, hidden, layers in MODELS:
            model_dir = build_tiny_model(
                Path(tmp) / f"h{hidden}", seed=0, hidden_size=hidden, num_layers=layers,
                num_heads=max(1, hidden // 64), intermediate_size=2 * hidden,
            )  # fmt: skip
            runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETUPS}
            for r in range(args.rounds):
                for setup in SETUPS:
                    out = child(model_dir, setup, args)
                    runs[setup].append(out)
                    print(f"{name} round {r + 1} {setup:4s} {out['tokens_per_s']:8.0f} tok/s "
                          f"rss {out['peak_rss_mb']:6.0f} MB  publish {out['publish_bytes']:>10,} B",
                          flush=True)  # fmt: skip
            med = {
                s: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for s, rs in runs.items()
            }
            for s in SETUPS:
                med[s]["tokens_per_s_ratio"] = med[s]["tokens_per_s"] / med["full"]["tokens_per_s"]
                med[s]["publish_bytes_ratio"] = (
                    med[s]["publish_bytes"] / med["full"]["publish_bytes"]
                )
            results[name] = med
    save("lora", {"rank": args.rank, "rounds": args.rounds, "steps": args.steps,
                  "samples_per_batch": args.samples, "models": results})  # fmt: skip
    md = table(results, args.rank)
    (RESULTS / "lora.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
