"""The env server against a real nats-server, with an in-test inference responder on the bus.

The responder is a real NATS request/reply server (``bus.rpc.serve`` on the run's
``infer`` subject) that answers like a perfect policy by reading the prompt tokens, so
rewards of 1.0 prove the whole path: rendering, tokens on the wire, decoding, scoring.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from bus import rpc
from bus.reader import read_log
from bus.runtime import Bus, BusSettings
from bus.server import EmbeddedServer
from bus.subjects import TOPICS, Topic, durable_name, infer_queue, infer_subject
from roles.env_server.role import EnvServer, client_generate
from roles.lib.clients import InferenceClient
from roles.lib.envs.builtin.alphabet_sort import parse_names
from roles.lib.envs.registry import env_key
from roles.lib.model.render import Renderer
from roles.lib.model.tokenizer import build_tokenizer
from roles.runtime.role import serve_role
from schemas import (
    EvalCompleted,
    Event,
    GenerateRequest,
    GenerateResult,
    MetricsReported,
    SamplingParams,
    TaskRef,
    TaskRequested,
    TraceCompleted,
)
from schemas.arrays import f32, i32, mask, pack_f32, pack_i32

pytestmark = pytest.mark.nats

TOK = build_tokenizer()
R = Renderer(TOK)
SETTINGS = BusSettings(ack_wait_s=2.0, nak_delay_s=0.1, max_deliver=3)
_MSG = re.compile(r"<\|(\w+)\|>(.*?)<\|end\|>", re.S)


def oracle(prompt_text: str) -> str:
    """The right next answer for a reverse-text or alphabet-sort prompt, from its text."""
    msgs = _MSG.findall(prompt_text)
    users = [c for r, c in msgs if r == "user"]
    if msgs and msgs[0] == ("system", "Reverse the text."):
        return users[-1][::-1]
    names = [n for u in users for n in parse_names(u.removeprefix("Add: "))]
    return ",".join(sorted(names))


class Responder:
    """Answers GenerateRequests on the run's policy subject; can be told to hold replies."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.hold = False
        self.released = asyncio.Event()
        self.request_ids: list[str] = []
        self.envs: set[str | None] = set()
        self.sub: Any = None

    async def start(self, bus: Bus, model: str = "policy") -> Responder:
        self.sub = await rpc.serve(bus.nc, infer_subject(bus.run, model), infer_queue(model), [GenerateRequest], self.answer)  # fmt: skip
        return self

    async def answer(self, req: GenerateRequest) -> GenerateResult:
        self.request_ids.append(req.request_id)
        self.envs.add(req.env)
        if self.hold:
            await self.released.wait()
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        text = TOK.decode(i32(req.prompt_ids).tolist())
        ids = TOK.encode(oracle(text), add_special_tokens=False) + [R.end_token_id]
        ids = ids[: req.sampling.max_completion_tokens]
        return GenerateResult(
            request_id=req.request_id, completion_ids=pack_i32(ids), logprobs=pack_f32([-0.1] * len(ids)),
            finish_reason="stop" if ids[-1] == R.end_token_id else "length", policy_version=1,
        )  # fmt: skip

    async def stop(self) -> None:
        self.released.set()
        if self.sub is not None:
            await self.sub.unsubscribe()


@contextlib.asynccontextmanager
async def env_server(
    url: str, run: str, env: str, timeout_s: float = 10.0, **kw: Any
) -> AsyncIterator[EnvServer]:
    """An EnvServer replica with its own connection, served in a task of this loop."""
    bus = await Bus.connect(url, run=run, producer=f"env-{env}", settings=SETTINGS)
    client = InferenceClient(bus, timeout_s=timeout_s)
    server = EnvServer(bus, f"env-{env_key(env)}-{id(bus)}", env, R, client_generate(client),
                       metrics_interval_s=0.5, heartbeat_interval_s=0.5, **kw)  # fmt: skip
    task = asyncio.create_task(serve_role(server, install_signals=False))
    try:
        yield server
    finally:
        server.request_stop()
        await asyncio.wait_for(task, 30)


