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

With ``--recorded RUN`` it times ``TrainerCore.train_step`` on a run's own batches
instead, with ``trainer.shared_prefix`` on and off, on 1 and 2 threads (results in
``trainer_recorded.json``):

    python -m benchmarks.trainer_bench --recorded demo --data-dir runs --steps 30 --rounds 3

With ``--device cuda`` it measures the one-GPU trainer instead, on the ``--preset``'s
model (``gpu``: 99 M parameters) and reverse-text-shaped GRPO batches of ``--samples``
(512, ~17k tokens): the core as the preset runs it, the core with ``trainer.compile``,
and a plain loop (bf16 autocast, cross-entropy, fused AdamW) eager and compiled, on the
same micro-batches: tokens/s and MFU = 6 x params x tokens/s over ``--peak-tflops``
(989 = an H100/H200 SXM's dense bf16), results in ``trainer_cuda.json``:

    python -m benchmarks.trainer_bench --device cuda --samples 512 --steps 6 --rounds 2
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from benchmarks.common import run_events, save
from configs import load_config
from roles.lib.model import materialize_model
from roles.lib.model.loading import compile_blocks, load_model
from roles.lib.model.tiny import build_tiny_model, count_params
from roles.trainer.core import TrainerCore
from roles.trainer.group import make_trainer, start_ranks
from schemas import BatchAssembled, Sample, batch_id
from schemas.arrays import pack_f32, pack_i32, pack_mask
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
    ap.add_argument("--preset", default="gpu", help="with --device cuda: the model's preset")
    ap.add_argument("--single", action="store_true", help="the --device cuda comparison, here")
    ap.add_argument("--name", default=None, help="results file stem")
    ap.add_argument("--set", nargs="*", default=[], help="with --device cuda: config overrides")
    ap.add_argument("--only", nargs="*", default=[], help="with --device cuda: set-ups to run")
    ap.add_argument(
        "--recorded",
        default=None,
        metavar="RUN",
        help="time train_step on RUN's recorded batches, prompts shared or not",
    )
    ap.add_argument("--data-dir", type=Path, default=Path("runs"), help="with --recorded")
    args = ap.parse_args()
    if args.recorded:
        return recorded(args.data_dir, args.recorded, args.steps, args.rounds)
    if args.device != "cpu" or args.single:
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


def recorded(data_dir: Path, run: str, steps: int, rounds: int) -> None:
    """``TrainerCore.train_step`` on a run's own batches (its ``batch.assembled`` events,
    from its initial model, 5 warm-up steps), with ``trainer.shared_prefix`` on and off,
    on 1 and 2 threads, interleaved over ``rounds``: seconds per step and tokens run."""
    from bus.subjects import Topic
    from roles.cli.common import run_paths

    paths = run_paths(run, data_dir)
    log = run_events(paths.dir, {"batches": (Topic.BATCH_ASSEMBLED, BatchAssembled)})
    found = sorted(log["batches"], key=lambda b: b.step)
    cfg = load_config(str(paths.dir / "config.toml"), ["trainer.device=cpu"])
    model = materialize_model(cfg, cfg.model.path, paths.dir)
    timed: dict[str, list[float]] = {}
    computed: dict[str, float] = {}
    for _ in range(rounds):
        for shared in (False, True):
            for threads in (1, 2):
                name = f"{'shared' if shared else 'whole rows'}, {threads} thread(s)"
                c = cfg.model_copy(deep=True)
                c.trainer.shared_prefix = shared
                core = TrainerCore(c, model)
                core.threads = threads
                for b in found[:5]:
                    core.train_step(b)
                t0 = time.perf_counter()
                ms = [core.train_step(b) for b in found[5 : 5 + steps]]
                timed.setdefault(name, []).append((time.perf_counter() - t0) / len(ms))
                computed[name] = statistics.fmean(m["computed_tokens"] for m in ms)
    summary = {
        name: {
            "s_per_step": round(statistics.median(v), 4),
            "computed_tokens": round(computed[name]),
        }
        for name, v in timed.items()
    }
    for name, row in summary.items():
        print(f"{name:26s} {row['s_per_step']:.4f} s/step  {row['computed_tokens']} tokens run")
    print(
        f"results: {save('trainer_recorded', {'run': run, 'steps': steps, 'rounds': rounds, 'setups': summary})}"
    )


def reverse_text_batch(step: int, n: int, vocab: int) -> BatchAssembled:
    """GRPO batch ``step`` shaped like the ``gpu`` preset's reverse-text ones: a ~26-token
    prompt, a 4-10 token completion (~33 tokens a sample, ~17k a 512-sample batch, as
    the issue's 137.8k tokens/s baseline trained), logprobs near a random model's."""
    rng = np.random.default_rng(step)
    samples = []
    for i in range(n):
        p, c = int(rng.integers(22, 31)), int(rng.integers(4, 11))
        adv = float(rng.normal())
        samples.append(Sample(
            rollout_id=f"s{step}-{i}", branch=0, env="reverse-text", task_index=i,
            group_id=f"g{step}-{i // 16}",
            token_ids=pack_i32(rng.integers(4, vocab, p + c).tolist()),
            mask=pack_mask([0] * p + [1] * c),
            logprobs=pack_f32([0.0] * p + (-math.log(vocab) + rng.normal(0, 0.1, c)).tolist()),
            temperatures=pack_f32([0.0] * p + [1.0] * c),
            advantages=pack_f32([0.0] * p + [adv] * c),
        ))  # fmt: skip
    return BatchAssembled(
        run="bench", event_id=batch_id("bench", step), step=step, samples=samples,
        policy_version=step - 1, num_tokens=sum(len(s) for s in samples), phase="rl",
    )  # fmt: skip


class PlainLoop:
    """The reference: the same model, micro-batches and device, trained the way a
    hand-written loop would (bf16 autocast over fp32 weights, cross-entropy on the
    sampled tokens, fused AdamW; no determinism, no stats, no checks)."""

    def __init__(self, model_dir: Path, cfg: Any, compiled: bool = False):
        import torch

        # Packing and model loading, nothing else: whole rows (a shared micro-batch's rows
        # are the samples' ends, which only the core's two-forward path can train).
        whole = cfg.trainer.model_copy(update={"shared_prefix": False})
        self.core = TrainerCore(cfg.model_copy(update={"trainer": whole}), model_dir)
        self.model = self.core.model
        if compiled:
            compile_blocks(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=True)
        self.step = 0

    def train_step(self, batch: BatchAssembled) -> dict[str, float]:
        import torch

        start = time.perf_counter()
        mbs, _ = self.core.micro_batches(batch)
        dev = self.core.device
        for mb in mbs:
            ids = mb.input_ids.to(dev)
            with torch.autocast(torch.device(dev).type, dtype=torch.bfloat16):
                logits = self.model(input_ids=ids, use_cache=False).logits
            targets = torch.where(mb.loss.mask.to(dev), mb.loss.targets.to(dev), -100)
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().flatten(0, 1), targets.flatten()
            )
            loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step = batch.step
        if dev.startswith("cuda"):
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        return {"tokens_per_s": batch.num_tokens / elapsed, "step_s": elapsed}


