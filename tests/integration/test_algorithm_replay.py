"""Algorithm replay is the worker: one pure core (``ScoringCore``) scores a trace in both.

A worker scores a run live (half its traces caught up from the log at start, half
delivered while it runs, then a restart that rebuilds a stateful algorithm's state from
its own output); replay reads the recorded run and drives the same core. Every
recomputed ``SamplesScored`` must encode to the very bytes the worker published (the
envelope's informational timestamp and producer aside).
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from bus import codec
from bus.reader import read_log
from bus.runtime import Bus
from bus.server import EmbeddedServer
from bus.subjects import Topic
from configs import RunConfig
from configs.orchestrator import EnvConfig
from replay.algorithm import diff_scored, read_algorithm_log, recompute
from roles.algorithm.core import ScoringCore
from roles.algorithm.role import AlgorithmWorker
from roles.runtime.role import serve_role
from schemas import RunStarted, SamplesScored, derive_id
from tests.integration.test_algorithm_worker import (
    SETTINGS,
    completed,
    idle,
    stop_worker,
    wait_until,
)

pytestmark = pytest.mark.nats


def canonical(event: SamplesScored) -> bytes:
    """The event's bytes without the fields replay never reproduces (clock, producer)."""
    return codec.encode(msgspec.structs.replace(event, ts_ns=0, producer=""))


async def start_worker(
    server: EmbeddedServer, cfg: RunConfig, name: str, instance: str
) -> tuple[AlgorithmWorker, asyncio.Task[None]]:
    """A worker built as ``rlbus role algorithm --name <name>`` builds it."""
    bus = await Bus.connect(server.url, run=cfg.run, producer=instance, settings=SETTINGS)
    role = AlgorithmWorker(bus, instance, ScoringCore.for_run(cfg, name))
    return role, asyncio.create_task(serve_role(role, install_signals=False))


async def recorded(bus: Bus, algorithm_id: str) -> list[SamplesScored]:
    topics = [(Topic.SAMPLES_SCORED, algorithm_id)]
    return [e async for e in read_log(bus, topics, (SamplesScored,))]


@pytest.mark.parametrize("name", ["grpo", "rae"])
async def test_replay_output_is_byte_identical_to_the_worker(
    nats_server: EmbeddedServer, bus: Bus, name: str
) -> None:
    """Worker output (catch-up, live, after a restart) == replay through the same core."""
    run = bus.run
    cfg = RunConfig(run=run)
    cfg.orchestrator.train.env = [EnvConfig(id="e", group_size=4)]  # grpo is routed to it
    await bus.publish(
        RunStarted(
            run=run,
            event_id=derive_id(run, "started"),
            config=cfg.model_dump(mode="json"),
            seed=cfg.seed,
            model_path="tiny",
        )  # fmt: skip
    )
    rewards = {"g1": [1.0, 0.0, 0.5, 0.0], "h1": [1.0, 1.0, 0.0, 0.5], "k1": [0.0, 0.25, 1.0, 1.0]}
    traces = {
        g: [completed(run, g, i, r, errored=(g == "h1" and i == 2)) for i, r in enumerate(rs)]
        for g, rs in rewards.items()
    }  # one task index (1) for all: rae's baseline carries from group to group
    g1, h1, k1 = traces["g1"], traces["h1"], traces["k1"]
    await bus.publish_many([g1[0], h1[1], g1[2], g1[1]])  # caught up from the log at start
    worker, task = await start_worker(nats_server, cfg, name, f"{name}-a")
    await bus.publish_many([h1[0], g1[3], h1[3], h1[2]])  # delivered live
    await wait_until(lambda: idle(bus, name, 8), task)
    await stop_worker(worker, task)

    restarted, task = await start_worker(nats_server, cfg, name, f"{name}-b")
    await bus.publish_many(k1[::-1])  # scored with the state folded from its own output
    await wait_until(lambda: idle(bus, name, 12), task)
    await stop_worker(restarted, task)

    published = await recorded(bus, name)
    assert [e.group_id for e in published] == ["g1", "h1", "k1"]
    log = await read_algorithm_log(bus, name)
    replayed = [scored for _, scored in await recompute(name, log)]
    assert [canonical(e) for e in replayed] == [canonical(e) for e in published]
    assert diff_scored(log, await recompute(name, log)).ok
