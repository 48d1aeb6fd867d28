"""Where one decode step of the torch engine spends its device time, on a CUDA GPU.

For the Qwen3-0.6B-shaped model (128-token prompts, after 160 steps) and the `gpu`
preset's model (27-token prompts, after 8 steps), 256 rows each: the step as a CUDA graph
replay and eagerly (ms, mean of 20), and the CUDA kernels of one eager step by total
device time (torch profiler). Then whole ``generate`` calls at B=256 (the ``gpu`` model,
27 + 16 tokens; the Qwen3 shape, 128 + 256), distinct prompts and GRPO groups of 8, each
engine method's wall time per call (``calls``: ``_collect`` includes waiting for the
device; ``start`` holds ``_prefill``, ``_init_rows`` and ``copy_prefix``). Results:
``benchmarks/results/engine_cuda_profile.json``. Needs a GPU (the device time of a CPU
step is ``just bench-engine``'s business).

    python -m benchmarks.engine_profile
"""

from __future__ import annotations

import collections
import json
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.common import save
from benchmarks.engine_bench import build_model, prompts_for, requests
from roles.inference.engine import TorchEngine


def device_time(event: Any) -> float:
    return getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)


def profile_model(name: str, prompt: int, steps: int) -> dict[str, Any]:
    model = build_model(name).to("cuda", torch.bfloat16)
    eng = TorchEngine(
        model, None, stop_token_ids=[], max_batch_size=256, max_model_len=prompt + 300
    )
    for r in requests(prompts_for(256, prompt, model.config.vocab_size), 290, "p"):
        eng.add(r)
    for _ in range(steps):
        eng.step()
    b, span, filtered = eng.shape()
    res: dict[str, Any] = {"b": b, "span": span}
    with torch.inference_mode():
        graph = eng._graph((b, span, filtered))
        for label, fn in (
            ("graph", graph.replay),
            ("eager", lambda: eng._step_fn(b, span, filtered)),
        ):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            res[f"{label}_ms"] = round((time.perf_counter() - t) / 20 * 1e3, 3)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng._step_fn(b, span, filtered)
            torch.cuda.synchronize()
    kernels = sorted(prof.key_averages(), key=lambda e: -device_time(e))
    res["device_ms_total"] = round(sum(device_time(e) for e in kernels) / 1e3, 3)
    res["top"] = [(e.key[:70], e.count, round(device_time(e) / 1e3, 3)) for e in kernels[:14]]
    return res


TIMED = ("add", "start", "_prefill", "_init_rows", "_launch", "_collect", "_finish")


def call_breakdown(name: str, prompt: int, new: int, group: int, calls: int = 3) -> dict[str, Any]:
    """Wall time per ``generate`` call of 256 requests, and of each engine method in it."""
    model = build_model(name).to("cuda", torch.bfloat16)
    eng = TorchEngine(model, None, stop_token_ids=[], max_batch_size=256,
                      max_model_len=prompt + new + 4)  # fmt: skip
    prompts = prompts_for(256 // group, prompt, model.config.vocab_size)
    reqs = requests([p for p in prompts for _ in range(group)], new, "c")
    spent: collections.Counter[str] = collections.Counter()
    for obj, method in [(eng, m) for m in TIMED] + [(eng.runner, "copy_prefix")]:

        def timed(*a: Any, _f: Any = getattr(obj, method), _m: str = method, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return _f(*a, **k)
            finally:
                spent[_m] += time.perf_counter() - t

        setattr(obj, method, timed)

    def run() -> None:
        eng.slots.forget()
        eng.generate(reqs)

    run(), run()
    torch.cuda.synchronize()
    spent.clear()
    steps, t = eng.stats.steps, time.perf_counter()
    for _ in range(calls):
        run()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / calls
    return {"group": group, "wall_ms": round(wall * 1e3, 2), "tokens_per_s": round(256 * new / wall),
            "steps": (eng.stats.steps - steps) / calls,
            **{k: round(v / calls * 1e3, 2) for k, v in spent.most_common()}}  # fmt: skip


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("engine_profile needs a CUDA GPU")
    out = {"gpu": torch.cuda.get_device_name(), "models": {}}
    for name, prompt, steps in (("qwen3", 128, 160), ("gpu", 27, 8)):
        out["models"][name] = profile_model(name, prompt, steps)
        print(name, json.dumps(out["models"][name], indent=1), flush=True)
        torch.cuda.empty_cache()
    out["calls"] = {}
    for name, prompt, new in (("gpu", 27, 16), ("qwen3", 128, 256)):
        for group in (1, 8):
            out["calls"][f"{name}_g{group}"] = call_breakdown(name, prompt, new, group)
            print(name, json.dumps(out["calls"][f"{name}_g{group}"]), flush=True)
        torch.cuda.empty_cache()
    save("engine_cuda_profile", out)


if __name__ == "__main__":
    main()