def cuda(args: argparse.Namespace) -> None:
    """The one-GPU trainer against a plain loop on the same model and batches, each set-up
    in turn for ``--steps`` steps per round (interleaved): the core as the preset runs
    it, the core with ``trainer.compile``, and the plain loop eager and compiled."""
    import torch

    cfg = load_config(args.preset, [f'trainer.device="{args.device}"', *args.set])
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = materialize_model(cfg, cfg.model.path, Path(tmp))
        model = load_model(model_dir)
        params, vocab = count_params(model), int(model.config.vocab_size)
        del model
        compiled = cfg.model_copy(
            update={"trainer": cfg.trainer.model_copy(update={"compile": True})}
        )
        setups: dict[str, Any] = {
            "core": lambda: TrainerCore(cfg, model_dir),
            "core, trainer.compile": lambda: TrainerCore(compiled, model_dir),
            "plain loop": lambda: PlainLoop(model_dir, cfg),
            "plain loop, compiled": lambda: PlainLoop(model_dir, cfg, compiled=True),
        }
        names = [n for n in setups if not args.only or any(o in n for o in args.only)]
        trainers = {n: setups[n]() for n in names}
        rates: dict[str, list[float]] = {n: [] for n in names}
        first_s: dict[str, float] = {}
        step = 0
        for r in range(args.rounds):
            for name in names:
                for k in range(args.steps):
                    batch = reverse_text_batch(step + k + 1, args.samples, vocab)
                    trainer = trainers[name]
                    m = trainer.train_step(msgspec.structs.replace(batch, step=trainer.step + 1))
                    if r == 0 and k == 0:
                        first_s[name] = m["step_s"]  # compiles (or warms up) here
                    else:
                        rates[name].append(m["tokens_per_s"])
                print(f"round {r + 1} {name:24s} {statistics.median(rates[name] or [0]):9.0f} "
                      f"tokens/s", flush=True)  # fmt: skip
            step += args.steps
    peak = args.peak_tflops * 1e12
    summary = {}
    base = statistics.median(rates["core"]) if "core" in rates else None
    for name in names:
        tps = statistics.median(rates[name])
        summary[name] = {
            "tokens_per_s": round(tps, 1),
            "mfu": round(6 * params * tps / peak, 4),
            "first_step_s": round(first_s[name], 2),
            **({"vs_core": round(tps / base, 3)} if base else {}),
        }
        print(f"{name:24s} {tps:9.0f} tokens/s  MFU {summary[name]['mfu']:.1%}  "
              f"first step {first_s[name]:.1f} s")  # fmt: skip
    path = save(
        args.name or ("trainer_cuda" if args.device.startswith("cuda") else "trainer_single"),
        {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
         "torch": torch.__version__,
         "preset": args.preset, "overrides": args.set, "model_params": params, "samples_per_batch": args.samples,
         "steps": args.steps, "rounds": args.rounds, "peak_tflops": args.peak_tflops,
         "setups": summary},
    )  # fmt: skip
    print(f"results: {path}")


if __name__ == "__main__":
    main()
