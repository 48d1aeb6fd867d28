"""Request/reply in queue groups, and the live role registry, against a real server."""

from __future__ import annotations

import asyncio
import os

import pytest

from bus import rpc
from bus.errors import RequestTimeout
from bus.registry import Heartbeat, is_alive, list_roles, roles_bucket
from bus.runtime import Bus
from schemas import GenerateRequest, GenerateResult, ScoreRequest
from schemas.arrays import pack_i32

pytestmark = pytest.mark.nats


async def test_two_responders_in_a_queue_group_share_requests(bus: Bus) -> None:
    """Each request is answered once, and both replicas answer some."""
    answered: dict[str, int] = {"a": 0, "b": 0}

    def responder(name: str):  # noqa: ANN202
        async def handle(req: GenerateRequest) -> GenerateResult:
            answered[name] += 1
            await asyncio.sleep(0.005)
            return GenerateResult(
                request_id=req.request_id,
                completion_ids=pack_i32([1]),
                logprobs=b"",
                finish_reason=name,
                policy_version=0,
            )

        return handle

    subj = f"rl.{bus.run}.infer.policy"
    subs = [
        await rpc.serve(bus.nc, subj, "infer-policy", [GenerateRequest, ScoreRequest], responder(n))
        for n in answered
    ]
    replies = await asyncio.gather(
        *[
            rpc.request(
                bus.nc,
                subj,
                GenerateRequest(request_id=str(i), prompt_ids=pack_i32([1, 2])),
                [GenerateResult],
                5,
            )
            for i in range(60)
        ]
    )
    assert sorted(int(r.request_id) for r in replies) == list(range(60))
    assert sum(answered.values()) == 60
    assert answered["a"] > 0 and answered["b"] > 0
    for s in subs:
        await s.unsubscribe()


async def test_request_without_responders_times_out_clearly(bus: Bus) -> None:
    with pytest.raises(RequestTimeout):
        await rpc.request(
            bus.nc,
            f"rl.{bus.run}.infer.nobody",
            GenerateRequest(request_id="x", prompt_ids=b""),
            [GenerateResult],
            0.3,
        )


async def test_heartbeats_list_live_roles_and_mark_stopped_ones(bus: Bus) -> None:
    """A running role appears in the registry; after stop() it is listed as stopped, not alive."""
    hb = Heartbeat(bus.js, bus.run, "trainer", "trainer-0", interval_s=0.1, consumer="trainer")
    hb.start()
    await asyncio.sleep(0.3)
    roles = await list_roles(bus.js, bus.run)
    assert [(r.role, r.instance, r.pid) for r in roles] == [("trainer", "trainer-0", os.getpid())]
    assert is_alive(roles[0], 0.1)
    await hb.stop()
    (stopped,) = await list_roles(bus.js, bus.run)
    assert stopped.status == "stopped" and not is_alive(stopped, 0.1)


async def test_registry_lists_only_this_runs_live_keys(bus: Bus) -> None:
    """Another run whose id shares a prefix is not listed; a deleted key is not listed."""
    mine = Heartbeat(bus.js, bus.run, "trainer", "t0")
    other = Heartbeat(bus.js, bus.run + "x", "trainer", "t0")
    gone = Heartbeat(bus.js, bus.run, "inference", "i0")
    for hb in (mine, other, gone):
        await hb.beat()
    await (await roles_bucket(bus.js, bus.run)).delete(gone.key)
    assert [(r.run, r.instance) for r in await list_roles(bus.js, bus.run)] == [(bus.run, "t0")]