def requests(
    run: str, env: str, n: int, group_size: int, split: str = "train", **kw: Any
) -> list[TaskRequested]:
    return [
        TaskRequested(run=run, event_id=f"{env}-{split}-{i}", env=env, task=TaskRef(index=i, split=split),
                      group_id=f"g-{env}-{i}", group_size=group_size, seed=i, step=1,
                      sampling=SamplingParams(temperature=1.0, max_completion_tokens=40), **kw)
        for i in range(n)
    ]  # fmt: skip


async def collect(bus: Bus, topic: Topic, key: str | None, want: int, timeout_s: float = 30.0, settle_s: float = 0.7) -> list[Event]:  # fmt: skip
    """Every event on a topic from the start of the log: waits for ``want``, then reads on
    for ``settle_s`` more so extra (duplicate) events would be seen too."""

    async def read() -> list[Event]:
        return [e async for e in read_log(bus, [(topic, key)], (TOPICS[topic].schema,))]

    async with asyncio.timeout(timeout_s):
        while len(await read()) < want:
            await asyncio.sleep(0.2)
        await asyncio.sleep(settle_s)
        return await read()


async def settled(bus: Bus, durable: str, timeout_s: float = 15.0) -> None:
    """Wait until the durable consumer has nothing pending or unacked."""
    async with asyncio.timeout(timeout_s):
        while True:
            info = await bus.js.consumer_info(bus.stream, durable)
            if info.num_pending == 0 and info.num_ack_pending == 0:
                return
            await asyncio.sleep(0.1)


def check_arrays(ev: TraceCompleted) -> None:
    for m in ev.trace.messages:
        n = len(i32(m.token_ids))
        assert len(mask(m.sampled)) == n and len(f32(m.logprobs)) == n


