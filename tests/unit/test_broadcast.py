"""Weights sent over torch.distributed pairs (``trainer.weights_via = "broadcast"``), gloo
on the CPU, between real processes: replicas join a trainer's session as they come,
receive each version checked against its device digest, a dead replica never holds the
trainer or the others, and a restarted trainer's new session is joined again."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from roles.lib.model.broadcast import BroadcastHub, BroadcastReceiver
from roles.lib.model.shared_weights import PAD, Layout, WeightsRing
from schemas import ObjectRef

CPU = torch.device("cpu")


def state(seed: int, numel: int = 3 * PAD) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(numel // 3, generator=g), "b.weight": torch.randn(numel // 2, generator=g)}  # fmt: skip


def _replica(refs: Any, out: Any, numel: int) -> None:
    """A replica: receive each announced version, report (version, first value) or the error."""
    layout = Layout.of(state(0, numel))
    receiver = BroadcastReceiver(layout, CPU)
    into = torch.empty(layout.numel)
    while (ref := refs.get()) is not None:
        try:
            got = receiver.receive(ref, into, timeout_s=20)
            out.put((ref.digest, float(got[0])))
        except Exception as e:  # noqa: BLE001 - reported to the test
            out.put((ref.digest, repr(e)))


class Replica:
    def __init__(self, numel: int) -> None:
        ctx = mp.get_context("spawn")
        self.refs, self.out = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=_replica, args=(self.refs, self.out, numel), daemon=True)
        self.process.start()

    def receive(self, ref: ObjectRef, timeout_s: float = 60) -> tuple[str, Any]:
        self.refs.put(ref)
        return self.out.get(timeout=timeout_s)  # type: ignore[no-any-return]


@pytest.fixture
def hub(tmp_path: Path) -> Any:
    events: list[tuple[str, dict[str, Any]]] = []
    ring = WeightsRing.create(Layout.of(state(0)), torch.float32, CPU, tmp_path)
    hub = BroadcastHub(ring, "127.0.0.1", lambda e, f: events.append((e, f)))
    hub.events = events  # type: ignore[attr-defined]
    yield hub
    hub.close()
    ring.close()


def announce(hub: BroadcastHub, version: int, seed: int) -> tuple[ObjectRef, float]:
    s = state(seed)
    return hub.announce(version, hub.ring.write(version, s)), float(s["a.weight"][0])


def test_replicas_join_as_they_come_and_receive_each_version_checked(hub: BroadcastHub) -> None:
    first = Replica(3 * PAD)
    ref1, value1 = announce(hub, 1, seed=1)
    assert first.receive(ref1) == (ref1.digest, value1)
    ref2, value2 = announce(hub, 2, seed=2)
    assert first.receive(ref2) == (ref2.digest, value2)
    late = Replica(3 * PAD)  # joins at version 2: gets it at once
    assert late.receive(ref2) == (ref2.digest, value2)
    ref3, value3 = announce(hub, 3, seed=3)
    assert first.receive(ref3) == (ref3.digest, value3) == late.receive(ref3)
    assert hub.live_members == 2
    wrong = ObjectRef(kind=ref3.kind, location=ref3.location, size=ref3.size, digest="dev:float32:" + "0" * 16)  # fmt: skip
    digest, error = first.receive(wrong)
    assert "WeightsDigestMismatch" in error


def test_a_dead_replica_holds_neither_the_trainer_nor_the_others(
    hub: BroadcastHub, tmp_path: Path
) -> None:
    """A replica killed while versions stream is dropped (``weights.member_lost``); the
    trainer's announcements never wait, and the live replica gets every version."""
    alive, doomed = Replica(3 * PAD), Replica(3 * PAD)
    ref, value = announce(hub, 1, seed=1)
    assert alive.receive(ref)[1] == value and doomed.receive(ref)[1] == value
    os.kill(doomed.process.pid, signal.SIGKILL)
    doomed.process.join(10)
    for version in range(2, 8):  # (announcing only hands the version to the senders)
        ref, value = announce(hub, version, seed=version)
        assert alive.receive(ref) == (ref.digest, value)
    deadline = time.monotonic() + 30
    while hub.live_members != 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert hub.live_members == 1
    assert any(e == "weights.member_lost" for e, _ in hub.events)  # type: ignore[attr-defined]


def test_a_restarted_trainer_is_a_new_session_the_replica_joins_again(tmp_path: Path) -> None:
    replica = Replica(3 * PAD)
    for attempt in range(2):  # the second hub: a trainer process started again
        ring = WeightsRing.create(Layout.of(state(0)), torch.float32, CPU, tmp_path / str(attempt))
        hub = BroadcastHub(ring, "127.0.0.1")
        try:
            ref, value = announce(hub, 5 + attempt, seed=attempt)
            assert replica.receive(ref) == (ref.digest, value)
        finally:
            hub.close()
            ring.close()


def test_a_gone_trainers_announcements_fail_fast(hub: BroadcastHub) -> None:
    """A replica started after its trainer died meets announcements of a session no one
    hosts any more: the first fails (reaching the store), the others of that session are
    refused without trying again (a restarted replica steps over them to a stored one)."""
    with socket.socket() as s:  # a port no one listens on: the dead trainer's store
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    refs = [announce(hub, v, seed=v)[0] for v in (1, 2)]
    dead = [msgspec.structs.replace(r, location=r.location.replace(str(hub.store.port), str(port)))
            for r in refs]  # fmt: skip
    receiver = BroadcastReceiver(Layout.of(state(0)), CPU)
    into = torch.empty(hub.ring.layout.numel)
    with pytest.raises(Exception):  # noqa: B017, PT011 - the store's own error
        receiver.receive(dead[1], into, timeout_s=1)
    with pytest.raises(ConnectionError, match="is gone"):  # not tried again
        receiver.receive(dead[0], into, timeout_s=5)
