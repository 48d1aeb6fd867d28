"""Where one decode step of the torch engine spends its device time, on a CUDA GPU.

For the Qwen3-0.6B-shaped model (128-token prompts, after 160 steps) and the `gpu`
preset's model (27-token prompts, after 8 steps), 256 rows each: the step as a CUDA graph
replay and eagerly (ms, mean of 20), and the CUDA kernels of one eager step by total
device time (torch profiler). Results: ``benchmarks/results/engine_cuda_profile.json``.
Needs a GPU (the device time of a CPU step is ``just bench-engine``'s business).

    python -m benchmarks.engine_profile
"""

from __future__ import annotations

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


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("engine_profile needs a CUDA GPU")
    out = {"gpu": torch.cuda.get_device_name(), "models": {}}
    for name, prompt, steps in (("qwen3", 128, 160), ("gpu", 27, 8)):
        out["models"][name] = profile_model(name, prompt, steps)
        print(name, json.dumps(out["models"][name], indent=1), flush=True)
        torch.cuda.empty_cache()
    save("engine_cuda_profile", out)


if __name__ == "__main__":
    main()