async def test_rollouts_of_both_envs_complete_on_the_stream(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """reverse-text and alphabet-sort requests become TraceCompleted events (one per rollout,
    per-token arrays aligned, perfect answers scored 1), an eval request one EvalCompleted,
    metrics are reported, and every request is acked."""
    responder = await Responder().start(bus)
    try:
        async with env_server(nats_server.url, bus.run, "reverse-text"), env_server(nats_server.url, bus.run, "alphabet-sort"):  # fmt: skip
            await bus.publish_many(
                requests(bus.run, "reverse-text", 2, 2) + requests(bus.run, "alphabet-sort", 2, 2)
                + requests(bus.run, "reverse-text", 1, 2, split="eval")
            )  # fmt: skip
            rev = await collect(bus, Topic.TRACE_COMPLETED, "reverse-text", 4)
            srt = await collect(bus, Topic.TRACE_COMPLETED, "alphabet-sort", 4)
            (ev,) = await collect(bus, Topic.EVAL_COMPLETED, "reverse-text", 1)
            metrics = await collect(
                bus, Topic.METRICS_REPORTED, "env-reverse-text", 1, settle_s=0.1
            )
            await settled(bus, durable_name("env", "reverse-text"))
            await settled(bus, durable_name("env", "alphabet-sort"))
    finally:
        await responder.stop()
    for events, turns in ((rev, 1), (srt, 3)):
        assert len(events) == 4
        for e in events:
            assert isinstance(e, TraceCompleted) and e.trace.ok, e.trace.errors
            check_arrays(e)
            assert e.trace.reward == 1.0 and e.trace.num_turns == turns
            assert e.causation_id == e.request_id and e.group_size == 2 and e.step == 1
        assert sorted((e.request_id, e.trace.sample_index) for e in events) == sorted(
            (r, i) for r in {e.request_id for e in events} for i in range(2)
        )
    assert isinstance(ev, EvalCompleted) and ev.rewards == [1.0, 1.0] and ev.errors == 0
    assert all(t.task.split == "eval" for t in ev.traces)
    assert isinstance(metrics[0], MetricsReported) and metrics[0].values["reward_mean"] == 1.0
    assert responder.envs <= {
        "reverse-text",
        "alphabet-sort",
        None,
    }  # None until the client passes env


async def test_two_replicas_split_one_envs_requests(nats_server: EmbeddedServer, bus: Bus) -> None:
    """Two replicas on one durable share the work: every rollout is published exactly once."""
    responder = await Responder(delay_s=0.05).start(bus)
    try:
        async with env_server(nats_server.url, bus.run, "reverse-text", concurrency=2) as a, env_server(nats_server.url, bus.run, "reverse-text", concurrency=2) as b:  # fmt: skip
            await bus.publish_many(requests(bus.run, "reverse-text", 12, 2))
            events = await collect(bus, Topic.TRACE_COMPLETED, "reverse-text", 24)
            await settled(bus, durable_name("env", "reverse-text"))
            handled = (a.total_rollouts, b.total_rollouts)
    finally:
        await responder.stop()
    counts = Counter(e.trace.rollout_id for e in events if isinstance(e, TraceCompleted))
    assert len(counts) == 24 and set(counts.values()) == {1}
    assert all(h > 0 for h in handled) and sum(handled) == 24


async def test_inference_timeout_gives_errored_trace_and_acks(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """A responder that never answers: the rollout becomes an inference_timeout trace with
    reward 0, and the request is still acked (not redelivered forever)."""
    responder = await Responder().start(bus)
    responder.hold = True
    try:
        async with env_server(nats_server.url, bus.run, "reverse-text", timeout_s=0.3):
            await bus.publish_many(requests(bus.run, "reverse-text", 1, 2))
            events = await collect(bus, Topic.TRACE_COMPLETED, "reverse-text", 2)
            await settled(bus, durable_name("env", "reverse-text"))
    finally:
        await responder.stop()
    assert len(events) == 2
    for e in events:
        assert isinstance(e, TraceCompleted)
        assert [x.kind for x in e.trace.errors] == ["inference_timeout"] and e.trace.reward == 0.0
    assert len(responder.request_ids) == 2  # answered once each: no redelivery


# A replica in its own process, so it can be SIGKILLed mid-rollout (no nak, no drain).
_REPLICA = """
import asyncio, sys
from bus.runtime import Bus, BusSettings
from roles.runtime.role import serve_role
from roles.lib.clients import InferenceClient
from roles.env_server.role import EnvServer, client_generate
from roles.lib.model.render import Renderer
from roles.lib.model.tokenizer import build_tokenizer

async def main(url, run):
    bus = await Bus.connect(url, run=run, producer="doomed",
                            settings=BusSettings(ack_wait_s=2.0, nak_delay_s=0.1, max_deliver=3))
    gen = client_generate(InferenceClient(bus, timeout_s=60))
    await serve_role(EnvServer(bus, "doomed", "reverse-text", Renderer(build_tokenizer()), gen))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def start_replica(url: str, run: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-c", _REPLICA, url, run]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def test_killed_replica_request_is_answered_by_another(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """A replica SIGKILLed mid-rollout never acks; after ack_wait another replica gets the
    request, reruns it with the same request ids and publishes every rollout exactly once."""
    responder = await Responder().start(bus)
    responder.hold = True  # the doomed replica's generate calls never return
    proc = start_replica(nats_server.url, bus.run)
    try:
        await bus.publish_many(requests(bus.run, "reverse-text", 1, 2))
        async with asyncio.timeout(60):
            while len(responder.request_ids) < 2:  # the doomed replica is mid-rollout
                assert proc.poll() is None, "replica died on its own"
                await asyncio.sleep(0.1)
        proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(proc.wait, 10)
        first = list(responder.request_ids)
        responder.hold = False
        async with env_server(nats_server.url, bus.run, "reverse-text"):
            events = await collect(bus, Topic.TRACE_COMPLETED, "reverse-text", 2)
            await settled(bus, durable_name("env", "reverse-text"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await responder.stop()
    counts = Counter(e.trace.rollout_id for e in events if isinstance(e, TraceCompleted))
    assert len(counts) == 2 and set(counts.values()) == {1}
    assert all(
        e.trace.ok and e.trace.reward == 1.0 for e in events if isinstance(e, TraceCompleted)
    )
    assert sorted(responder.request_ids[len(first) :]) == sorted(first)  # same ids on redelivery


async def test_a_bug_in_env_code_dead_letters_its_task_at_once(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """The buggy env's rubric divides by zero on some tasks: each such task is
    dead-lettered on its first delivery with the env's traceback (no retry: a bug fails
    the same way again), the other tasks' traces are published, and the replica lives on."""
    from roles.lib.envs.registry import make_env
    from schemas import DeadLettered

    env_id = "tests.e2e.buggy_env:make"
    env, key = make_env(env_id), env_key(env_id)
    reqs = [
        TaskRequested(run=bus.run, event_id=f"bug-{i}", env=key, task=TaskRef(index=i),
                      group_id=f"g-bug-{i}", group_size=2, seed=i)
        for i in range(6)
    ]  # fmt: skip
    buggy = {r.event_id for r in reqs if len(str(env.task("train", r.task.index))) % 3 == 0}
    assert 0 < len(buggy) < len(reqs)  # the fixture has both kinds of task
    responder = await Responder().start(bus)
    try:
        async with env_server(nats_server.url, bus.run, env_id):
            await bus.publish_many(reqs)
            dead = await collect(bus, Topic.DEAD_LETTERED, "env", len(buggy))
            traces = await collect(bus, Topic.TRACE_COMPLETED, key, 2 * (len(reqs) - len(buggy)))
    finally:
        await responder.stop()
    assert {d.causation_id for d in dead} == buggy
    for d in dead:
        assert isinstance(d, DeadLettered) and d.deliveries == 1
        assert "ZeroDivisionError" in d.error and "buggy_env.py" in d.error
    assert {e.request_id for e in traces} == {r.event_id for r in reqs} - buggy


async def test_filters_judge_train_traces_and_report_rates(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """A length filter (enforced) and a monitor-only one: verdicts are on the published
    traces, and the env server's metrics report each filter's rate and the filtered share."""
    from configs.orchestrator import FilterConfig
    from roles.lib.envs.filters import build_filters

    filters = build_filters([
        FilterConfig(type="length", name="short", options={"min_tokens": 6}),
        FilterConfig(type="repetition", enforce=False),
    ])  # fmt: skip
    responder = await Responder().start(bus)
    try:
        async with env_server(nats_server.url, bus.run, "reverse-text", filters=filters):
            await bus.publish_many(requests(bus.run, "reverse-text", 4, 2))
            events = await collect(bus, Topic.TRACE_COMPLETED, "reverse-text", 8)
            (metrics, *_) = await collect(
                bus, Topic.METRICS_REPORTED, "env-reverse-text", 1, settle_s=0.1
            )
    finally:
        await responder.stop()
    traces = [e.trace for e in events if isinstance(e, TraceCompleted)]
    for t in traces:
        assert [v.name for v in t.filters] == ["short", "repetition"]
        short = t.filters[0]
        assert short.flagged == (short.value < 6) and t.is_filtered == short.flagged
    flagged = sum(t.is_filtered for t in traces)
    assert 0 < flagged < len(traces)  # the oracle's answers are 3 to 8 characters
    assert isinstance(metrics, MetricsReported)
    assert metrics.values["filtered"] == pytest.approx(flagged / len(traces))
    assert metrics.values["filter_short"] == pytest.approx(flagged / len(traces))
