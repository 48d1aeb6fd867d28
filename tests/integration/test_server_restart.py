"""The launcher's embedded server comes back as it was started after a kill -9.

The server is started the launcher's way (``EmbeddedServer.for_run``) and restarted by
the launcher's own code path (``ServerKeeper.check``): the same URL, the stream's
messages still there, and a client connected before the kill publishes again after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from bus.log import get_logger
from bus.runtime import Bus
from bus.server import EmbeddedServer
from bus.subjects import Topic, subject
from roles.up.monitor import RunMonitor
from roles.up.supervisor import MAX_SERVER_RESTARTS, ServerKeeper
from roles.up.view import LiveView

pytestmark = pytest.mark.nats

RUN = "restart1"


def killed(server: EmbeddedServer) -> None:
    """kill -9 the server and wait until it is gone (the keeper sees it dead)."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while server.alive:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def keeper_of(server: EmbeddedServer) -> ServerKeeper:
    view = LiveView(RunMonitor(run=RUN, max_steps=1), [], enabled=False)
    return ServerKeeper([server], view, get_logger(run=RUN, role="launcher"))


async def held_by_a_killed_server(server: EmbeddedServer, work: Any) -> tuple[Any, float]:
    """Start ``work`` while the server is stopped (what it sends is taken and never
    answered), kill the server and restart it the launcher's way: (the task running
    ``work``, when the server was back)."""
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    task = asyncio.create_task(work)
    await asyncio.sleep(0.5)
    killed(server)
    assert await keeper_of(server).check() is None
    return task, time.monotonic()


