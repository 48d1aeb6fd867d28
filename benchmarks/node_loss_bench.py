"""A default-preset run on a three-node loopback JetStream cluster (`rlbus up --cluster
3`, three replicas) with the node that leads the run's stream killed (kill -9) mid-run;
the launcher restarts it from its store. Reported: steps reached, the time until the
run had three more steps after the kill (against the median step time), and, from the
log, traces lost, traces twice, samples trained twice, batches and weights missing or
twice (tests.e2e.faults.invariants).

    python -m benchmarks.node_loss_bench [--steps 500] [--kill-at 100]
                                           # just bench-node-loss; results/node_loss.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import save
from bus.cluster import EmbeddedCluster
from bus.runtime import Bus
from schemas import WeightsPublished
from tests.e2e.faults import invariants, read_seq_events, sigkill, time_to_next_step
from tests.e2e.helpers import reached_version, rlbus_up, summary


def say(line: str) -> None:
    print(f"[node-loss] {line}", flush=True)


async def main(steps: int, kill_at: int) -> dict[str, Any]:
    run = "node-loss"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        say(f"default preset, {steps} steps, on a 3-node cluster; killing at v{kill_at}")
        proc = rlbus_up(root, run, f"max_steps={steps}", "--cluster", "3", config="default")
        url = await reached_version(proc, root, run, kill_at, timeout_s=1800)
        if url is None:
            raise RuntimeError(f"the run never reached version {kill_at}")
        bus = await Bus.connect(url, run=run, producer="bench")
        try:
            info = await bus.js.stream_info(bus.stream)
            leader = info.cluster.leader if info.cluster else None
            if not leader:
                raise RuntimeError("the run's stream names no leader")
            pid = json.loads((root / run / "nats" / leader / "server.json").read_text())["pid"]
            say(f"killing {leader} (pid {pid}), the leader of {bus.stream}")
            recovery = await time_to_next_step(bus, sigkill(pid), steps=3)
            after = await bus.js.stream_info(bus.stream)
        finally:
            await bus.close()
        say(f"3 more steps {recovery:.1f} s after the kill; new leader {after.cluster.leader if after.cluster else '?'}")  # fmt: skip
        out, _ = await asyncio.to_thread(proc.communicate, timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"the run failed:\n{out[-3000:]}")
        with EmbeddedCluster(root / run / "nats") as cluster:
            events = await read_seq_events(cluster.url, run)
        s = summary(root, run)
    found = invariants(events, steps)
    stamps = sorted(e.ts_ns for _, e in events if isinstance(e, WeightsPublished))
    gaps = [(b - a) / 1e9 for a, b in zip(stamps, stamps[1:], strict=False)]
    return {
        "preset": "default",
        "nodes": 3,
        "replicas": 3,
        "killed": f"{leader} (stream leader) at v{kill_at}",
        "steps_reached": found["steps"],
        "three_steps_after_kill_s": round(recovery, 2),
        "median_step_s": round(statistics.median(gaps), 3) if gaps else None,
        "role_restarts": s.get("restarts", {}),
        "final_eval": {k: v for k, v in s.items() if k.endswith(":final")},
        **{k: v for k, v in found.items() if k != "steps"},
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--kill-at", type=int, default=100)
    a = p.parse_args()
    results = asyncio.run(main(a.steps, a.kill_at))
    for k, v in results.items():
        print(f"{k:>28}: {v}")
    print("saved", save("node_loss", results))
