"""Weights device to device in a real run (`rlbus up`, real processes, a real server):
``trainer.weights_via = "broadcast"`` (gloo pairs) with the inference replica killed while
versions stream, and ``"ipc"`` (a shared ring) with the trainer killed, so a new ring and
a new session must be found. Each run reaches max_steps, the restarted role serves
device-to-device versions again, the log holds every step once, and the final weights
equal a fresh replay of the recorded batches; `rlbus replay` reproduces every step, the
device-to-device versions checked by their device digest."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

from bus.runtime import Bus
from bus.server import EmbeddedServer
from tests.e2e.faults import assert_log_intact, read_seq_events, sigkill, time_to_next_step
from tests.e2e.helpers import reached_version, rlbus, rlbus_up, running_role, summary

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def log_events(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


async def swapped_via(log: Path, via: str, timeout_s: float) -> bool:
    """Wait (bounded) until ``log`` shows a version swapped in ``via`` the device path."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = await asyncio.to_thread(lambda: log.read_text() if log.exists() else "")
        # (a line being written is not a match yet)
        if any(
            '"weights.swapped"' in line and f'"via": "{via}"' in line for line in text.splitlines()
        ):
            return True
        await asyncio.sleep(0.2)
    return False


@pytest.mark.parametrize(("via", "killed"), [("broadcast", "inference"), ("ipc", "trainer")])
async def test_a_role_killed_while_weights_move_device_to_device(
    tmp_path: Path, via: str, killed: str
) -> None:
    run, steps = f"dev-{via}", 16
    proc = rlbus_up(tmp_path, run, f"max_steps={steps}", f"trainer.weights_via={via}",
                    "trainer.store_weights_every=4", "trainer.checkpoint_interval=4")  # fmt: skip
    url = await reached_version(proc, tmp_path, run, 3, timeout_s=300)
    assert url is not None, "the run never reached version 3"
    # Killed only once a version came device to device: a replica killed before it joined
    # the trainer's session is never a member to lose (a slow start does that).
    logs = tmp_path / run / "logs"
    assert await swapped_via(logs / "inference-policy-0.log", via, timeout_s=120), (
        f"inference never served a version sent via {via}"
    )
    bus = await Bus.connect(url, run=run, producer="e2e")
    try:
        pid = (await running_role(url, run, killed)).pid
        await time_to_next_step(bus, sigkill(pid), steps=3)
    finally:
        await bus.close()
    out, _ = await asyncio.to_thread(proc.communicate, timeout=600)
    assert proc.returncode == 0, out[-4000:]
    s = summary(tmp_path, run)
    assert s["steps"] == steps and list(s["restarts"].values()) == [1], s["restarts"]

    swaps = [e for e in log_events(logs / "inference-policy-0.log") if e["event"] == "weights.swapped"]  # fmt: skip
    assert {e["via"] for e in swaps} == {via}  # every version came device to device
    assert max(int(str(e["version"])) for e in swaps) == steps
    trainer = log_events(logs / "trainer.log")
    if via == "broadcast":  # the dead replica was dropped and its successor joined
        assert any(e["event"] == "weights.member_lost" for e in trainer)
        assert sum(e["event"] == "weights.member_joined" for e in trainer) >= 2
    else:  # the restarted trainer made a ring of its own, and inference copied from it
        rings = {e["handle"] for e in trainer if e["event"] == "weights.ring"}
        assert len(rings) == 2

    with EmbeddedServer(tmp_path / run / "nats") as server:
        seq_events = await read_seq_events(server.url, run)
    assert_log_intact(seq_events, steps, tmp_path / run)
    # Replay checks the versions that were only sent device to device by their digest too.
    replay = await asyncio.to_thread(rlbus, tmp_path, "replay", run, "trainer")
    assert replay.returncode == 0 and "REPRODUCED" in replay.stdout, replay.stdout + replay.stderr
    assert "dev:float32:" in replay.stdout and "sha256:" in replay.stdout
