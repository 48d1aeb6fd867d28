"""Run identities against a real nats-server with authentication on: each role kind may
do its job and nothing more, and two runs on one server cannot reach each other.

One server for the module, serving runs A and B (``RunAuth(...).users()`` of both); each
run's stream, object store and registry are made by its ``launcher`` identity. A refused
publish or request gets no answer (the server reports a permissions violation to the
client's error callback), so refused calls wait 1 s and run concurrently.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import msgspec
import nats
import nats.errors
import pytest
from nats.js.api import AckPolicy, ConsumerConfig

from bus import codec, rpc
from bus.auth import RunAuth
from bus.children import die_with_parent
from bus.consumer import Consumer, Delivery, Subscription
from bus.errors import PublishError
from bus.kinds import KINDS, producers
from bus.offload import BodyStore
from bus.reader import LogReader
from bus.registry import Heartbeat, list_roles
from bus.runtime import Bus, BusSettings
from bus.server import find_binary
from bus.subjects import (
    TOPIC_OF,
    TOPICS,
    Topic,
    filter_subject,
    roles_bucket_name,
    subject_for,
)
from schemas import (
    BatchAssembled,
    DeadLettered,
    Event,
    GenerateRequest,
    GenerateResult,
    MetricsReported,
    TaskRequested,
    TraceCompleted,
    WeightsPublished,
    derive_id,
    new_id,
)
from schemas.arrays import pack_i32
from tests.samples import every_event

pytestmark = pytest.mark.nats

# One short try per publish: a refused one is never acknowledged.
FAST = BusSettings(
    publish_timeout_s=1.0, publish_attempts=1, publish_patience_s=0.0, ack_wait_s=2.0,
    nak_delay_s=0.1,
)  # fmt: skip
DECLARED = {"trainer": ["trainer"], "env": ["env-auth"], "algorithm": ["algorithm-grpo"]}
REFUSED_S = 1.0  # how long a refused request waits for the answer it never gets
ROLES = {"orchestrator": "orchestrator", "trainer": "trainer", "inference": "inference",
         "teacher": "teacher", "env": "env", "algorithm": "algorithm", "attach": "algorithm",
         "monitor": "monitor", "gateway": "gateway"}  # fmt: skip  # kind -> its registry role name


@dataclass
class Server:
    url: str
    a: RunAuth
    b: RunAuth


@dataclass
class Client:
    """A connection as one identity, with what the server reported to it."""

    bus: Bus
    errors: list[Exception]

    @property
    def js(self) -> Any:  # refused requests wait REFUSED_S, not nats-py's 5 s
        return self.bus.nc.jetstream(timeout=REFUSED_S)

    def violations(self) -> str:
        """What the server refused, lower case (as nats-py reports it)."""
        said = [str(e).lower() for e in self.errors]
        return "\n".join(s for s in said if "permissions violation" in s)

    def refused(self, what: str, subject: str) -> bool:
        """Whether the server refused to let it ``what`` ("publish", "subscription")."""
        return f'permissions violation for {what} to "{subject}"'.lower() in self.violations()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("auth")
    tag = uuid.uuid4().hex[:8]
    a = RunAuth.ensure(root / "a" / "auth", f"ta{tag}").declare(DECLARED)
    b = RunAuth.ensure(root / "b" / "auth", f"tb{tag}")
    port = _free_port()
    conf = {
        "listen": f"127.0.0.1:{port}",
        "jetstream": {"store_dir": str(root / "store")},
        "authorization": {"users": a.users() + b.users()},
    }
    path = root / "nats.json"
    path.write_text(json.dumps(conf))
    path.chmod(0o600)
    with (root / "nats.log").open("wb") as log:
        proc = subprocess.Popen(
            [find_binary(), "-c", str(path)], stdout=log, stderr=log, preexec_fn=die_with_parent()
        )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((root / "nats.log").read_text()) from None
                time.sleep(0.05)
        yield Server(f"nats://127.0.0.1:{port}", a, b)
    finally:
        proc.terminate()
        proc.wait(10)


def _creds(auth: RunAuth, kind: str) -> dict[str, str]:
    c = auth.creds(kind)
    return {"user": c.user, "password": c.password, "inbox_prefix": c.inbox_prefix}


async def connect(server: Server, auth: RunAuth, kind: str) -> Client:
    errors: list[Exception] = []

    async def on_error(e: Exception) -> None:
        errors.append(e)

    nc = await nats.connect(
        server.url, error_cb=on_error, allow_reconnect=False, connect_timeout=5,
        **_creds(auth, kind),
    )  # fmt: skip
    return Client(Bus(nc, auth.run, kind, FAST, auth.creds(kind)), errors)


@pytest.fixture(scope="module")
async def launchers(server: Server) -> AsyncIterator[dict[str, Bus]]:
    """Each run's launcher, having made the run's stream, object store and registry;
    run B holds an event, an object and a heartbeat that A must not reach."""
    out = {}
    for auth in (server.a, server.b):
        bus = await Bus.connect(
            server.url, run=auth.run, producer="launcher", settings=FAST,
            connect_timeout_s=10, **_creds(auth, "launcher"),
        )  # fmt: skip
        await bus.ensure_run()  # stream, an object store per kind, registry
        out[auth.run] = bus
    b = out[server.b.run]
    await b.publish(unique(events(server.b.run)[TaskRequested]))
    await b.objects.put("secret", b"of run B")
    await Heartbeat(b.js, b.run, "trainer", "t0").beat()
    yield out
    for bus in out.values():
        await bus.close()


def _as_own(event: Event, kind: str) -> Event:
    """A dead letter as ``kind``'s own role records one; any other event as it is."""
    if isinstance(event, DeadLettered):
        return msgspec.structs.replace(event, role=ROLES[kind])
    return event


