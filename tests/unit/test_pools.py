"""Env and inference pools of ``rlbus up``: when a pool grows or shrinks (pure), what it
is named and shown as, and that the launcher's keeper acts on a real consumer's backlog
and treats a retired replica's exit as no crash."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest

from bus.consumer import Consumer, Subscription
from bus.runtime import Bus
from bus.subjects import Topic
from configs import load_config
from configs.paths import RunPaths
from roles.up.launcher import role_specs
from roles.up.pools import (
    Load,
    Pool,
    PoolKeeper,
    PoolRule,
    PoolState,
    env_load,
    inference_load,
    pool_rows,
    run_pools,
)
from roles.up.processes import RoleProcess
from roles.up.supervisor import RoleKeeper
from schemas import RoleHeartbeat, TaskRef, TaskRequested

RULE = PoolRule(low=1, high=3, up_after_s=5.0, down_after_s=10.0)
HOT = Load(hot=True, idle=False, text="backlog 9 (1 in flight)")
IDLE = Load(hot=False, idle=True, text="backlog 0 (0 in flight)")
BUSY = Load(hot=False, idle=False, text="backlog 1 (1 in flight)")


# -- the decision -------------------------------------------------------------------------


def test_a_pool_grows_only_after_its_backlog_stayed_high_for_a_while() -> None:
    state = PoolState(1)
    assert state.step(RULE, HOT, now=0.0) is None
    assert state.step(RULE, HOT, now=4.9) is None
    scale = state.step(RULE, HOT, now=5.0)
    assert scale is not None and (scale.before, scale.after) == (1, 2)
    assert scale.why == HOT.text and state.replicas == 2
    # the next replica needs its own 5 s of evidence, gathered with two replicas
    assert state.step(RULE, HOT, now=6.0) is None


def test_a_dip_in_the_backlog_restarts_the_wait() -> None:
    state = PoolState(1)
    state.step(RULE, HOT, now=0.0)
    state.step(RULE, BUSY, now=3.0)
    assert state.step(RULE, HOT, now=6.0) is None
    assert state.step(RULE, HOT, now=11.0) is not None


def test_no_resize_while_a_replica_is_still_starting() -> None:
    """The backlog a replica was added for is judged with it serving: otherwise a slow
    start (seconds for an env server) would add every replica up to max at once, or
    retire one that never served."""
    state = PoolState(2)
    assert state.step(RULE, HOT, now=0.0, starting=1) is None
    assert state.step(RULE, HOT, now=20.0, starting=1) is None
    assert state.step(RULE, HOT, now=21.0) is None  # the hot time counts from here
    assert state.step(RULE, HOT, now=26.0) is not None
    assert state.step(RULE, IDLE, now=30.0, starting=1) is None
    assert state.step(RULE, IDLE, now=99.0, starting=1) is None
    assert state.step(RULE, IDLE, now=100.0) is None
    assert state.step(RULE, IDLE, now=110.0) is not None


def test_a_pool_stays_within_its_bounds() -> None:
    full = PoolState(3)
    assert full.step(RULE, HOT, now=0.0) is None and full.step(RULE, HOT, now=99.0) is None
    least = PoolState(1)
    assert least.step(RULE, IDLE, now=0.0) is None and least.step(RULE, IDLE, now=99.0) is None


def test_an_idle_pool_shrinks_one_replica_per_idle_period() -> None:
    state = PoolState(3)
    assert state.step(RULE, IDLE, now=0.0) is None
    scale = state.step(RULE, IDLE, now=10.0)
    assert scale is not None and (scale.before, scale.after, scale.why) == (3, 2, "idle 10s")
    assert state.step(RULE, IDLE, now=15.0) is None
    assert state.step(RULE, IDLE, now=24.9) is None  # counted from the first reading after
    assert state.step(RULE, IDLE, now=25.0) is not None and state.replicas == 1


def test_the_env_load_counts_groups_waiting_per_replica_and_idles_on_nothing_at_all() -> None:
    """Hot: groups no replica took yet, at least ``scale_up_backlog`` per replica (groups
    in flight are work being done, not waiting). Idle: nothing waiting nor in flight."""
    assert env_load(waiting=4, in_flight=8, replicas=2, up_backlog=2).hot
    assert not env_load(waiting=3, in_flight=8, replicas=2, up_backlog=2).hot
    assert not env_load(waiting=0, in_flight=50, replicas=1, up_backlog=1).hot
    assert env_load(0, 0, 2, 2).idle and not env_load(0, 1, 2, 2).idle
    # One replica fewer would hold what runs at half its capacity: idle, in a busy run too.
    assert env_load(0, 4, 3, 2, concurrency=8).idle and not env_load(0, 9, 3, 2, 8).idle
    assert not env_load(1, 0, 3, 2, concurrency=8).idle  # something waits
    assert env_load(3, 2, 1, 1).text == "backlog 5 (2 in flight)"


def test_the_inference_load_is_the_replicas_busy_share() -> None:
    """Hot: the mean share at or above the threshold. Idle: one replica fewer would carry
    the summed share at half the threshold (0.9 -> 0.45 each)."""
    assert inference_load([0.95, 0.9], up_busy=0.9).hot
    assert not inference_load([0.95, 0.5], up_busy=0.9).hot
    assert inference_load([0.2, 0.2], up_busy=0.9).idle
    assert not inference_load([0.3, 0.2], up_busy=0.9).idle
    assert inference_load([0.0], 0.9).idle and not inference_load([0.1], 0.9).idle
    assert inference_load([0.5, 1.0], 0.9).text == "busy 75%"
    # A replica with no report lately (no traffic, or the vLLM backend) is idle for the
    # decisions but not shown as "busy 0%".
    assert inference_load([None], 0.9).idle
    assert inference_load([None], 0.9).text == "busy ? (no report lately)"
    assert inference_load([0.8, None], 0.9).text == "busy 80% (1 of 2 reporting)"
    assert not inference_load([0.8, None], 0.9).hot


# -- names, pools, the status table --------------------------------------------------------


def test_pools_start_at_replicas_with_unique_names_and_replica_0_keeps_its_name(
    tmp_path: Path,
) -> None:
    cfg = load_config(
        "smoke",
        [
            f"bus.data_dir={tmp_path}", "inference.replicas=2", "inference.max_replicas=3",
            'orchestrator.train.env=[{id="reverse-text",replicas=2,max_replicas=3},{id="alphabet-sort"}]',
        ],
    )  # fmt: skip
    cfg.run = "p"
    paths = RunPaths.of(cfg)
    roles = role_specs(cfg, paths, "nats://x")
    names = [r.name for r in roles]
    assert len(names) == len(set(names))
    assert {"env-reverse-text", "env-reverse-text-1", "env-alphabet-sort"} <= set(names)
    assert {"inference-policy-0", "inference-policy-1"} <= set(names)
    made: list[str] = []

    def make(name: str, args: list[str]) -> RoleProcess:
        made.append(name)
        return RoleProcess(name, args, paths.log(name))

    pools = {p.name: p for p in run_pools(cfg, roles, make)}
    assert set(pools) == {"env-reverse-text", "env-alphabet-sort", "inference-policy"}
    rt = pools["env-reverse-text"]
    assert (rt.rule.low, rt.rule.high, rt.consumer) == (2, 3, "env-reverse-text")
    assert [r.name for r in rt.members.values()] == ["env-reverse-text", "env-reverse-text-1"]
    assert not pools["env-alphabet-sort"].rule.elastic
    assert rt.make(rt.free_index()).argv == ["env", "--env", "reverse-text"]
    assert pools["inference-policy"].make(2).name == "inference-policy-2"
    assert made == ["env-reverse-text-2", "inference-policy-2"]
    assert rt.row() == ("env-reverse-text", "2 (2..3)", "-")


def test_status_counts_live_replicas_per_pool_with_each_envs_backlog() -> None:
    cfg = load_config(
        "smoke", ['orchestrator.train.env=[{id="reverse-text",min_replicas=1,max_replicas=3}]']
    )
    now = 10**18

    def beat(role: str, pid: int, **kw: Any) -> RoleHeartbeat:
        return RoleHeartbeat(
            run="r", role=role, instance=f"{role}-h-{pid}", host="h", pid=pid, started_ns=0,
            last_seen_ns=now, **kw,
        )  # fmt: skip

    beats = [
        beat("env", 1, consumer="env-reverse-text"),
        beat("env", 2, consumer="env-reverse-text"),
        beat("env", 3, consumer="env-reverse-text", status="stopped"),
        beat("inference", 4, info={"model": "policy"}),
        beat("inference", 5, info={"model": "ref"}),
    ]
    rows = pool_rows(cfg, beats, {"env-reverse-text": (5, 2)}, interval_s=2.0, now_ns=now)
    assert rows == [
        ("env-reverse-text", "2", "1..3", "7 (2 in flight)"),
        ("inference-policy", "1", "1", "-"),
        ("inference-ref", "1", "1", "-"),
    ]


# -- the keeper: a real consumer's backlog, real processes ----------------------------------


def sleeper(name: str, tmp_path: Path) -> RoleProcess:
    """A role process that exits 0 on SIGTERM, like a drained role."""
    ready = tmp_path / f"{name}.ready"
    code = (
        "import pathlib,signal,sys,time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
        f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    )
    return RoleProcess(name, [sys.executable, "-c", code], tmp_path / f"{name}.log")


async def until_ready(name: str, tmp_path: Path) -> None:
    """Until the sleeper ``name`` has its SIGTERM handler (a drained exit is exit 0)."""
    for _ in range(200):
        if (tmp_path / f"{name}.ready").exists():
            return
        await asyncio.sleep(0.05)
    raise TimeoutError(name)


class Notes:
    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


@pytest.mark.nats
async def test_the_keeper_grows_on_a_real_backlog_then_retires_without_a_restart(
    bus: Bus, tmp_path: Path
) -> None:
    """Three groups wait on the env's durable consumer: the pool (1..2, no wait) adds
    ``env-x-1``; once the backlog is gone it retires it with SIGTERM, the role keeper does
    not restart it, and it leaves the launcher's roles when it exited."""
    consumer = Consumer(bus, Subscription("env-x", [(Topic.TASK_REQUESTED, "x")], handler=None), "env")  # type: ignore[arg-type]  # fmt: skip
    await consumer.ensure()
    for i in range(3):
        await bus.publish(
            TaskRequested(run=bus.run, env="x", task=TaskRef(index=i), group_id=f"g{i}", group_size=1)
        )  # fmt: skip
    first = sleeper("env-x", tmp_path)
    roles = [first]
    notes = Notes()
    log = bus.log
    keeper = RoleKeeper(roles, notes, log)  # type: ignore[arg-type]
    keeper.start(first)
    pool = Pool(
        "env-x", PoolRule(1, 2, 0.0, 0.0), members={0: first},
        make=lambda i: sleeper(f"env-x-{i}", tmp_path), consumer="env-x",
    )  # fmt: skip
    pools = PoolKeeper([pool], roles, keeper.start, bus, notes, log, 0.1, 1.0, 0.9)
    try:
        await pools.check()  # env-x has not beaten yet: starting, so no growth
        assert len(pool.members) == 1 and pool.load is not None and pool.load.hot
        await _beat_as(bus, first)  # now it serves
        await pools.check()
        assert [r.name for r in roles] == ["env-x", "env-x-1"] and roles[1].alive
        assert notes.notes[-1] == "env-x: 1 -> 2 replicas (backlog 3 (0 in flight))"
        await bus.js.purge_stream(bus.stream)  # the backlog is gone
        await until_ready("env-x-1", tmp_path)
        await pools.check()  # env-x-1 is starting: not retired before it served
        assert not pool.retiring
        await _beat_as(bus, roles[1])
        await pools.check()
        assert [e["replica"] for e in pool.serving] == ["env-x-1"]  # its start time is told
        assert list(pool.retiring) == [1] and roles[1].retiring_since is not None
        assert notes.notes[-1] == "env-x: 2 -> 1 replicas (idle 0s)"
        roles[1].proc.wait(10)  # type: ignore[union-attr]
        assert keeper.check() is None and roles[1].restarts == 0  # no crash, no restart
        await pools.check()
        assert [r.name for r in roles] == ["env-x"] and not pool.retiring
        assert notes.notes[-1].startswith("env-x-1 retired (exit 0, drained in")
        assert pool.summary()["peak"] == 2 and [e["to"] for e in pool.scaled] == [2, 1]
    finally:
        for r in roles + list(pool.retiring.values()):
            r.terminate()
            r.wait(5)


