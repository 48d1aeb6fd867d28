"""The inference client retries a request a replica dropped, against a real nats-server:
a dead replica costs one attempt (``attempt_timeout_s``), not the whole request."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from nats.aio.msg import Msg
from structlog.testing import capture_logs

from bus import codec, rpc
from bus.errors import NoResponders, RequestTimeout
from bus.runtime import Bus
from bus.subjects import infer_queue, infer_subject
from configs import ConfigError, load_config
from roles.lib.clients import InferenceClient
from schemas import GenerateRequest, GenerateResult, SamplingParams
from schemas.arrays import pack_f32, pack_i32

pytestmark = pytest.mark.nats

MODEL = "policy"


async def live_replica(bus: Bus) -> list[str]:
    """A replica of the model's queue group that answers; the request ids it saw."""
    seen: list[str] = []

    async def answer(req: GenerateRequest) -> GenerateResult:
        seen.append(req.request_id)
        return GenerateResult(
            request_id=req.request_id, completion_ids=pack_i32([7]), logprobs=pack_f32([-0.5]),
            finish_reason="stop", policy_version=3,
        )  # fmt: skip

    await rpc.serve(
        bus.nc, infer_subject(bus.run, MODEL), infer_queue(MODEL), [GenerateRequest], answer
    )
    return seen


async def generate(client: InferenceClient, rid: str) -> GenerateResult:
    res = await client.generate(MODEL, rid, [1, 2, 3], SamplingParams())
    assert isinstance(res, GenerateResult)
    return res


async def test_a_request_a_replica_dropped_is_answered_by_another(bus: Bus) -> None:
    """The replica that takes the request dies without answering: the next attempt goes
    to a live one, after about attempt_timeout_s, not request_timeout_s."""
    taken: list[str] = []
    live: list[list[str]] = []

    async def die_holding(msg: Msg) -> None:
        taken.append(codec.decode(msg.data, [GenerateRequest]).request_id)
        await dead.unsubscribe()  # gone, the request unanswered
        live.append(await live_replica(bus))

    subj = infer_subject(bus.run, MODEL)
    dead = await bus.nc.subscribe(subj, queue=infer_queue(MODEL), cb=die_holding)
    client = InferenceClient(bus, timeout_s=30.0, attempt_timeout_s=0.5)
    t0 = time.monotonic()
    with capture_logs() as logs:
        res = await generate(client, "req-1")
    elapsed = time.monotonic() - t0
    assert res.request_id == "req-1" and res.policy_version == 3
    assert taken == ["req-1"] and live == [["req-1"]]  # the same request id each attempt
    assert 0.45 <= elapsed < 3.0
    retries = [e for e in logs if e["event"] == "inference.retry"]
    assert [(e["attempt"], e["log_level"]) for e in retries] == [(1, "warning")]
    assert "RequestTimeout" in retries[0]["error"]


async def test_a_replica_that_falls_silent_is_left_at_once(bus: Bus, nats_server: Any) -> None:
    """Signs of life (``inference.silence_s``): the replica that takes the request sends
    them, then dies holding it (its connection gone, as at a kill -9): the request goes
    to a live replica after silence_s, not after attempt_timeout_s (20 s)."""
    import nats as nats_client

    got = asyncio.Event()

    async def hold_forever(req: GenerateRequest) -> GenerateResult:
        got.set()
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    doomed = await nats_client.connect(nats_server.url)
    subj = infer_subject(bus.run, MODEL)
    await rpc.serve(doomed, subj, infer_queue(MODEL), [GenerateRequest], hold_forever)
    await doomed.flush()
    client = InferenceClient(bus, timeout_s=30.0, attempt_timeout_s=20.0, silence_s=0.6)
    t0 = time.monotonic()
    with capture_logs() as logs:
        call = asyncio.create_task(generate(client, "req-s"))
        await asyncio.wait_for(got.wait(), 5)
        await asyncio.sleep(0.7)  # signs of life meanwhile: not retried yet
        assert not call.done()
        seen = await live_replica(bus)
        await doomed.close()  # the replica dies holding the request
        res = await asyncio.wait_for(call, 10)
    assert res.request_id == "req-s" and seen == ["req-s"]
    assert time.monotonic() - t0 < 5.0  # silence_s after the death, not attempt_timeout_s
    retries = [e for e in logs if e["event"] == "inference.retry"]
    assert len(retries) == 1 and "ReplicaSilent" in retries[0]["error"]


async def test_signs_of_life_keep_a_long_request_on_its_replica(bus: Bus) -> None:
    """A request that takes several silence_s is answered once, by its replica: its
    signs of life keep the requester waiting (no second attempt)."""
    seen: list[str] = []

    async def slow(req: GenerateRequest) -> GenerateResult:
        seen.append(req.request_id)
        await asyncio.sleep(1.5)
        return GenerateResult(request_id=req.request_id, completion_ids=pack_i32([7]),
                              logprobs=pack_f32([-0.5]), finish_reason="stop", policy_version=3)  # fmt: skip

    await rpc.serve(bus.nc, infer_subject(bus.run, MODEL), infer_queue(MODEL), [GenerateRequest], slow)  # fmt: skip
    client = InferenceClient(bus, timeout_s=30.0, attempt_timeout_s=20.0, silence_s=0.5)
    with capture_logs() as logs:
        res = await generate(client, "req-l")
    assert res.request_id == "req-l" and seen == ["req-l"]
    assert not [e for e in logs if e["event"] == "inference.retry"]