def events(run: str) -> dict[type, Event]:
    return {type(e): e for e in every_event(run)}


def unique(event: Event) -> Event:
    return msgspec.structs.replace(event, event_id=new_id())


async def stored(bus: Bus) -> int:
    return int((await bus.js.stream_info(bus.stream)).state.messages)


async def refused(*calls: Any) -> list[BaseException | Any]:
    """Run ``calls`` concurrently; what each raised (or returned)."""
    return await asyncio.gather(*calls, return_exceptions=True)


async def test_a_client_without_credentials_is_refused(server: Server) -> None:
    """Anonymous, a wrong password, another run's password: the server says no. (Spoken
    in the protocol: nats-py leaks its socket when a connect is refused.)"""
    env_a = server.a.creds("env")
    for creds in ({}, {"user": env_a.user, "pass": "wrong"},
                  {"user": env_a.user, "pass": server.b.creds("env").password}):  # fmt: skip
        host, port = server.url.removeprefix("nats://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            assert (await reader.readline()).startswith(b"INFO ")
            hello = {"verbose": False, "pedantic": False, "protocol": 1, **creds}
            writer.write(f"CONNECT {json.dumps(hello)}\r\nPING\r\n".encode())
            await writer.drain()
            answer = await asyncio.wait_for(reader.readline(), 5)
            assert answer.startswith(b"-ERR 'Authorization Violation'"), answer
        finally:
            writer.close()
            await writer.wait_closed()
    ok = await connect(server, server.a, "reader")  # while a run's identity gets in
    await ok.bus.close()


async def test_env_publishes_traces_but_not_batches_or_weights(
    server: Server, launchers: dict[str, Bus]
) -> None:
    launcher = launchers[server.a.run]
    env = await connect(server, server.a, "env")
    ev = events(server.a.run)
    try:
        before = await stored(launcher)
        ack = await env.bus.publish(unique(ev[TraceCompleted]))
        assert ack.seq > 0
        results = await refused(
            env.bus.publish(unique(ev[BatchAssembled])),
            env.bus.publish(unique(ev[WeightsPublished])),
        )
        assert all(isinstance(r, PublishError) for r in results), results
        assert await stored(launcher) == before + 1
        for topic in (Topic.BATCH_ASSEMBLED, Topic.WEIGHTS_PUBLISHED):
            subj = filter_subject(server.a.run, topic)
            assert env.refused("publish", subj)
    finally:
        await env.bus.close()


async def test_each_kind_publishes_exactly_its_topics(
    server: Server, launchers: dict[str, Bus]
) -> None:
    """Every event a kind produces is stored (a dead letter: under its own role name);
    a core publish on any other topic (or on inference, for a kind that sends no
    requests), or a dead letter in another role's name, is refused."""
    run = server.a.run
    launcher = launchers[run]
    before = await stored(launcher)
    clients = {k: await connect(server, server.a, k) for k in KINDS if k != "launcher"}
    expected = 0
    try:
        for kind, c in clients.items():
            mine = [e for e in every_event(run) if kind in producers(TOPIC_OF[type(e)])]
            mine = [unique(_as_own(e, kind)) for e in mine]
            acks = await c.bus.publish_many(mine)
            assert all(not a.duplicate for a in acks), kind
            expected += len(mine)
            denied = [filter_subject(run, t).replace("*", "k") for t in TOPICS
                      if kind not in producers(t) or t == Topic.DEAD_LETTERED]  # fmt: skip
            if kind not in ("env", "algorithm", "attach"):
                denied.append(f"rl.{run}.infer.policy")
            for subj in denied:
                await c.bus.nc.publish(subj, b"forged")
            await c.bus.nc.flush()
        await asyncio.sleep(0.2)  # the server's -ERRs arrive after the flush's PONG
        for kind, c in clients.items():
            for t in TOPICS:
                subj = filter_subject(run, t).replace("*", "k")
                # (``dead.lettered.k``: no role is named k, so no kind's own)
                mine = kind in producers(t) and t != Topic.DEAD_LETTERED
                assert c.refused("publish", subj) == (not mine), (kind, t)
        assert await stored(launcher) == before + expected
    finally:
        for c in clients.values():
            await c.bus.close()


async def test_reader_reads_the_run_and_writes_nothing(
    server: Server, launchers: dict[str, Bus]
) -> None:
    run = server.a.run
    launcher = launchers[run]
    await launcher.publish(unique(events(run)[TaskRequested]))
    digest = await launcher.objects.put("readable", b"weights bytes")
    await Heartbeat(launcher.js, run, "orchestrator", "o0").beat()
    reader = await connect(server, server.a, "reader")
    try:
        total = await stored(launcher)
        entries = [e async for e in LogReader(reader.bus, idle_timeout_s=2).entries()]
        assert len(entries) == total > 0
        store = BodyStore(reader.bus.js, launcher.objects.bucket)
        assert await store.get("readable", digest) == b"weights bytes"
        assert "readable" in await store.names()
        listed = await list_roles(reader.bus.js, run)
        assert ("orchestrator", "o0") in [(r.role, r.instance) for r in listed]

        writes = [filter_subject(run, t).replace("*", "k") for t in Topic]
        writes += [f"rl.{run}.infer.policy", f"$O.RLOBJ_{run}.C.x", f"$O.RLOBJ_{run}.M.x",
                   f"$KV.{roles_bucket_name(run)}.{run}.reader.r0",
                   f"$JS.API.STREAM.PURGE.RL_{run}", f"$JS.API.STREAM.DELETE.RL_{run}",
                   f"$JS.API.CONSUMER.DURABLE.CREATE.RL_{run}.d",
                   f"$JS.API.CONSUMER.DELETE.RL_{run}.d"]  # fmt: skip
        for subj in writes:
            await reader.bus.nc.publish(subj, b"forged")
        await reader.bus.nc.flush()
        results = await refused(
            Heartbeat(reader.js, run, "reader", "r0").beat(),
            # a refused put times out like a leaderless one: tried again for patience_s
            BodyStore(reader.js, launcher.objects.bucket).put("forged", b"x", patience_s=1.0),
        )
        assert all(isinstance(r, nats.errors.TimeoutError) for r in results), results
        for subj in writes:
            assert reader.refused("publish", subj), subj
        assert await stored(launcher) == total
        assert "forged" not in await launcher.objects.names()
    finally:
        await reader.bus.close()


async def test_a_runs_identities_cannot_reach_another_run(
    server: Server, launchers: dict[str, Bus]
) -> None:
    """Neither the stream, objects and registry of run B (info, reads, consumers,
    deletes) nor its subjects and inboxes, for any identity of run A."""
    b = launchers[server.b.run]
    b_stored = await stored(b)
    clients = [await connect(server, server.a, k) for k in KINDS]
    try:
        kv, obj = f"KV_{roles_bucket_name(b.run)}", b.objects.stream
        key = f"$KV.{roles_bucket_name(b.run)}.{b.run}.trainer.t0"

        def attempts(c: Client) -> list[Any]:
            js = c.js
            return [
                js.stream_info(b.stream),
                js.get_msg(b.stream, 1),
                js.add_consumer(b.stream, ConsumerConfig(ack_policy=AckPolicy.NONE)),
                js.add_consumer(b.stream, ConsumerConfig(durable_name="steal")),
                js.delete_stream(b.stream),
                js.publish(f"rl.{b.run}.run.stopped", b"x"),
                js.object_store(b.objects.bucket),
                js.get_last_msg(obj, f"$O.{b.objects.bucket}.M.>"),
                js.purge_stream(obj),
                js.key_value(roles_bucket_name(b.run)),
                js.get_msg(kv, subject=key),
                js.get_msg(kv, subject=key, direct=True),
                js.publish(key, b"forged heartbeat"),
            ]

        seen: list[Any] = []
        for c in clients:  # B's subjects and inboxes: refused too
            for subj in (f"rl.{b.run}.>", "_INBOX.>", f"_INBOX_{b.run}_env.>", ">"):
                await c.bus.nc.subscribe(subj, cb=_collect(seen))
        results = await refused(*(call for c in clients for call in attempts(c)))
        assert all(isinstance(r, nats.errors.TimeoutError) for r in results), results
        await b.publish(unique(events(b.run)[TaskRequested]))
        await b.objects.put("more", b"of run B")
        await asyncio.sleep(0.2)
        assert seen == []
        for c in clients:
            assert c.refused("publish", f"$JS.API.STREAM.INFO.{b.stream}")
            assert c.refused("subscription", f"rl.{b.run}.>")
            assert c.refused("subscription", "_INBOX.>")
        assert await stored(b) == b_stored + 1
        assert len(await list_roles(b.js, b.run)) == 1
    finally:
        for c in clients:
            await c.bus.close()


async def test_another_identity_cannot_take_an_events_id(
    server: Server, launchers: dict[str, Bus]
) -> None:
    """A batch's header id is keyed by the orchestrator's identity: an env client that
    stores harmless metrics under the batch's event id and the three salted ids a
    squatted publish falls back to takes nothing; the orchestrator's batch is stored
    once, however often it is published, and a second orchestrator client (a restart)
    makes the same header id."""
    run = server.a.run
    orch, again, env = [await connect(server, server.a, k) for k in ("orchestrator", "orchestrator", "env")]  # fmt: skip
    try:
        batch = unique(events(run)[BatchAssembled])
        ids = [batch.event_id] + [derive_id(batch.event_id, "squatted", k) for k in (1, 2, 3)]
        for i in ids:
            squat = msgspec.structs.replace(unique(events(run)[MetricsReported]), role="env")
            ack = await env.bus.js.publish(subject_for(squat), codec.encode(squat),
                                           headers={codec.H_MSG_ID: i})  # fmt: skip
            assert not ack.duplicate
        assert orch.bus.msg_id(batch.event_id) == again.bus.msg_id(batch.event_id)
        assert orch.bus.msg_id(batch.event_id) not in ids
        assert env.bus.msg_id(batch.event_id) != orch.bus.msg_id(batch.event_id)
        first = await orch.bus.publish(batch)
        second = await again.bus.publish(batch)
        assert not first.duplicate and second.duplicate and second.seq == first.seq
        stored_batch = await orch.bus.decode_msg(
            await orch.bus.js.get_msg(orch.bus.stream, first.seq), (BatchAssembled,)
        )
        assert stored_batch.event_id == batch.event_id
    finally:
        for c in (orch, again, env):
            await c.bus.close()


async def test_no_kind_touches_another_kinds_objects_durables_or_dead_letters(
    server: Server, launchers: dict[str, Bus]
) -> None:
    """Least privilege between the run's own identities: inference cannot overwrite or
    purge the trainer's weights (it reads them); env cannot pull, ack or delete the
    trainer's durable nor make one under its name; an algorithm worker cannot dead-letter
    in the env server's name; an attached worker makes a durable of a new name."""
    run = server.a.run
    c = {k: await connect(server, server.a, k) for k in ("trainer", "inference", "env", "algorithm", "attach")}  # fmt: skip
    try:
        trainer = c["trainer"].bus
        digest = await trainer.objects.put("weights.v0", b"the real weights")
        await Consumer(trainer, Subscription("trainer", [(Topic.BATCH_ASSEMBLED, None)], _nothing), "trainer").ensure()  # fmt: skip
        attach = c["attach"].bus
        await Consumer(attach, Subscription("algorithm-new", [(Topic.TRACE_COMPLETED, None)], _nothing), "algorithm").ensure()  # fmt: skip
        theirs = BodyStore(c["inference"].bus.js, trainer.objects.bucket)
        env_js = c["env"].js
        forged_dead = msgspec.structs.replace(unique(events(run)[DeadLettered]), role="env")
        results = await refused(
            theirs.put("weights.v0", b"forged weights", patience_s=1.0),
            c["inference"].js.purge_stream(trainer.objects.stream),
            env_js.add_consumer(trainer.stream, ConsumerConfig(durable_name="trainer")),
            env_js.delete_consumer(trainer.stream, "trainer"),
            c["env"].bus.nc.request(
                f"$JS.API.CONSUMER.MSG.NEXT.{trainer.stream}.trainer",
                b'{"batch": 1, "no_wait": true}',
                timeout=REFUSED_S,
            ),
            c["algorithm"].bus.publish(forged_dead),
        )
        assert all(isinstance(r, nats.errors.TimeoutError | PublishError) for r in results), results
        assert await theirs.get("weights.v0", digest) == b"the real weights"
        assert await trainer.js.consumer_info(trainer.stream, "trainer")
        assert c["algorithm"].refused("publish", f"rl.{run}.dead.lettered.env")
        assert c["env"].refused("publish", f"$JS.API.CONSUMER.DELETE.{trainer.stream}.trainer")
        assert c["env"].refused("publish", f"$JS.API.CONSUMER.MSG.NEXT.{trainer.stream}.trainer")
        assert c["inference"].refused("publish", f"$JS.API.STREAM.PURGE.{trainer.objects.stream}")
    finally:
        for client in c.values():
            await client.bus.close()


async def _nothing(event: Event, d: Delivery) -> list[Event]:
    return []


def _collect(into: list[Any]) -> Any:
    async def cb(msg: Any) -> None:
        into.append(msg.subject)

    return cb


async def test_the_role_kinds_do_their_jobs(server: Server, launchers: dict[str, Bus]) -> None:
    """Durable work queue (orchestrator -> env, fetched and acked), objects (trainer
    stores and deletes, inference reads), heartbeats of every kind, inference requests."""
    run = server.a.run
    c = {k: await connect(server, server.a, k) for k in KINDS if k not in ("launcher", "reader")}
    try:
        # a task through env's durable pull consumer, its trace published, the task acked
        task = unique(events(run)[TaskRequested])
        task_seq = (await c["orchestrator"].bus.publish(task)).seq
        got: list[TaskRequested] = []
        stop = asyncio.Event()

        async def handle(event: TaskRequested, d: Delivery) -> list[Event]:
            if event.event_id != task.event_id:
                return []
            got.append(event)
            stop.set()
            trace = events(run)[TraceCompleted]
            return [msgspec.structs.replace(trace, event_id=derive_id(event.event_id, "t"))]

        env = c["env"].bus
        sub = Subscription("env-auth", [(Topic.TASK_REQUESTED, "reverse-text")], handle,
                           fetch_timeout_s=0.5, restart_at=1)  # fmt: skip
        await asyncio.wait_for(Consumer(env, sub, "env").run(stop), 10)
        assert [e.event_id for e in got] == [task.event_id]
        for _ in range(20):  # an ack is a core publish: the server takes it a moment later
            info = await env.js.consumer_info(env.stream, "env-auth")
            if info.ack_floor and info.ack_floor.stream_seq == task_seq:
                break
            await asyncio.sleep(0.05)
        acked = info.ack_floor.stream_seq if info.ack_floor else 0
        assert (acked, info.num_ack_pending, info.num_pending) == (task_seq, 0, 0)
        last = await env.js.get_last_msg(env.stream, subject_for(events(run)[TraceCompleted]))
        trace_id = (await env.decode_msg(last, (TraceCompleted,))).event_id
        assert trace_id == derive_id(task.event_id, "t")

        # objects: the trainer stores and deletes weights, inference reads them
        trainer = c["trainer"].bus
        weights = bytes(range(256)) * 4096  # 1 MB: 8 chunks through an ordered consumer
        digest = await trainer.objects.put("weights.v1", weights)
        inference = c["inference"].bus.bodies(trainer.objects.bucket)
        assert await inference.get("weights.v1", digest) == weights
        await trainer.objects.put("weights.v1", b"v" * 10)  # replaced: old chunks purged
        assert await trainer.objects.delete("weights.v1")
        assert "weights.v1" not in await trainer.objects.names()

        # heartbeats: every kind under its role names, listed by the reader
        for kind, client in c.items():
            await Heartbeat(client.bus.js, run, ROLES[kind], f"{kind}-0").beat()
        reader = await connect(server, server.a, "reader")
        try:
            listed = {r.instance for r in await list_roles(reader.bus.js, run)}
        finally:
            await reader.bus.close()
        assert {f"{k}-0" for k in c} <= listed

        # inference requests: env, algorithm and the gateway ask, inference and teacher
        # answer (inference on its own replica subject too: the gateway's sessions), with
        # signs of life meanwhile (each answer takes longer than the asker's silence_s)
        async def answer(req: GenerateRequest) -> GenerateResult:
            await asyncio.sleep(0.5)
            return GenerateResult(request_id=req.request_id, completion_ids=pack_i32([7]),
                                  logprobs=b"", finish_reason="stop", policy_version=0)  # fmt: skip

        subs = [
            await rpc.serve(c["inference"].bus.nc, f"rl.{run}.infer.policy", "infer-policy",
                            [GenerateRequest], answer),
            await rpc.serve(c["teacher"].bus.nc, f"rl.{run}.infer.teacher", "infer-teacher",
                            [GenerateRequest], answer),
            await rpc.serve(c["inference"].bus.nc, f"rl.{run}.infer.policy.inference-0",
                            "inference-0", [GenerateRequest], answer),
        ]  # fmt: skip
        await c["inference"].bus.nc.flush()
        await c["teacher"].bus.nc.flush()
        for asker, model in (("env", "policy"), ("env", "teacher"), ("algorithm", "policy"),
                             ("gateway", "policy"), ("gateway", "policy.inference-0")):  # fmt: skip
            req = GenerateRequest(request_id=f"{asker}-{model}", prompt_ids=pack_i32([1]))
            reply = await rpc.request(c[asker].bus.nc, f"rl.{run}.infer.{model}", req,
                                      [GenerateResult], 5, silence_s=0.3)  # fmt: skip
            assert reply.request_id == req.request_id
        for s in subs:
            await s.unsubscribe()
        for kind, client in c.items():
            assert client.violations() == "", kind
    finally:
        for client in c.values():
            with contextlib.suppress(Exception):
                await client.bus.close()
