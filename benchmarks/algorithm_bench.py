"""Algorithm benchmark: how fast an attached worker catches up, and what loss channels cost.

1. Catch-up: ``--n`` TraceCompleted events (groups of 8, tests/samples.py traces) on a
   temporary embedded server. Timed side by side, best of ``--rounds`` alternating
   rounds: reading and decoding the traces alone (``read_log``), and an algorithm
   worker's start-up fold (``AlgorithmWorker.catch_up``: read, group, score, publish one
   ``SamplesScored`` per group) for grpo and echo. The ratio says what scoring adds to
   reading the log, i.e. how fast ``rlbus algorithm attach --from-start`` catches up.
2. Channels: one trainer step (``TrainerCore.train_step``, the smoke preset's tiny model)
   on the same 64 samples carrying the rl channel only, then rl + ce + ref_kl; median of
   ``--steps`` steps each, alternating.

    python -m benchmarks.algorithm_bench [--n 4000] [--rounds 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from benchmarks.common import save
from bus.reader import read_log
from bus.runtime import Bus
from bus.server import EmbeddedServer
from bus.subjects import Topic
from roles.algorithm import create
from roles.algorithm.core import ScoringCore
from roles.algorithm.role import AlgorithmWorker
from schemas import BatchAssembled, Sample, TraceCompleted, arrays
from tests.samples import every_event, trace

GROUP = 8


def traces(run: str, n: int) -> list[TraceCompleted]:
    (template,) = [e for e in every_event(run) if isinstance(e, TraceCompleted)]
    out = []
    for i in range(n):
        t = trace(run, rollout=f"r{i}", n_tokens=24)
        t = msgspec.structs.replace(
            t, group_id=f"g{i // GROUP}", sample_index=i % GROUP, reward=(i * 7 % 10) / 10
        )
        out.append(msgspec.structs.replace(template, event_id=f"t{i}", group_size=GROUP, trace=t))
    return out


async def bench_catch_up(n: int, rounds: int) -> dict[str, Any]:
    run = "algobench"
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedServer(Path(tmp) / "nats") as server:
        bus = await Bus.connect(server.url, run=run, producer="bench")
        await bus.ensure_stream()
        await bus.publish_many(traces(run, n))
        for r in range(rounds):
            t = time.perf_counter()
            count = 0
            async for _ in read_log(bus, [(Topic.TRACE_COMPLETED, None)], (TraceCompleted,)):
                count += 1
            assert count == n
            best["read_log"] = min(best.get("read_log", 1e9), time.perf_counter() - t)
            for name in ("grpo", "echo"):
                worker = AlgorithmWorker(bus, "bench", ScoringCore(f"{name}-{r}", create(name)))
                t = time.perf_counter()
                await worker.catch_up()
                assert worker.scored_total == n // GROUP
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t)
        await bus.close()
    out: dict[str, Any] = {"traces": n, "groups": n // GROUP, "rounds": rounds}
    for k, v in best.items():
        out[f"{k}_s"] = round(v, 3)
        out[f"{k}_traces_per_s"] = round(n / v)
    for k in ("grpo", "echo"):
        out[f"{k}_vs_read_log"] = round(best["read_log"] / best[k], 3)
    return out


def batch(channels: bool, n: int = 64, length: int = 48, seed: int = 0) -> BatchAssembled:
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(n):
        ids = rng.integers(4, 60, length)  # inside the char vocabulary
        sampled = np.arange(length) >= length // 2
        lps = np.where(sampled, -rng.random(length), 0).astype(np.float32)
        extra: dict[str, Any] = {}
        if channels:
            tool = (np.arange(length) >= length // 4) & ~sampled
            extra = {
                "sft_mask": arrays.pack_mask(tool),
                "ce_weights": (tool * np.float32(0.1)).astype(np.float32).tobytes(),
                "ref_weights": (sampled * np.float32(1.0)).astype(np.float32).tobytes(),
                "ref_logprobs": (lps - 0.2).astype(np.float32).tobytes(),
            }
        samples.append(Sample(
            rollout_id=f"r{i}", branch=0, env="e", task_index=i, group_id=f"g{i}",
            token_ids=arrays.pack_i32(ids), mask=arrays.pack_mask(sampled), logprobs=lps.tobytes(),
            temperatures=np.ones(length, np.float32).tobytes(),
            advantages=(sampled * np.float32(rng.normal())).astype(np.float32).tobytes(), **extra,
        ))  # fmt: skip
    return BatchAssembled(run="b", step=1, samples=samples, policy_version=0)


def bench_channels(steps: int) -> dict[str, Any]:
    from configs import load_config
    from roles.lib.model.loading import ensure_tiny_model
    from roles.trainer.core import TrainerCore

    cfg = load_config("smoke")
    times: dict[str, list[float]] = {"rl_only": [], "three_channels": []}
    with tempfile.TemporaryDirectory() as tmp:
        sizes = cfg.model.tiny.model_dump(exclude={"init_seed"})
        model_dir = ensure_tiny_model(tmp, sizes, seed=0)
        cores = {k: TrainerCore(cfg, model_dir) for k in times}
        batches = {"rl_only": batch(False), "three_channels": batch(True)}
        for s in range(1, steps + 1):
            for k, core in cores.items():
                b = msgspec.structs.replace(batches[k], step=s)
                t = time.perf_counter()
                core.train_step(b)
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v[1:]) for k, v in times.items()}  # the first step warms up
    return {
        "samples": 64, "tokens_per_sample": 48, "steps": steps,
        **{f"{k}_step_ms": round(v * 1000, 2) for k, v in med.items()},
        "three_channels_vs_rl_only": round(med["three_channels"] / med["rl_only"], 3),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    results = {"catch_up": asyncio.run(bench_catch_up(args.n, args.rounds)),
               "channels": bench_channels(args.steps)}  # fmt: skip
    path = save("algorithm_bench", results)
    print(msgspec.json.format(msgspec.json.encode(results)).decode())
    print("wrote", path)


if __name__ == "__main__":
    main()
