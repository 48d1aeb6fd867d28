"""The launcher's embedded server comes back as it was started after a kill -9.

The server is started the launcher's way (``EmbeddedServer.for_run``) and restarted by
the launcher's own code path (``ServerKeeper.check``): the same URL, the stream's
messages still there, and a client connected before the kill publishes again after it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

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
