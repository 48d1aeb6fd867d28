"""Processes that do not outlive what they depend on: a role whose server is gone exits
with a one-line error; a child started with ``die_with_parent`` dies with its parent."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable
from pathlib import Path

import pytest

from bus.errors import ServerLost
from bus.runtime import Bus, BusSettings
from bus.server import SERVER_FILE, EmbeddedServer
from configs import dump_toml, load_config
from configs.paths import DATA_DIR_ENV
from roles.runtime.role import Role, serve_role
from schemas import RunStopped

pytestmark = pytest.mark.nats


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split()[2]
    except OSError:
        return True
    return state == "Z"


def test_a_child_dies_with_its_parent_however_the_parent_dies() -> None:
    parent = (
        "import signal, subprocess, os\n"
        "from bus.children import die_with_parent\n"
        "c = subprocess.Popen(['sleep', '60'], start_new_session=True,\n"
        "                     preexec_fn=die_with_parent(signal.SIGKILL))\n"
        "print(c.pid, flush=True)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True)
    child = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while not gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(child), "the child outlived its killed parent"


def test_a_role_that_loses_its_server_exits_with_one_line(tmp_path: Path) -> None:
    server = EmbeddedServer(tmp_path / "nats").start()
    cfg = load_config("smoke", ["bus.server_lost_s=2", f"bus.data_dir={tmp_path}"])
    cfg.run = "lost"
    config = tmp_path / "config.toml"
    config.write_text(dump_toml(cfg))
    cmd = [sys.executable, "-m", "roles.cli", "role", "algorithm", "--run", "lost"]
    cmd += ["--name", "grpo", "--nats-url", server.url, "--config", str(config)]
    log = tmp_path / "role.log"
    with log.open("w") as out:
        role = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and role.poll() is None:
            if '"role.started"' in log.read_text():
                break
            time.sleep(0.2)
        server.stop()
        role.wait(timeout=60)
    finally:
        if role.poll() is None:
            role.kill()
        server.stop()
    out = log.read_text()
    assert role.returncode == 3, out[-3000:]
    assert '"nats.server_lost"' in out
    assert out.strip().splitlines()[-1].startswith("algorithm: lost the NATS server at ")


async def test_a_task_failing_as_the_server_goes_ends_in_server_lost(tmp_path: Path) -> None:
    """A role's task that fails because the server just went away (before the connection
    noticed) is the lost server, not a crash: the role exits with ``ServerLost``."""
    server = EmbeddedServer(tmp_path / "nats").start()
    bus = await Bus.connect(server.url, "gone", "probe", BusSettings(server_lost_s=1.0))

    class Probe(Role):
        role = "probe"

        def background(self) -> list[Awaitable[None]]:
            return [self.ask_after_the_server_went()]

        async def ask_after_the_server_went(self) -> None:
            server.stop()
            await self.bus.nc.request("probe.anyone", b"", timeout=0.2)

    try:
        with pytest.raises(ServerLost):
            await asyncio.wait_for(serve_role(Probe(bus, "probe-0"), install_signals=False), 30)
    finally:
        server.stop()


async def _a_finished_run(url: str, run: str) -> None:
    bus = await Bus.connect(url, run=run, producer="test")
    await bus.ensure_stream()
    await bus.publish(RunStopped(run=run, reason="test"))
    await bus.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_killed_cli_command_stops_its_temporary_server(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """``rlbus events --follow`` on a run whose server is down starts a temporary one on
    the run's store; the command killed by a signal takes that server along."""
    store = tmp_path / "r1" / "nats"
    with EmbeddedServer(store) as server:
        asyncio.run(_a_finished_run(server.url, "r1"))
    env = {**os.environ, DATA_DIR_ENV: str(tmp_path)}
    cmd = [sys.executable, "-m", "roles.cli", "events", "r1", "--follow"]
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True) as cli:
        assert cli.stdout is not None
        assert "run.stopped" in cli.stdout.readline()  # it is following
        server_pid = json.loads((store / SERVER_FILE).read_text())["pid"]
        cli.send_signal(sig)
        cli.wait(timeout=30)
    deadline = time.monotonic() + 10
    while not gone(server_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(server_pid), f"the temporary nats-server outlived `rlbus events` ({sig.name})"


async def test_connecting_to_no_server_fails_in_bounded_time() -> None:
    """nats-py retries a refused first connection forever; the bus gives up, saying why."""
    from bus.errors import ServerUnreachable

    with pytest.raises(ServerUnreachable, match=r"nats://127\.0\.0\.1:1 within 1 s"):
        await Bus.connect("nats://127.0.0.1:1", run="r", connect_timeout_s=1.0)
