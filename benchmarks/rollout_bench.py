"""Rollout throughput on the bus: the tiny model with 1 vs 2 inference replicas.

Real processes, as in a run: one env server (``rlbus role env``) and N inference roles
(``rlbus role inference``) on an embedded nats-server. Each setting gets a warm-up group,
then ``--groups`` groups of ``--group-size`` reverse-text rollouts. Reported per setting:
rollouts/s, generated tokens/s, and where a rollout's time goes — in generation
(``compute_s``: the batch's forward passes), queued for a batch slot (``queue_s``), in NATS
and (de)serialisation (client round trip minus the server's queue and compute time), and
in the env. On this 2-core machine a second replica competes with the first for CPU, so
the replica ratio measures the bus's ability to spread load, not free speed.

    python -m benchmarks.rollout_bench [--groups 16 --group-size 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import close_all, save
from bus.reader import LogReader
from bus.runtime import Bus
from bus.server import EmbeddedServer
from bus.subjects import Topic
from configs import dump_toml, load_config
from configs.paths import RunPaths
from roles.runtime.context import policy_model_dir
from roles.up.processes import role_process
from roles.up.rollout import build_requests, plan_requests
from schemas import TraceCompleted


async def measure(
    url: str, root: Path, replicas: int, groups: int, group_size: int
) -> dict[str, float]:
    run = f"bench{replicas}"
    cfg = load_config("default", [f"bus.data_dir={root}", "model.tiny.init_seed=0"])
    cfg.run = run
    paths = RunPaths.of(cfg)
    paths.dir.mkdir(parents=True, exist_ok=True)
    paths.config.write_text(dump_toml(cfg))
    policy_model_dir(cfg, run)
    roles = [role_process("env", ["env", "--env", "reverse-text"], paths, url)]
    roles += [
        role_process(f"inference-{i}", ["inference", "--model", "policy"], paths, url)
        for i in range(replicas)
    ]
    for r in roles:
        r.start()
    bus = await Bus.connect(url, run=run, producer="bench")
    await bus.ensure_stream()
    reader = LogReader(bus, topics=[(Topic.TRACE_COMPLETED, None)], follow=True)
    traces_in = aiter(reader.events((TraceCompleted,)))

    async def collect(n: int) -> list[Any]:
        return [(await asyncio.wait_for(anext(traces_in), 300)).trace for _ in range(n)]

    try:
        warm = plan_requests(
            cfg, "reverse-text", "train", group_size * replicas, group_size, "policy"
        )
        await bus.publish_many(build_requests(run, 1, warm, 1000))
        await collect(group_size * replicas)  # model loads, connections, first batches
        plan = plan_requests(
            cfg, "reverse-text", "train", groups * group_size, group_size, "policy"
        )
        t0 = time.perf_counter()
        await bus.publish_many(build_requests(run, 2, plan, 1000))
        traces = await collect(groups * group_size)
        wall = time.perf_counter() - t0
    finally:
        await close_all(traces_in, bus, roles)
    tokens = sum(int(m.ids().size - 1) for t in traces for m in t.messages if m.role == "assistant")
    t = [x.timings for x in traces]
    total = statistics.fmean(x["total_s"] for x in t)
    nats_s = statistics.fmean(x["generate_s"] - x["queue_s"] - x["compute_s"] for x in t)
    return {
        "rollouts": len(traces),
        "errors": sum(1 for x in traces if x.errors),
        "rollouts_per_s": len(traces) / wall,
        "generated_tokens_per_s": tokens / wall,
        "rollout_latency_s": total,
        "share_generation": statistics.fmean(x["compute_s"] for x in t) / total,
        "share_batch_queue": statistics.fmean(x["queue_s"] for x in t) / total,
        "share_nats_and_serialisation": nats_s / total,
        "share_env": statistics.fmean(x["env_s"] for x in t) / total,
    }


async def main(groups: int, group_size: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        with EmbeddedServer(root / "nats") as server:
            one = await measure(server.url, root, 1, groups, group_size)
            two = await measure(server.url, root, 2, groups, group_size)
    r = lambda d: {k: round(v, 4) if isinstance(v, float) else v for k, v in d.items()}  # noqa: E731
    return {
        "groups": groups,
        "group_size": group_size,
        "one_replica": r(one),
        "two_replicas": r(two),
        "ratio_rollouts_per_s_2_vs_1": round(two["rollouts_per_s"] / one["rollouts_per_s"], 3),
    }


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    a = p.parse_args()
    results = asyncio.run(main(a.groups, a.group_size))
    import json

    print(json.dumps(results, indent=2))
    print("saved", save("rollouts", results))