async def test_a_killed_server_restarts_on_its_url_with_its_stream(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with EmbeddedServer.for_run(tmp_path / "nats") as server:
        url, pid = server.url, server.proc.pid if server.proc else 0
        bus = await Bus.connect(url, run=RUN, producer="test")
        try:
            await bus.ensure_stream()
            topic = subject(RUN, Topic.TRACE_COMPLETED, "env")
            for i in range(3):
                await bus.js.publish(topic, f"before {i}".encode())

            killed(server)
            started = time.monotonic()
            assert await keeper_of(server).check() is None
            assert time.monotonic() - started < 5
            assert server.url == url and server.proc is not None and server.proc.pid != pid

            ack = await bus.js.publish(topic, b"after", timeout=20)  # the same client
            assert ack.seq == 4
            info = await bus.js.stream_info(bus.stream)
            assert info.state.messages == 4
        finally:
            await bus.close()
    out = capsys.readouterr().out
    assert f"nats-server died (killed by SIGKILL); restarting on {url}" in out
    assert f"nats-server is back on {url}" in out

    # `rlbus up --resume`: the same port and name, when the port is free ...
    again = EmbeddedServer.for_run(tmp_path / "nats")
    assert (again.port, again.name) == (server.port, server.name)
    with socket.socket() as taken:  # ... and a new port when it is not
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", server.port))
        taken.listen()
        assert EmbeddedServer.for_run(tmp_path / "nats").port == -1


async def test_a_server_that_keeps_dying_stops_the_run(tmp_path: Path) -> None:
    with EmbeddedServer.for_run(tmp_path / "nats") as server:
        keeper = keeper_of(server)
        for _ in range(MAX_SERVER_RESTARTS):
            killed(server)
            assert await keeper.check() is None
        killed(server)
        failed = await keeper.check()
    assert failed is not None
    assert failed.startswith(f"nats-server died {MAX_SERVER_RESTARTS + 1} times in 60s")
    assert not server.alive


async def test_an_object_put_waits_out_a_server_restart(tmp_path: Path) -> None:
    """A weights put while the server is away is tried again, and lands once it is back
    (a role in its setup used to die on that: the killed-in-turn fault test caught it)."""
    from bus.offload import sha256_digest

    data = bytes(range(256)) * 400
    with EmbeddedServer(tmp_path / "s") as server:
        bus = await Bus.connect(server.url, "put1", "test")
        try:
            await bus.ensure_run()
            server.stop()
            put = asyncio.create_task(bus.objects.put("weights.v1", data))
            await asyncio.sleep(1.5)
            assert not put.done()
            await server.restart()
            digest = await asyncio.wait_for(put, 30)
            assert digest == sha256_digest(data)
            assert await bus.objects.get("weights.v1", digest) == data
        finally:
            await bus.close()


async def test_what_a_killed_server_delivered_to_the_trainer_comes_back_at_once(
    tmp_path: Path,
) -> None:
    """The trainer's durable (``owned``, one batch in flight at most) after a kill -9 of
    the server: a batch the server had delivered that never reached it comes again as
    soon as it reconnects, not after ``ack_wait``, and a publish in flight when the
    server died is retried at once. (Here the lost delivery is a client that fetched
    and vanished; in a run, the kill takes it.)"""
    from bus.consumer import Consumer, Delivery, Subscription
    from bus.runtime import BusSettings
    from schemas import TaskRef, TaskRequested

    slow = BusSettings(ack_wait_s=30.0, publish_timeout_s=20.0)
    with EmbeddedServer.for_run(tmp_path / "nats") as server:
        bus = await Bus.connect(server.url, run=RUN, producer="test", settings=slow)
        lost = await Bus.connect(server.url, run=RUN, producer="lost", settings=slow)
        got: list[tuple[str, float]] = []
        stop = asyncio.Event()

        async def handle(event: TaskRequested, d: Delivery) -> None:
            got.append((event.event_id, time.monotonic()))

        sub = Subscription("owned", [(Topic.TASK_REQUESTED, None)], handle, batch=1,
                           max_ack_pending=1, owned=True)  # fmt: skip
        try:
            await bus.ensure_stream()
            consumer = Consumer(bus, sub, "test")
            await consumer.ensure()
            await bus.publish(TaskRequested(run=RUN, env="e", task=TaskRef(index=1),
                                            group_id="g1", group_size=1, event_id="b1"))  # fmt: skip
            psub = await lost.js.pull_subscribe_bind("owned", lost.stream)
            (taken,) = await psub.fetch(1, timeout=5)  # delivered, never acked
            await lost.close()
            running = asyncio.create_task(consumer.run(stop))
            await asyncio.sleep(1.5)
            assert got == []  # held by the vanished client, and nothing else comes

            # A publish the server received and never acknowledged.
            publishing, killed_at = await held_by_a_killed_server(
                server, bus.publish(TaskRequested(run=RUN, env="e", task=TaskRef(index=2),
                                                  group_id="g2", group_size=1, event_id="b2"))
            )  # fmt: skip
            await asyncio.wait_for(publishing, timeout=10)  # not publish_timeout_s's 20 s
            async with asyncio.timeout(10):  # not ack_wait's 30 s
                while len(got) < 2:
                    await asyncio.sleep(0.05)
            assert [e for e, _ in got] == ["b1", "b2"]
            assert got[0][1] - killed_at < 10
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(running, 10)
            await bus.close()


async def test_a_request_the_killed_server_held_is_asked_again_once_it_is_back(
    tmp_path: Path,
) -> None:
    """A request (inference traffic: core NATS, nothing stored) sent just before the
    server died is lost with it: once the requester's connection is back, it says so
    (``ReplicaSilent``, which the inference client answers by asking again) within a
    keepalive interval and the reconnect grace, not after ``silence_s``."""
    from bus.errors import ReplicaSilent
    from schemas import TaskRef

    with EmbeddedServer.for_run(tmp_path / "nats") as server:
        bus = await Bus.connect(server.url, run=RUN, producer="test")
        try:
            asking, back = await held_by_a_killed_server(
                server, bus.request("rl.restart1.infer.test", TaskRef(index=1), [TaskRef],
                                    timeout_s=60, silence_s=9)
            )  # fmt: skip
            with pytest.raises(ReplicaSilent, match="with the connection"):
                await asyncio.wait_for(asking, timeout=10)
            assert time.monotonic() - back < 5  # a keepalive interval (3 s), not silence_s's 9
        finally:
            await bus.close()


async def test_an_object_put_or_read_the_killed_server_held_starts_again_once_it_is_back(
    tmp_path: Path,
) -> None:
    """A weights put whose chunk the server took and never acknowledged (it died): once
    the connection is back the put starts again within the reconnect grace, instead of
    waiting out nats-py's 5 s publish timeout, and the object reads back whole; a read
    in progress starts again the same way."""
    from bus.offload import sha256_digest

    data = bytes(range(256)) * 2000  # 512 kB: several chunks
    with EmbeddedServer.for_run(tmp_path / "nats") as server:
        bus = await Bus.connect(server.url, run=RUN, producer="test")
        try:
            await bus.ensure_run()
            put, back = await held_by_a_killed_server(server, bus.objects.put("weights.v1", data))
            digest = await asyncio.wait_for(put, timeout=20)
            assert time.monotonic() - back < 3.5  # the grace and a reconnect, not 5 s
            assert digest == sha256_digest(data)
            assert await bus.objects.get("weights.v1", digest) == data

            # A read the server held when it died starts again too (not after its stall),
            # from another kind's store as inference reads the trainer's weights.
            other = "RLOBJTRAINER_restart1"
            assert await bus.bodies(other).put("weights.v1", data) == digest
            read, back = await held_by_a_killed_server(
                server, bus.bodies(other).get("weights.v1", digest)
            )
            assert await asyncio.wait_for(read, timeout=20) == data
            assert time.monotonic() - back < 3.5
        finally:
            await bus.close()


async def test_a_follower_reads_on_as_soon_as_the_killed_server_is_back(tmp_path: Path) -> None:
    """A follower's ordered consumer lived in the killed server's memory: once the
    connection is back it subscribes again after the last event it read, at once (nats-py
    alone recreates it after two missed heartbeats, 2 s or more), and reads every event
    once, in order."""
    from bus.reader import LogReader
    from schemas import TaskRef, TaskRequested

    def task(i: int) -> TaskRequested:
        return TaskRequested(run=RUN, env="e", task=TaskRef(index=i), group_id=f"g{i}",
                             group_size=1, event_id=f"t{i}")  # fmt: skip

    with EmbeddedServer.for_run(tmp_path / "nats") as server:
        bus = await Bus.connect(server.url, run=RUN, producer="test")
        stop = asyncio.Event()
        seen: list[tuple[str, float]] = []

        async def follow() -> None:
            reader = LogReader(bus, topics=[(Topic.TASK_REQUESTED, None)], follow=True,
                               idle_timeout_s=1.0, stop=stop)  # fmt: skip
            async for event in reader.events((TaskRequested,)):
                seen.append((event.event_id, time.monotonic()))

        try:
            await bus.ensure_stream()
            await bus.publish(task(1))
            following = asyncio.create_task(follow())
            async with asyncio.timeout(10):
                while not seen:
                    await asyncio.sleep(0.02)
            reconnects = bus.reconnects
            killed(server)
            assert await keeper_of(server).check() is None
            async with asyncio.timeout(10):
                while bus.reconnects == reconnects:
                    await asyncio.sleep(0.02)
            back = time.monotonic()
            await bus.publish(task(2))
            async with asyncio.timeout(10):
                while len(seen) < 2:
                    await asyncio.sleep(0.02)
            assert [e for e, _ in seen] == ["t1", "t2"]
            assert seen[1][1] - back < 1.5
        finally:
            stop.set()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(following, 10)
            await bus.close()
