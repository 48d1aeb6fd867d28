"""Trainer replay speed against the run it replays.

Runs ``rlbus up -c smoke`` once for ``--steps`` steps (warm start and evals included, as
a user runs it), then replays its trainer from the log in this process (read the log,
find and verify the initial weights, build the CPU trainer, re-train every batch and
compare every step) and reports: the original run's wall time (the whole ``rlbus up``),
its training span (first ``batch.assembled`` to last ``weights.published``, producer
clocks), the trainer's own compute (sum of ``step_s``), and the replay's times (the
one-off torch/transformers import reported apart); speed-ups are original / replay
total. Replay must also reproduce the run (it is asserted).

    python -m benchmarks.replay_bench [--steps 20]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import save
from bus.runtime import Bus
from bus.server import EmbeddedServer
from replay.portable import locate_model_dir
from replay.trainer import make_core, read_trainer_log, replay_steps

RUN = "bench"


def record(root: Path, steps: int) -> float:
    cmd = [sys.executable, "-m", "roles.cli", "up", "-c", "smoke", "--no-view", "--run", RUN,
           f"bus.data_dir={root}", f"max_steps={steps}"]  # fmt: skip
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"rlbus up failed:\n{out.stdout[-3000:]}")
    return time.perf_counter() - start


async def replay(root: Path) -> dict[str, Any]:
    t_import = time.perf_counter()
    from transformers import AutoModelForCausalLM  # noqa: F401

    import roles.trainer.core  # noqa: F401 - torch and transformers: paid once per process

    t0 = time.perf_counter()
    t_import = t0 - t_import
    with EmbeddedServer(root / RUN / "nats") as server:
        bus = await Bus.connect(server.url, run=RUN, producer="bench")
        try:
            log = await read_trainer_log(bus)
            model_dir = await locate_model_dir(bus, log.started, log.config(), root / RUN)
        finally:
            await bus.close()
    t_read = time.perf_counter() - t0
    core = make_core(log.config(1), model_dir)
    t_core = time.perf_counter() - t0 - t_read
    result = replay_steps(core, log.batches, log.recorded, config_for=log.config)
    if not result.ok or len(result.steps) != len(log.batches):
        raise AssertionError(f"replay did not reproduce the run: {result.divergence}")
    trainer = [log.recorded[s].metrics for s in sorted(log.recorded)]
    batch_ns = [b.ts_ns for b in log.batches]
    return {
        "steps": len(result.steps),
        "tokens": sum(int(m.get("tokens", 0)) for m in trainer),
        "original_trainer_compute_s": round(sum(m.get("step_s", 0.0) for m in trainer), 3),
        "original_first_batch_ns": min(batch_ns),
        "replay_imports_s": round(t_import, 3),
        "replay_read_log_and_weights_s": round(t_read, 3),
        "replay_build_trainer_s": round(t_core, 3),
        "replay_train_and_compare_s": round(result.wall_s, 3),
        "replay_total_s": round(time.perf_counter() - t0, 3),  # imports excluded
    }


async def training_span(root: Path, first_batch_ns: int) -> float:
    from bus.reader import read_log
    from bus.subjects import Topic
    from schemas import WeightsPublished

    with EmbeddedServer(root / RUN / "nats") as server:
        bus = await Bus.connect(server.url, run=RUN, producer="bench")
        try:
            last = max([e.ts_ns async for e in read_log(bus, [(Topic.WEIGHTS_PUBLISHED, None)], (WeightsPublished,))])  # fmt: skip
        finally:
            await bus.close()
    return (last - first_batch_ns) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlbus-replay-bench-") as tmp:
        root = Path(tmp)
        wall = record(root, args.steps)
        r = asyncio.run(replay(root))
        span = asyncio.run(training_span(root, r.pop("original_first_batch_ns")))
    results = {
        "preset": "smoke", **r,
        "original_run_wall_s": round(wall, 2),
        "original_training_span_s": round(span, 3),
        "speedup_vs_run_wall": round(wall / r["replay_total_s"], 1),
        "speedup_vs_training_span": round(span / r["replay_total_s"], 2),
        "replay_steps_per_s": round(r["steps"] / r["replay_train_and_compare_s"], 1),
    }  # fmt: skip
    print(save("replay", results).read_text())


if __name__ == "__main__":
    main()
