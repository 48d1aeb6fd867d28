"""The whole learning loop, synchronous vs one step asynchronous, side by side.

Runs ``rlbus up`` twice on the same preset (RL only: no warm start, no eval, so both
runs do the same work), with ``orchestrator.max_async_level`` = 0 and = 1, and reads
each run's log afterwards: steps/s, rollouts/s, trainer tokens/s and the trainer's
idle fraction (time waiting for a batch over time waiting + training). The async
speed-up is the ratio of steps/s.

    python -m benchmarks.loop_bench [--steps 30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save
from bus.reader import read_log
from bus.runtime import Bus
from bus.server import EmbeddedServer
from bus.subjects import Topic
from schemas import MetricsReported, TraceCompleted, WeightsPublished


def run_once(root: Path, async_level: int, steps: int) -> str:
    run = f"async{async_level}"
    cmd = [
        sys.executable, "-m", "roles.cli", "up", "--no-view", "--run", run, f"bus.data_dir={root}",
        f"max_steps={steps}", "orchestrator.warmup.steps=0", "orchestrator.eval.interval=0",
        f"orchestrator.max_async_level={async_level}", "orchestrator.max_off_policy_steps=2",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"run {run} failed:\n{out.stdout[-3000:]}")
    return run


async def measure(root: Path, run: str) -> dict[str, float]:
    with EmbeddedServer(root / run / "nats") as server:
        bus = await Bus.connect(server.url, run=run, producer="bench")
        try:
            trainer = [
                e
                async for e in read_log(
                    bus, [(Topic.METRICS_REPORTED, "trainer")], (MetricsReported,)
                )
            ]
            weights = [
                e
                async for e in read_log(bus, [(Topic.WEIGHTS_PUBLISHED, None)], (WeightsPublished,))
            ]
            traces = [
                e async for e in read_log(bus, [(Topic.TRACE_COMPLETED, None)], (TraceCompleted,))
            ]
        finally:
            await bus.close()
    t0 = min(t.ts_ns for t in traces)
    t1 = max(w.ts_ns for w in weights)
    wall = (t1 - t0) / 1e9
    wait = sum(m.values.get("wait_s", 0.0) for m in trainer)
    busy = sum(m.values.get("step_s", 0.0) for m in trainer)
    tokens = sum(m.values.get("tokens", 0.0) for m in trainer)
    return {
        "steps": len(weights),
        "wall_s": round(wall, 2),
        "steps_per_s": round(len(weights) / wall, 3),
        "rollouts_per_s": round(len(traces) / wall, 1),
        "trainer_tokens_per_s": round(tokens / busy, 1) if busy else 0.0,
        "trainer_idle_fraction": round(wait / (wait + busy), 3) if wait + busy else 0.0,
    }


def main(steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        results = {}
        for level in (0, 1):
            t = time.perf_counter()
            run = run_once(root, level, steps)
            results[f"max_async_level_{level}"] = asyncio.run(measure(root, run)) | {
                "process_wall_s": round(time.perf_counter() - t, 1)
            }
    a0, a1 = results["max_async_level_0"], results["max_async_level_1"]
    results["async_speedup_steps_per_s"] = round(a1["steps_per_s"] / a0["steps_per_s"], 3)
    return {"steps": steps, **results}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    results = main(p.parse_args().steps)
    print(json.dumps(results, indent=2))
    print("saved", save("loop", results))
