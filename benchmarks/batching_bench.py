"""Static vs continuous batching in the torch inference backend, same workload, one run.

One ``TorchEngine`` serves the default tiny model (``roles.lib.model.tiny.init_model``),
behind a ``TorchBackend`` first with ``continuous=False`` (today's static batches: a
batch runs until its longest row is done, new requests wait for it), then with
``continuous=True`` (requests join the running decode loop as rows free up). Each mode
answers the same closed loop: ``--clients`` concurrent clients, each sending generate
requests back to back until ``--requests`` have been sent; request ``i`` has a chat
prompt of varying length, temperature 1, seed ``i`` and ``max_completion_tokens``
drawn from ``--min-tokens``..``--max-tokens``. Per-request determinism makes both modes
produce the very same completions (checked), so the comparison is of scheduling alone.

Reported per mode, the median over ``--rounds`` (static and continuous in turn, so a
noisy neighbour slows both alike): requests/s, completion tokens/s, mean and p90
latency (submit to result), the share of wall time the decode loop was busy, and the
continuous/static ratios; saved to ``benchmarks/results/batching.json``. Torch threads
follow ``RLBUS_TORCH_THREADS`` (default 1). About a minute on 2 CPU cores:

    python -m benchmarks.batching_bench [--requests 1024] [--clients 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save
from roles.inference.torch_backend import TorchBackend, TorchEngine
from roles.inference.torch_setup import configure_torch_threads
from roles.lib.model.render import Renderer
from roles.lib.model.tiny import init_model
from schemas import GenerateRequest, GenerateResult, SamplingParams
from schemas.arrays import i32, pack_i32

WORDS = "the quick brown fox jumps over a lazy dog while seven cats count to ten".split()


def workload(renderer: Renderer, args: argparse.Namespace) -> list[GenerateRequest]:
    """The requests, fixed by ``--seed``: prompts of 1..12 words, spread budgets."""
    rng = random.Random(args.seed)
    reqs = []
    for i in range(args.requests):
        text = " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
        prompt = renderer.render_prompt([{"role": "user", "content": text}])
        budget = rng.randint(args.min_tokens, args.max_tokens)
        reqs.append(
            GenerateRequest(
                request_id=str(i),
                prompt_ids=pack_i32(prompt),
                sampling=SamplingParams(temperature=1.0, max_completion_tokens=budget),
                seed=i,
            )
        )
    return reqs


async def closed_loop(
    backend: TorchBackend, reqs: list[GenerateRequest], clients: int
) -> tuple[float, dict[str, GenerateResult], list[float]]:
    """Wall seconds, results by request id and latencies of ``clients`` closed-loop clients."""
    todo = iter(reqs)
    results: dict[str, GenerateResult] = {}
    latencies: list[float] = []

    async def client() -> None:
        for req in todo:  # a shared iterator: each request is sent once
            t0 = time.perf_counter()
            (res,) = await backend.generate([req])
            latencies.append(time.perf_counter() - t0)
            assert isinstance(res, GenerateResult), res
            results[req.request_id] = res

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(clients)))
    return time.perf_counter() - start, results, latencies


async def run_mode(
    engine: TorchEngine, reqs: list[GenerateRequest], continuous: bool, args: argparse.Namespace
) -> tuple[dict[str, Any], dict[str, GenerateResult]]:
    backend = TorchBackend(
        engine,
        max_batch_size=args.max_batch_size,
        batch_window_ms=args.window_ms,
        continuous=continuous,
    )
    await closed_loop(backend, reqs[: args.clients], args.clients)  # warm-up
    before = backend.stats()
    wall, results, lat = await closed_loop(backend, reqs, args.clients)
    stats = {k: v - before[k] for k, v in backend.stats().items()}
    await backend.close()
    tokens = sum(len(i32(r.completion_ids)) for r in results.values())
    return {
        "requests_per_s": round(len(results) / wall, 2),
        "completion_tokens_per_s": round(tokens / wall, 1),
        "latency_mean_s": round(statistics.mean(lat), 4),
        "latency_p90_s": round(statistics.quantiles(lat, n=10)[-1], 4),
        "wall_s": round(wall, 2),
        "completion_tokens": tokens,
        "busy_frac": round(stats["busy_s"] / wall, 3),
        "batches": int(stats["batches"]),
        "largest_batch": int(backend.batcher.stats.largest_batch),
    }, results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--min-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--max-batch-size", type=int, default=32)
    ap.add_argument("--window-ms", type=float, default=5.0)
    ap.add_argument("--rounds", type=int, default=3, help="static, continuous, ... in turn")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    threads = configure_torch_threads()
    with tempfile.TemporaryDirectory() as tmp:
        model = init_model(Path(tmp) / "tiny", seed=0)
        engine = TorchEngine.from_path(model["path"], device="cpu")
    reqs = workload(Renderer(engine.tokenizer), args)
    runs: dict[str, list[dict[str, Any]]] = {"static": [], "continuous": []}
    outputs: dict[str, dict[str, bytes]] = {}
    for r in range(args.rounds):  # in turn, so a noisy neighbour slows both alike
        for name in runs:
            m, results = asyncio.run(run_mode(engine, reqs, name == "continuous", args))
            runs[name].append(m)
            outputs[name] = {k: res.completion_ids for k, res in results.items()}
            print(f"round {r + 1} {name:10s} {m['requests_per_s']:7.1f} req/s  "
                  f"{m['completion_tokens_per_s']:7.0f} tok/s  latency mean "
                  f"{m['latency_mean_s'] * 1e3:5.0f} ms  p90 {m['latency_p90_s'] * 1e3:5.0f} ms  "
                  f"busy {m['busy_frac']:.0%}  batches {m['batches']}", flush=True)  # fmt: skip
    modes = {
        name: {k: statistics.median(m[k] for m in ms) for k in ms[0]} for name, ms in runs.items()
    }
    keys = ("requests_per_s", "completion_tokens_per_s", "latency_mean_s", "latency_p90_s")
    ratio = {k: round(modes["continuous"][k] / modes["static"][k], 3) for k in keys}
    same = outputs["static"] == outputs["continuous"]
    for name, m in modes.items():
        print(f"median {name:10s} {m['requests_per_s']:7.1f} req/s  "
              f"{m['completion_tokens_per_s']:7.0f} tok/s  latency mean "
              f"{m['latency_mean_s'] * 1e3:5.0f} ms  p90 {m['latency_p90_s'] * 1e3:5.0f} ms")  # fmt: skip
    print(f"continuous / static: {ratio}  same completions: {same}")
    path = save(
        "batching",
        {"model_params": model["params"], "torch_threads": threads,
         "workload": {k: getattr(args, k) for k in
                      ("requests", "clients", "min_tokens", "max_tokens", "max_batch_size",
                       "window_ms", "rounds", "seed")},
         "modes": modes, "rounds": runs, "continuous_over_static": ratio,
         "same_completions": same},
    )  # fmt: skip
    print(f"results: {path}")


if __name__ == "__main__":
    main()
