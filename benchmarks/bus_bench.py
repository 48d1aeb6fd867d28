"""Bus micro-benchmark: trace-sized events through rlbus's runtime vs raw nats-py.

Same server, same run, same payload size (~23 KB, a realistic Trace), measured side by
side, best of alternating rounds. Publish: rlbus ``publish_many`` (encode, headers, dedup
id, pipelined acks) vs raw ``publish_async`` with a bounded window. Consume: rlbus durable
``Consumer`` (fetch, decode to the Trace type, handle, ack) vs raw ``fetch(64)`` + ack.

Two raw baselines: ``raw`` moves pre-encoded bytes and never decodes them (the ceiling
of the wire), ``raw_msgspec`` is what a hand-written nats-py app does with the same
events (msgspec encode before publishing, decode after fetching). The runtime's own
overhead is the ratio to ``raw_msgspec``; the ratio to ``raw`` includes serialisation.

The same rlbus publish and consume also run, in the same alternating rounds, on a
three-node loopback JetStream cluster with the stream replicated three times (``R3``,
what ``rlbus up --cluster 3`` uses): every message is stored on three nodes before it
is acknowledged. All three nodes share this machine's cores with the benchmark.

    python -m benchmarks.bus_bench [--n 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from typing import Any

import msgspec
import nats
from nats.js.api import AckPolicy, ConsumerConfig, StreamConfig

from benchmarks.common import save
from bus.cluster import EmbeddedCluster
from bus.consumer import Consumer, Delivery, Subscription
from bus.runtime import Bus, BusSettings
from bus.server import EmbeddedServer
from bus.subjects import Topic, subject
from schemas import TraceCompleted
from tests.samples import every_event, trace


def trace_event(run: str, i: int) -> TraceCompleted:
    """A ~24 KB TraceCompleted: 8 messages x 300 tokens (NATS_NOTES' trace size)."""
    t = trace(run, rollout=f"r{i}", n_tokens=300)
    msgs = [
        msgspec.structs.replace(t.messages[1], id=k, parent=k - 1 if k else None) for k in range(8)
    ]
    t = msgspec.structs.replace(t, messages=msgs)
    (template,) = [e for e in every_event(run) if isinstance(e, TraceCompleted)]
    return msgspec.structs.replace(template, trace=t, event_id=f"ev-{run}-{i}")


async def bench_raw(
    url: str, run: str, payloads: list[Any], serialise: bool = False
) -> dict[str, float]:
    nc = await nats.connect(url)
    js = nc.jetstream(publish_async_max_pending=256)
    stream = f"RAW_{run}"
    subj = f"raw.{run}.trace"
    await js.add_stream(StreamConfig(name=stream, subjects=[subj]))
    t0 = time.perf_counter()
    futs = []
    encode = msgspec.msgpack.Encoder().encode
    for i, p in enumerate(payloads):
        data = encode(p) if serialise else p
        futs.append(await js.publish_async(subj, data, headers={"Nats-Msg-Id": f"raw-{i}"}))
        if len(futs) >= 256:
            await asyncio.gather(*futs)
            futs = []
    await asyncio.gather(*futs)
    t_pub = time.perf_counter() - t0
    await js.add_consumer(stream, ConsumerConfig(durable_name="raw", ack_policy=AckPolicy.EXPLICIT))
    psub = await js.pull_subscribe_bind("raw", stream)
    t0 = time.perf_counter()
    n = 0
    decode = msgspec.msgpack.Decoder(TraceCompleted).decode
    while n < len(payloads):
        for m in await psub.fetch(64, timeout=5):
            if serialise:
                decode(m.data)
            await m.ack()
            n += 1
    t_con = time.perf_counter() - t0
    await js.delete_stream(stream)
    await nc.close()
    return {
        "publish_msgs_per_s": len(payloads) / t_pub,
        "consume_msgs_per_s": len(payloads) / t_con,
    }


async def bench_rlbus(
    url: str, run: str, events: list[TraceCompleted], replicas: int = 1
) -> dict[str, float]:
    settings = BusSettings(replicas=replicas)
    bus = await Bus.connect(url, run=run, producer="bench", settings=settings)
    await bus.ensure_stream()
    t0 = time.perf_counter()
    await bus.publish_many(events)
    t_pub = time.perf_counter() - t0
    got = 0
    done = asyncio.Event()

    async def handle(ev: TraceCompleted, d: Delivery) -> list[TraceCompleted]:
        nonlocal got
        got += 1
        if got == len(events):
            done.set()
        return []

    stop = asyncio.Event()
    consumer = Consumer(
        bus, Subscription("bench", [(Topic.TRACE_COMPLETED, None)], handle, batch=64), role="bench"
    )
    t0 = time.perf_counter()
    task = asyncio.create_task(consumer.run(stop))
    await done.wait()
    t_con = time.perf_counter() - t0
    stop.set()
    await task
    await bus.js.delete_stream(bus.stream)
    await bus.close()
    return {"publish_msgs_per_s": len(events) / t_pub, "consume_msgs_per_s": len(events) / t_con}


async def main(n: int, rounds: int) -> dict[str, object]:
    with (
        tempfile.TemporaryDirectory() as d,
        EmbeddedServer(f"{d}/single") as server,
        EmbeddedCluster(f"{d}/cluster", 3) as cluster,
    ):
        events = [trace_event("bench", i) for i in range(n)]
        payloads = [msgspec.msgpack.encode(e) for e in events]
        size = sum(map(len, payloads)) / n
        raw_runs, ser_runs, bus_runs, r3_runs = [], [], [], []
        for r in range(rounds):  # alternate to spread machine noise over all four
            raw_runs.append(await bench_raw(server.url, f"raw{r}", payloads))
            ser_runs.append(await bench_raw(server.url, f"ser{r}", events, serialise=True))
            evs = [msgspec.structs.replace(e, run=f"bus{r}") for e in events]
            bus_runs.append(await bench_rlbus(server.url, f"bus{r}", evs))
            evs = [msgspec.structs.replace(e, run=f"r3{r}") for e in events]
            r3_runs.append(await bench_rlbus(cluster.url, f"r3{r}", evs, replicas=3))
        assert subject("bus0", Topic.TRACE_COMPLETED, "reverse-text")
    best = lambda runs, k: max(x[k] for x in runs)  # noqa: E731 - best of rounds
    out: dict[str, object] = {"messages": n, "rounds": rounds, "payload_bytes": round(size)}
    for k in ("publish_msgs_per_s", "consume_msgs_per_s"):
        out[f"raw_{k}"] = round(best(raw_runs, k))
        out[f"raw_msgspec_{k}"] = round(best(ser_runs, k))
        out[f"rlbus_{k}"] = round(best(bus_runs, k))
        out[f"ratio_vs_raw_msgspec_{k}"] = round(best(bus_runs, k) / best(ser_runs, k), 3)
        out[f"ratio_vs_raw_bytes_{k}"] = round(best(bus_runs, k) / best(raw_runs, k), 3)
        out[f"cluster_r3_rlbus_{k}"] = round(best(r3_runs, k))
        out[f"ratio_cluster_r3_vs_single_{k}"] = round(best(r3_runs, k) / best(bus_runs, k), 3)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    results = asyncio.run(main(a.n, a.rounds))
    for k, v in results.items():
        print(f"{k:>32}: {v}")
    print("saved", save("bus", results))
