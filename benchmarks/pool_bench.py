"""Env pools: rollouts/s with one env server vs an elastic pool (1..3) on the same workload.

Real processes, as in a run: one inference role and the env pool's servers
(``rlbus role env``) on an embedded nats-server; the elastic pool is resized by the
launcher's own ``PoolKeeper`` (``roles/up/pools.py``) from the env consumer's backlog.
Each setting gets a warm-up group (model load, connections), then ``--groups`` groups
of ``--group-size`` rollouts published at once. The elastic wall time includes growing
the pool (the backlog's ``scale_up_after_s``, then each replica's start), as a run
would pay it.

The env is reverse-text scored by a blocking verifier (``slow_verifier``: ``--verify-s``
per rollout, a sandbox or a judge called synchronously, as env code often is), so an env
server is the bottleneck and more processes relieve it. ``--verify-s 0`` is plain
reverse-text with the tiny model on CPU: there env servers and inference compete for
the same cores, and growing the pool only costs (each new replica's start takes CPU).

    python -m benchmarks.pool_bench [--groups 150 --group-size 8 --verify-s 0.02]

Results: ``benchmarks/results/pools.json`` and ``pools.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, close_all, save
from bus.reader import LogReader
from bus.runtime import Bus
from bus.server import EmbeddedServer
from bus.subjects import Topic
from configs import dump_toml, load_config
from configs.paths import RunPaths
from roles.runtime.context import policy_model_dir
from roles.up.pools import PoolKeeper, env_replica, run_pools
from roles.up.processes import RoleProcess, role_process
from roles.up.rollout import build_requests, plan_requests
from schemas import TraceCompleted

ENV = "benchmarks.pool_bench:slow_verifier"


def slow_verifier(verify_s: float = 0.02, **args: Any) -> Any:
    """reverse-text whose score waits ``verify_s`` per rollout, blocking (a synchronous
    verifier: the env server's event loop waits, as with a subprocess or an HTTP call)."""
    from roles.lib.envs.base import Rubric
    from roles.lib.envs.registry import make_env

    env = make_env("reverse-text", args)
    rubric = env.rubric

    def verified(messages: Any, task: dict[str, Any], state: Any) -> float:
        time.sleep(verify_s)
        return float(rubric.score(messages, task, state).reward)

    env.rubric = Rubric(funcs={"verified": verified})
    return env


class Say:
    """The keeper's notes, printed with the time since the measured groups went out."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def note(self, text: str) -> None:
        print(f"  [{time.perf_counter() - self.t0:5.1f}s] {text}", flush=True)


async def measure(
    url: str, root: Path, elastic: bool, groups: int, group_size: int, verify_s: float
) -> dict[str, Any]:
    run = "elastic" if elastic else "static"
    pool = "min_replicas=1,max_replicas=3" if elastic else "replicas=1"
    env = f'id="{ENV}",args={{verify_s={verify_s}}}' if verify_s else 'id="reverse-text"'
    cfg = load_config(
        "default",
        [
            f"bus.data_dir={root}", "model.tiny.init_seed=0",
            f"orchestrator.train.env=[{{{env},{pool}}}]",
            "env_server.scale_up_backlog=2", "env_server.scale_up_after_s=1",
            "env_server.scale_check_s=0.5", "env_server.scale_down_idle_s=600",
        ],
    )  # fmt: skip
    cfg.run = run
    paths = RunPaths.of(cfg)
    paths.dir.mkdir(parents=True, exist_ok=True)
    paths.config.write_text(dump_toml(cfg))
    policy_model_dir(cfg, run)
    env_id = cfg.orchestrator.train.env[0].id
    roles = [
        role_process(env_replica(env_id, 0), ["env", "--env", env_id], paths, url),
        role_process("inference-policy-0", ["inference", "--model", "policy"], paths, url),
    ]
    for r in roles:
        r.start()
    bus = await Bus.connect(url, run=run, producer="bench")
    await bus.ensure_run()
    (env_pool, _) = run_pools(cfg, roles, lambda name, args: role_process(name, args, paths, url))
    say = Say()
    s = cfg.env_server

    def start(r: RoleProcess) -> None:
        r.start()

    keeper = PoolKeeper(
        [env_pool], roles, start, bus, say, bus.log, s.scale_check_s, s.scale_up_backlog, 0.9
    )
    reader = LogReader(bus, topics=[(Topic.TRACE_COMPLETED, None)], follow=True)
    traces_in = aiter(reader.events((TraceCompleted,)))

    arrived: list[float] = []  # seconds after the measured groups went out

    async def collect(n: int) -> list[Any]:
        out = []
        for _ in range(n):
            out.append(await asyncio.wait_for(anext(traces_in), 600))
            arrived.append(time.perf_counter() - say.t0)
        return out

    pooling: asyncio.Task[None] | None = None
    try:
        warm = plan_requests(cfg, env_id, "train", group_size, group_size, "policy")
        await bus.publish_many(build_requests(run, 1, warm, 1000))
        await collect(group_size)  # model load, connections, first batches
        arrived.clear()
        plan = plan_requests(cfg, env_id, "train", groups * group_size, group_size, "policy")
        pooling = asyncio.create_task(keeper.run())
        say.t0 = t0 = time.perf_counter()
        keeper.started_at = time.monotonic()  # resizes are timed from here
        await bus.publish_many(build_requests(run, 2, plan, 1000))
        done = await collect(groups * group_size)
        wall = time.perf_counter() - t0
        names = {f"-{r.proc.pid}": r.name for r in roles if r.proc is not None}
    finally:
        keeper.stop.set()
        if pooling is not None:
            await asyncio.wait([pooling], timeout=10)
        await close_all(traces_in, bus, roles)
    traces = [e.trace for e in done]
    # rollouts per replica: a producer instance ends with its process's pid
    by_replica = Counter(next((n for k, n in names.items() if e.producer.endswith(k)), "?") for e in done)  # fmt: skip
    return {
        "rollouts": len(traces),
        "errors": sum(1 for t in traces if t.errors),
        "wall_s": round(wall, 2),
        "rollouts_per_s": round(len(traces) / wall, 3),
        "peak_replicas": env_pool.peak,
        "scaled": env_pool.scaled,
        "serving": env_pool.serving,  # when each added replica took its first groups
        "rollouts_per_s_by_replicas_serving": by_phase(arrived, env_pool.serving),
        "by_replica": dict(sorted(by_replica.items())),
    }


def by_phase(arrived: list[float], serving: list[dict[str, Any]]) -> dict[str, float]:
    """Rollouts/s while 1, 2, ... replicas served: the arrivals between the times the
    added replicas started serving."""
    bounds = [0.0, *(e["at_s"] for e in serving), max(arrived, default=0.0)]
    out = {}
    for k, (lo, hi) in enumerate(zip(bounds, bounds[1:], strict=False), start=1):
        n = sum(1 for t in arrived if lo <= t < hi or (t == hi == bounds[-1]))
        if hi > lo and n:
            out[str(k)] = round(n / (hi - lo), 1)
    return out


async def main(groups: int, group_size: int, verify_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        with EmbeddedServer(root / "nats") as server:
            print("one env server:", flush=True)
            one = await measure(server.url, root, False, groups, group_size, verify_s)
            print("elastic pool 1..3:", flush=True)
            pool = await measure(server.url, root, True, groups, group_size, verify_s)
    return {
        "groups": groups,
        "group_size": group_size,
        "verify_s": verify_s,
        "groups_in_flight_per_server": load_config("default").env_server.groups_in_flight,
        "one_replica": one,
        "elastic_1_to_3": pool,
        "ratio_rollouts_per_s_elastic_vs_1": round(
            pool["rollouts_per_s"] / one["rollouts_per_s"], 3
        ),
    }


def markdown(r: dict[str, Any]) -> str:
    rows = [
        "| pool | rollouts | wall s | rollouts/s | peak replicas | resized at s | replica serving at s (start took s) | rollouts/s with 1, 2, 3 serving |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for label, key in (("1 env server", "one_replica"), ("elastic 1..3", "elastic_1_to_3")):
        m = r[key]
        at = ", ".join(f"{e['from']}->{e['to']} at {e['at_s']}" for e in m["scaled"]) or "-"
        served = ", ".join(f"{e['at_s']} ({e['after_s']})" for e in m["serving"]) or "-"
        rates = " / ".join(str(v) for v in m["rollouts_per_s_by_replicas_serving"].values())
        rows.append(
            f"| {label} | {m['rollouts']} | {m['wall_s']} | {m['rollouts_per_s']} "
            f"| {m['peak_replicas']} | {at} | {served} | {rates} |"
        )
    verifier = f", a blocking {r['verify_s']}s verifier per rollout" if r["verify_s"] else ""
    head = (
        f"{r['groups']} groups x {r['group_size']} reverse-text rollouts{verifier}, "
        f"tiny model on CPU; elastic vs 1: {r['ratio_rollouts_per_s_elastic_vs_1']}x "
        "rollouts/s (`python -m benchmarks.pool_bench`). Times are seconds after the "
        "groups went out; the elastic wall time includes each replica's start."
    )
    return head + "\n\n" + "\n".join(rows) + "\n"


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=150)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--verify-s", type=float, default=0.02)
    a = p.parse_args()
    results = asyncio.run(main(a.groups, a.group_size, a.verify_s))
    print(json.dumps(results, indent=2))
    path = save("pools", results)
    (RESULTS / "pools.md").write_text(markdown(results))
    print("saved", path, "and", RESULTS / "pools.md")
