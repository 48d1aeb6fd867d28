"""``rlbus trace`` through the lake's index, against a real nats-server.

The index names a handful of events by stream sequence; ``trace_chain`` over them must
give exactly the chain it gives over a scan of the whole log. The CLI syncs the lake
first, accepts the event id of a ``trace.completed`` (as ``rlbus events`` prints it),
and fails in one line on an id that names no single rollout.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from bus.reader import read_log
from bus.runtime import Bus
from bus.server import EmbeddedServer
from replay.inspect import TOPICS, TYPES, TraceNotFound, trace_chain
from replay.lake import lake_dir, sync_run
from replay.trace_index import chain_seqs, fetch, load_index, resolve
from schemas import (
    BatchAssembled,
    Event,
    RunStarted,
    SamplesScored,
    TaskRequested,
    TraceCompleted,
    WeightsPublished,
)
from tests.samples import every_event, sample, trace

pytestmark = pytest.mark.nats


def small_run(run: str) -> list[Event]:
    """Every event type (``tests.samples``), plus a second rollout of the group, a shadow
    algorithm's samples of both, and weights v4 trained on a batch holding r1 only."""
    base = every_event(run)
    (scored,) = [e for e in base if isinstance(e, SamplesScored)]
    (weights,) = [e for e in base if isinstance(e, WeightsPublished)]
    return [
        *base,
        TraceCompleted(run=run, event_id="e-trace-r1", env="reverse-text", request_id="e-task",
                       group_size=8, step=2, trace=trace(run, rollout="r1")),
        msgspec.structs.replace(scored, event_id="e-shadow", algorithm="max_rl",
                                samples=[sample("r0"), sample("r1")]),
        BatchAssembled(run=run, event_id="e-batch-4", step=4, samples=[sample("r1")],
                       policy_version=3, sources=["e-shadow"]),
        msgspec.structs.replace(weights, event_id="e-weights-4", version=4, step=4,
                                batch_id="e-batch-4"),
    ]  # fmt: skip


def rlbus(data: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBUS_")}
    env["RLBUS_DATA_DIR"] = str(data)
    cmd = [sys.executable, "-m", "roles.cli", *args, "--nats-url", url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def as_json(chain: dict) -> str:
    return json.dumps(chain, default=str)


async def test_the_index_gives_the_full_scans_chain(bus: Bus, tmp_path: Path) -> None:
    """For every rollout, the chain over the events the lake names equals the chain over
    every event of the log; only those few events are fetched; ids resolve as documented."""
    await bus.publish_many(small_run(bus.run))
    full = [e async for e in read_log(bus, TOPICS, TYPES)]
    lake = lake_dir(tmp_path, bus.run)
    await sync_run(bus, lake)
    index = load_index(lake)
    for rollout in ("r0", "r1"):
        events = await fetch(bus, chain_seqs(index, rollout))
        assert as_json(trace_chain(events, rollout)) == as_json(trace_chain(full, rollout))
    wanted = chain_seqs(index, "r0")
    fetched = [type(e) for e in await fetch(bus, wanted)]
    assert fetched == [RunStarted, TaskRequested, TraceCompleted, SamplesScored, BatchAssembled,
                       WeightsPublished, SamplesScored]  # fmt: skip
    assert len(wanted.seqs) < len(full)

    assert resolve(index, "r1") == "r1"
    assert resolve(index, "e-trace-r") == "r1"  # a prefix of an event id
    assert resolve(index, "e-scored") == "r0"  # samples.scored holding one rollout
    for ident, error in [
        ("r", "2 rollouts start with 'r'"),
        ("e-shadow", "event e-shadow (samples.scored) holds 2 rollouts (r0, r1)"),
        ("e-batch-4", "event e-batch-4 is a batch.assembled"),
        ("nope", "no rollout id or event id 'nope'"),
    ]:
        with pytest.raises(TraceNotFound, match=error.replace("(", r"\(").replace(")", r"\)")):
            resolve(index, ident)


async def test_cli_syncs_the_lake_and_accepts_event_ids(
    nats_server: EmbeddedServer, bus: Bus, tmp_path: Path
) -> None:
    """`rlbus trace <run> <event id>` syncs the lake (events published after an earlier
    trace are found) and prints the full scan's chain; an unknown id fails in one line."""
    await bus.publish_many(every_event(bus.run))
    out = await asyncio.to_thread(rlbus, tmp_path, nats_server.url, "trace", bus.run, "e-trace", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr

    later = small_run(bus.run)[len(every_event()) :]
    await bus.publish_many(later)
    out = await asyncio.to_thread(rlbus, tmp_path, nats_server.url, "trace", bus.run, "e-trace-r1", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr
    full = [e async for e in read_log(bus, TOPICS, TYPES)]
    assert out.stdout.strip() == as_json(trace_chain(full, "r1"))

    out = await asyncio.to_thread(rlbus, tmp_path, nats_server.url, "trace", bus.run, "nope")
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.splitlines() == ["no rollout id or event id 'nope' in this run"]