async def test_no_responders_is_retried_until_a_replica_subscribes(bus: Bus) -> None:
    """Nobody subscribed yet (inference starting): short backoffs, then the answer."""
    client = InferenceClient(bus, timeout_s=30.0, attempt_timeout_s=5.0)
    call = asyncio.create_task(generate(client, "req-2"))
    await asyncio.sleep(0.4)
    assert not call.done()
    seen = await live_replica(bus)
    res = await asyncio.wait_for(call, 5.0)
    assert res.request_id == "req-2" and seen == ["req-2"]


async def test_the_request_timeout_bounds_every_attempt_in_all(bus: Bus) -> None:
    """A replica that never answers: RequestTimeout once request_timeout_s is spent."""

    async def never(msg: Msg) -> None:
        return None

    await bus.nc.subscribe(infer_subject(bus.run, MODEL), queue=infer_queue(MODEL), cb=never)
    client = InferenceClient(bus, timeout_s=1.2, attempt_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(RequestTimeout, match="3 attempt") as err:
        await generate(client, "req-3")
    assert not isinstance(err.value, NoResponders)
    assert 1.15 <= time.monotonic() - t0 < 2.5


@pytest.mark.parametrize("silence_s", [None, 0.3])
async def test_no_responders_at_all_raises_no_responders(bus: Bus, silence_s: float | None) -> None:
    """With signs of life asked for too: the server's "no responders" ends each attempt
    at once (not after silence_s), and the request fails once timeout_s is spent."""
    client = InferenceClient(bus, timeout_s=0.5, attempt_timeout_s=0.5, silence_s=silence_s)
    with capture_logs() as logs, pytest.raises(NoResponders):
        await generate(client, "req-4")
    assert not [e for e in logs if "ReplicaSilent" in str(e.get("error", ""))]


def test_attempt_timeout_must_fit_in_the_request_timeout() -> None:
    cfg = load_config("default")
    assert (cfg.inference.attempt_timeout_s, cfg.inference.request_timeout_s) == (20.0, 60.0)
    with pytest.raises(ConfigError, match="inference.attempt_timeout_s"):
        load_config("default", ["inference.attempt_timeout_s=61"])
    with pytest.raises(ConfigError, match="inference.silence_s"):
        load_config("default", ["inference.silence_s=20"])
    client = InferenceClient.from_config(None, cfg.inference)  # type: ignore[arg-type]
    assert (client.timeout_s, client.attempt_timeout_s, client.silence_s) == (60.0, 20.0, 2.0)


async def own_replica(bus: Bus, instance: str) -> tuple[list[str], list[Any]]:
    """A replica in the group that also answers on its own subject (as inference does):
    the request ids it saw on either, and its subscriptions."""
    from bus.subjects import infer_replica_subject

    seen: list[str] = []

    async def answer(req: GenerateRequest) -> GenerateResult:
        seen.append(req.request_id)
        return GenerateResult(request_id=req.request_id, completion_ids=pack_i32([7]),
                              logprobs=pack_f32([-0.5]), finish_reason="stop", policy_version=3)  # fmt: skip

    subs = [
        await rpc.serve(bus.nc, infer_subject(bus.run, MODEL), infer_queue(MODEL), [GenerateRequest], answer),
        await rpc.serve(bus.nc, infer_replica_subject(bus.run, MODEL, instance), instance,
                        [GenerateRequest], answer),
    ]  # fmt: skip
    return seen, subs


async def test_a_session_stays_on_its_replica_and_moves_only_when_it_is_gone(bus: Bus) -> None:
    """Requests that name a replica all go to it (the gateway's X-Session-ID); with that
    replica gone, the same request is answered by another, at once."""
    from roles.gateway.role import session_replica

    names = ("inference-policy-a", "inference-policy-b")
    replicas = {name: await own_replica(bus, name) for name in names}
    seen = {name: r[0] for name, r in replicas.items()}
    client = InferenceClient(bus, timeout_s=10, attempt_timeout_s=5)
    target = session_replica("conversation-1", sorted(seen))
    other = next(n for n in seen if n != target)
    for k in range(6):
        res = await client.generate(MODEL, f"s{k}", [1, 2, 3], SamplingParams(), replica=target)
        assert isinstance(res, GenerateResult)
    assert len(seen[target]) == 6 and not seen[other]
    for sub in replicas[target][1]:
        await sub.unsubscribe()
    t0 = time.monotonic()
    res = await client.generate(MODEL, "after", [1, 2, 3], SamplingParams(), replica=target)
    assert isinstance(res, GenerateResult) and seen[other] == ["after"]
    assert time.monotonic() - t0 < 2.0  # no responders: straight to the group


def test_rendezvous_moves_a_session_only_when_its_replica_goes() -> None:
    from roles.gateway.role import session_replica

    replicas = [f"inference-policy-{i}" for i in range(5)]
    sessions = [f"s{k}" for k in range(200)]
    home = {s: session_replica(s, replicas) for s in sessions}
    assert len(set(home.values())) == 5  # spread over every replica
    gone = replicas[2]
    after = {s: session_replica(s, [r for r in replicas if r != gone]) for s in sessions}
    assert all(after[s] == home[s] for s in sessions if home[s] != gone)
    assert session_replica(None, replicas) is None and session_replica("s", []) is None