async def _beat_as(bus: Bus, r: RoleProcess) -> None:
    """A heartbeat in the registry under ``r``'s pid: ``r`` started and serves."""
    import msgspec

    from bus.registry import roles_bucket
    from bus.subjects import role_key

    assert r.proc is not None
    hb = RoleHeartbeat(
        run=bus.run, role="env", instance=f"env-x-h-{r.proc.pid}", host="h", pid=r.proc.pid,
        started_ns=0, last_seen_ns=0, consumer="env-x",
    )  # fmt: skip
    kv = await roles_bucket(bus.js, bus.run)
    await kv.put(role_key(bus.run, "env", hb.instance), msgspec.msgpack.encode(hb))


@pytest.mark.nats
async def test_the_inference_pool_grows_on_its_replicas_reported_busy_share(
    bus: Bus, tmp_path: Path
) -> None:
    """The busy share is the replica's own report (matched to it by pid); a report older
    than ``BUSY_STALE_S`` means no traffic since, i.e. 0."""
    import time

    from roles.up.pools import BUSY_STALE_S

    first = sleeper("inference-policy-0", tmp_path)
    roles = [first]
    notes = Notes()
    first.start()
    pool = Pool(
        "inference-policy", PoolRule(1, 2, 0.0, 0.0), members={0: first},
        make=lambda i: sleeper(f"inference-policy-{i}", tmp_path),
    )  # fmt: skip
    assert first.proc is not None
    busy = {f"inference-policy-h-{first.proc.pid}": (time.time_ns(), 0.95)}
    started: list[str] = []
    keeper = PoolKeeper(
        [pool], roles, lambda r: started.append(r.name), bus, notes, bus.log, 0.1, 1.0, 0.9,
        busy=busy,
    )  # fmt: skip
    try:
        await _beat_as(bus, first)
        await keeper.check()
        assert started == ["inference-policy-1"]
        assert notes.notes[-1] == "inference-policy: 1 -> 2 replicas (busy 95%)"
        stale = time.time_ns() - int((BUSY_STALE_S + 1) * 1e9)
        busy[next(iter(busy))] = (stale, 0.95)
        pool.members.pop(1)  # never started here; the pool of one reads its stale report
        pool.state.replicas = 1
        await keeper.check()
        assert pool.load is not None and pool.load.text == "busy ? (no report lately)"
        assert pool.load.idle
    finally:
        first.terminate()
        first.wait(5)
