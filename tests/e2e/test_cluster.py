"""A run on a three-node JetStream cluster survives the loss of a node (real processes,
real servers on loopback): kill -9 of the node that leads the run's stream (the
launcher restarts it from its store; a role may exit once on the election and resume), and of another node that never comes back (three
replicas keep a quorum). The servers `rlbus up` starts refuse anonymous clients. Either way the run reaches max_steps and its log is intact:
every request has its traces, nothing twice, final weights equal a trainer replay."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bus.cluster import EmbeddedCluster
from bus.runtime import Bus
from tests.e2e.faults import assert_log_intact, read_seq_events, sigkill, time_to_next_step
from tests.e2e.helpers import reached_version, rlbus_up, stop_if_running, summary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Long enough that the run is still training when this test's own client reads the log
# again after the leader's death: at 12 a run that recovered fast ended (v12, 1.3 s after
# v7) while the client's reads still waited out the election, and the probe never saw v7.
STEPS = 40


async def _anonymous_answer(url: str) -> str:
    """What a server answers a client that connects without credentials (spoken in the
    protocol: nats-py leaks its socket when a connect is refused)."""
    host, port = url.removeprefix("nats://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        await reader.readline()  # INFO
        writer.write(b'CONNECT {"verbose":false,"pedantic":false,"protocol":1}\r\nPING\r\n')
        await writer.drain()
        return (await asyncio.wait_for(reader.readline(), 5)).decode().strip()
    finally:
        writer.close()
        await writer.wait_closed()


async def _stream_nodes(url: str, run: str) -> tuple[str, list[str], int]:
    """(leader, followers, replicas) of the run's stream."""
    bus = await Bus.connect(url, run=run, producer="e2e")
    try:
        info = await bus.js.stream_info(bus.stream)
    finally:
        await bus.close()
    assert info.cluster is not None and info.cluster.leader
    followers = [r.name for r in info.cluster.replicas or []]
    return info.cluster.leader, followers, int(info.config.num_replicas or 1)


async def test_stream_leader_killed_and_restarted(tmp_path: Path) -> None:
    run = "node1"
    proc = rlbus_up(tmp_path, run, f"max_steps={STEPS}", "--cluster", "3")
    try:
        url = await reached_version(proc, tmp_path, run, 2, timeout_s=400)
        assert url is not None, "the run never reached version 2"
        assert url.count(",") == 2, url  # every node's URL
        # the run's servers take no anonymous client: nothing can be written into the run
        for node in url.split(","):
            assert await _anonymous_answer(node) == "-ERR 'Authorization Violation'"
        leader, _, replicas = await _stream_nodes(url, run)
        assert replicas == 3
        pid = json.loads((tmp_path / run / "nats" / leader / "server.json").read_text())["pid"]
        bus = await Bus.connect(url, run=run, producer="e2e")
        try:
            took = await time_to_next_step(bus, sigkill(pid), steps=3)
            print(f"stream leader {leader} killed: 3 more steps in {took:.1f} s")
        finally:
            await bus.close()
        out, _ = await asyncio.to_thread(proc.communicate, timeout=600)
        assert proc.returncode == 0, out[-4000:]
        assert f"nats-server {leader} is back" in out
        assert summary(tmp_path, run)["steps"] == STEPS
        # A role whose JetStream call failed through the election may exit once and resume
        # (its durable consumer and the log make that safe); none keeps dying.
        assert all(n <= 1 for n in summary(tmp_path, run).get("restarts", {}).values())
    finally:
        stop_if_running(proc)  # a failed wait must not leave the run (and its pipe) behind

    with EmbeddedCluster(tmp_path / run / "nats") as cluster:  # anonymous: a test's reader
        seq_events = await read_seq_events(cluster.url, run)
    assert_log_intact(seq_events, STEPS, tmp_path / run)


async def test_follower_killed_for_good(tmp_path: Path) -> None:
    """A cluster the run was given (so nobody restarts its nodes): one node that does
    not lead the stream dies at version 2 and stays dead."""
    run = "node2"
    with EmbeddedCluster(tmp_path / "cluster") as cluster:
        proc = rlbus_up(
            tmp_path, run, f"max_steps={STEPS}", f'bus.url="{cluster.url}"', "bus.replicas=3"
        )
        try:
            url = await reached_version(proc, tmp_path, run, 2, timeout_s=400, url=cluster.url)
            assert url is not None, "the run never reached version 2"
            leader, followers, replicas = await _stream_nodes(cluster.url, run)
            assert replicas == 3
            victim = cluster.node_named(followers[0])
            assert victim.proc is not None
            victim.proc.kill()
            out, _ = await asyncio.to_thread(proc.communicate, timeout=600)
            assert proc.returncode == 0, out[-4000:]
            assert not victim.alive
        finally:
            stop_if_running(proc)
        seq_events = await read_seq_events(cluster.url, run)
    assert summary(tmp_path, run)["steps"] == STEPS
    assert_log_intact(seq_events, STEPS, tmp_path / run)
