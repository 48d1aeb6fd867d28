"""The launcher's fold takes only what can be true of the run, and no message stops it;
and the launcher says when a running role goes silent.

Forged events once reached ``summary.json``: a ``weights.published`` at version 10**9
became ``steps: 1000000000`` with its digest, an eval at version 10**6 an eval point,
and one undecodable message killed ``rlbus up``. A 60 s SIGSTOP of the trainer went by
without one line.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import msgspec
import pytest

from bus.runtime import Bus
from bus.subjects import Topic, subject
from roles.up.monitor import RunMonitor
from roles.up.silence import silence_limit_s, silences
from roles.up.supervisor import RunFollower
from roles.up.view import LiveView
from schemas import BodyRef, MetricsReported, RunStopped, WeightsPublished, run_stopped_id
from schemas.run import ObjectRef


def weights(version: int, digest: str = "") -> WeightsPublished:
    ref = ObjectRef(kind="object", location=f"w{version}", digest=digest or f"d{version}")
    return WeightsPublished(run="r", version=version, step=version, weights=ref)


def batch(step: int) -> MetricsReported:
    """The orchestrator's report of the batch of ``step``: the fold's batch step."""
    return MetricsReported(run="r", role="orchestrator", step=step, values={"reward_mean": 0.5})


def evaluation(version: int) -> MetricsReported:
    return MetricsReported(run="r", role="eval", step=version, values={"env/avg@1": 0.5})


def test_forged_weights_versions_and_evals_are_rejected() -> None:
    m = RunMonitor(run="r", max_steps=4)
    for step in (1, 2):
        m.apply(batch(step))
        m.apply(weights(step))
    m.apply(weights(10**9, digest="forged"))  # past max_steps
    m.apply(msgspec.structs.replace(weights(2, digest="forged"), event_id="again"))  # v2 twice
    m.apply(msgspec.structs.replace(weights(2, digest="forged"), step=1))
    m.apply(weights(0, digest="forged"))  # versions start at 1
    m.apply(evaluation(10**6))  # no such weights
    m.apply(evaluation(-1))
    m.apply(batch(5))  # past max_steps
    m.apply(evaluation(2))
    s = m.summary()
    assert s["steps"] == 2 and s["final_weights_digest"] == "d2"
    assert list(s["eval"]) == ["2"] and m.assembled == 2
    assert s["rejected"] == 7


def test_weights_ahead_of_their_batch_wait_for_it() -> None:
    """The batch report and the weights come from different processes: weights stored
    first are folded once their batch step is seen, and rejected if it never is."""
    m = RunMonitor(run="r", max_steps=4)
    m.apply(batch(1))
    m.apply(weights(2))
    assert m.policy_version == 0
    m.apply(weights(1))
    assert m.policy_version == 1
    m.apply(batch(2))
    assert m.policy_version == 2 and m.final_digest == "d2"
    m.apply(weights(4, digest="forged"))  # within max_steps, but no batch 4 ever comes
    m.apply(RunStopped(run="r", event_id=run_stopped_id("r"), reason="max_steps", step=2))
    m.finish()
    assert m.summary()["rejected"] == 1 and m.policy_version == 2


def test_an_honest_run_rejects_nothing() -> None:
    m = RunMonitor(run="r", max_steps=3)
    m.apply(evaluation(0))
    for step in (1, 2, 3):
        m.apply(batch(step))
        m.apply(weights(step))
        m.apply(evaluation(step))
    m.finish()
    s = m.summary()
    assert (s["steps"], s["rejected"], s["undecodable"]) == (3, 0, 0)
    assert list(s["eval"]) == ["0", "1", "2", "3"]


@pytest.mark.nats
async def test_undecodable_messages_are_skipped_not_fatal(bus: Bus) -> None:
    """Garbage, and a body reference naming a bucket nats-py refuses (which raises no
    ``DecodeError``): both skipped and counted, and the fold reads on."""
    monitor = RunMonitor(run=bus.run, max_steps=2)
    follower = RunFollower(bus, monitor)
    follower.start()
    try:
        topic = subject(bus.run, Topic.WEIGHTS_PUBLISHED)
        await bus.js.publish(topic, b"\xc1 not msgpack")
        ref = BodyRef(bucket="no such bucket", name="x", size=1, digest="d", schema="?")
        await bus.js.publish(topic, msgspec.msgpack.encode(ref), headers={"Rl-Body": "ref"})
        await bus.publish(MetricsReported(run=bus.run, role="orchestrator", step=1, values={}))
        deadline = time.monotonic() + 20
        while monitor.assembled < 1:
            follower.check()  # raises what killed a reader
            assert time.monotonic() < deadline, "the fold stopped at the bad messages"
            await asyncio.sleep(0.05)
    finally:
        await follower.finish()
    follower.check()
    assert monitor.summary()["undecodable"] == 2


# -- silent roles: the decision is a pure function of heartbeat times and now ---------------


def test_the_silence_limit_is_a_few_heartbeats_and_at_least_10_s() -> None:
    assert silence_limit_s(2.0) == 10.0 and silence_limit_s(5.0) == 25.0


def test_a_role_is_told_silent_once_and_back_once() -> None:
    """One line when a running instance passes the limit, none while it stays silent,
    one when it beats again; an instance that left the registry is neither."""
    limit, silent = 10.0, set[str]()
    beats = {"trainer-h-1": 100.0, "inference-h-2": 108.0}
    assert silences(beats, 109.0, limit, silent) == ({}, set())
    newly, back = silences(beats, 111.0, limit, silent)
    assert newly == {"trainer-h-1": 11.0} and back == set()
    silent |= set(newly)
    assert silences(beats, 170.0, limit, silent) == ({"inference-h-2": 62.0}, set())
    silent.add("inference-h-2")
    assert silences(beats, 170.0, limit, silent) == ({}, set())  # told already
    beats = {"trainer-h-1": 171.0}  # beats again; inference-h-2 left the registry
    assert silences(beats, 172.0, limit, silent) == ({}, {"trainer-h-1"})


def test_the_live_view_shows_a_silent_role_until_it_beats_again() -> None:
    role = FakeRole("trainer")
    view = LiveView(RunMonitor(run="r", max_steps=1), [role], enabled=False)
    view.silence("trainer", time.time() - 12)
    assert "silent 12s" in view.styled_state(role)
    view.silence("trainer", None)
    assert "running" in view.styled_state(role)


@dataclass
class FakeRole:
    name: str
    alive: bool = True
    restarts: int = 0
