"""Role pools of ``rlbus up``: each train env's env servers (and each eval-only env's,
static) and the policy's inference replicas, static or elastic.

A pool is ``min..max`` replicas of one role (``EnvConfig.pool``, ``InferenceConfig.pool``);
equal bounds make it static. The launcher reads every pool's load each
``env_server.scale_check_s`` (shown in the live view) and resizes an elastic one:

- env pool ``env-<id>`` (replicas ``env-<id>``, ``env-<id>-1``, ...): its durable
  consumer ``env-<key>``, the work queue its replicas share. ``num_pending`` groups wait
  (no replica took them yet), ``num_ack_pending`` are in flight. Hot: at least
  ``env_server.scale_up_backlog`` groups waiting per replica. Idle: nothing waiting,
  and one replica fewer would hold the groups in flight at half its capacity.
- inference pool ``inference-policy`` (replicas ``inference-policy-<i>``): each replica's
  ``busy_frac``, the share of its last metrics interval spent running batches
  (``metrics.reported.inference``, every 10 s while it has traffic, none without). Hot:
  the mean share is at least ``inference.scale_up_busy``. Idle: one replica fewer would
  carry the summed share at half that. Inference is request/reply, so there is no queue
  on the server to read; a saturated replica is the honest signal it has.

A pool adds a replica once its load has been hot for ``scale_up_after_s`` and retires its
newest replica once idle for ``scale_down_idle_s``, within its bounds, and neither while
one of its replicas is starting (not yet beating in the registry): the load a replica
was added for is judged with it serving. A retired replica gets SIGTERM: the
role runtime stops fetching, hands back what it fetched and had not started, finishes
and acks its in-flight groups, then exits (``roles.runtime.role.serve_role``,
``bus.consumer.Consumer``). The role keeper does not restart it; one still running after
``RETIRE_TIMEOUT_S`` is killed (what it held comes back to the pool after
``bus.ack_wait_s``).

The decisions (``PoolState.step``, ``env_load``, ``inference_load``) are pure and
unit-tested; ``PoolKeeper`` reads the loads and starts and retires the processes;
``pool_rows`` is the table ``rlbus status`` prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from bus.registry import is_alive
from bus.subjects import durable_name
from configs import POLICY, EnvConfig, EvalEnvConfig, RunConfig
from roles.up.processes import RoleProcess
from roles.up.role_errors import exit_text

if TYPE_CHECKING:
    from bus.runtime import Bus
    from schemas import RoleHeartbeat

# A retired replica drains its in-flight groups (the consumer waits up to 30 s for them).
RETIRE_TIMEOUT_S = 60.0
# Inference replicas report their busy share every 10 s while they have traffic: a
# replica with no report this recent had none.
BUSY_STALE_S = 25.0


# -- the decision (pure) ----------------------------------------------------------------


@dataclass(frozen=True)
class PoolRule:
    """A pool's bounds and how long its load must last before it is resized."""

    low: int
    high: int
    up_after_s: float
    down_after_s: float

    @property
    def elastic(self) -> bool:
        return self.high > self.low


@dataclass(frozen=True)
class Load:
    """One reading of a pool's load: more replicas would help (``hot``), one fewer
    would do (``idle``), and the reading in words for the view (``backlog 37 ...``)."""

    hot: bool
    idle: bool
    text: str


@dataclass(frozen=True)
class Scale:
    """A resize: ``before`` -> ``after`` replicas, and why (the load, in words)."""

    before: int
    after: int
    why: str


@dataclass
class PoolState:
    """How many replicas a pool has, and since when its load has been hot or idle."""

    replicas: int
    hot_since: float | None = None
    idle_since: float | None = None

    def step(self, rule: PoolRule, load: Load, now: float, starting: int = 0) -> Scale | None:
        """Fold one reading taken at ``now`` (seconds, any monotonic clock); the resize
        it calls for, if any. ``starting``: replicas not serving yet, while which the pool
        is not resized (its load is judged from when they serve: a replica starts in
        seconds, and retiring one before it ever served is churn)."""
        settled = starting == 0
        hot, idle = load.hot and settled, load.idle and settled
        self.hot_since = (now if self.hot_since is None else self.hot_since) if hot else None
        self.idle_since = (now if self.idle_since is None else self.idle_since) if idle else None
        if (
            self.hot_since is not None
            and now - self.hot_since >= rule.up_after_s
            and self.replicas < rule.high
        ):
            return self._resize(self.replicas + 1, load.text)
        if (
            self.idle_since is not None
            and now - self.idle_since >= rule.down_after_s
            and self.replicas > rule.low
        ):
            return self._resize(self.replicas - 1, f"idle {now - self.idle_since:.0f}s")
        return None

    def _resize(self, replicas: int, why: str) -> Scale:
        scale = Scale(self.replicas, replicas, why)
        # The next resize needs its own evidence, gathered with the new pool.
        self.replicas, self.hot_since, self.idle_since = replicas, None, None
        return scale


def env_load(
    waiting: int, in_flight: int, replicas: int, up_backlog: float, concurrency: int = 1
) -> Load:
    """An env pool's load from its consumer: ``waiting`` groups no replica took yet,
    ``in_flight`` groups being rolled out, across ``replicas`` replicas of ``concurrency``
    groups each. Idle: nothing waits, and one replica fewer would hold what is in flight
    at half its capacity (a busy run's pool also shrinks back after a burst, e.g. an
    eval round, and not only when nothing at all runs)."""
    spare = (max(1, replicas) - 1) * concurrency / 2
    return Load(
        hot=waiting >= up_backlog * max(1, replicas),
        idle=waiting == 0 and in_flight <= spare,
        text=f"backlog {waiting + in_flight} ({in_flight} in flight)",
    )


def inference_load(busy: Sequence[float | None], up_busy: float) -> Load:
    """An inference pool's load from each replica's busy share (0..1; None: no report
    lately). A replica reports only while it has traffic (and the vLLM backend never
    does), so for the decisions a silent one counts as idle, while the text says how
    many reported rather than show "busy 0%" for a pool nobody measured."""
    n = max(1, len(busy))
    reported = [b for b in busy if b is not None]
    total = sum(reported)
    if not reported:
        text = "busy ? (no report lately)"
    elif len(reported) < len(busy):
        text = f"busy {total / len(reported):.0%} ({len(reported)} of {len(busy)} reporting)"
    else:
        text = f"busy {total / n:.0%}"
    return Load(hot=total / n >= up_busy, idle=total <= (n - 1) * up_busy / 2, text=text)


# -- names and bounds --------------------------------------------------------------------


def env_replica(env_id: str, i: int) -> str:
    """Replica ``i`` of an env's pool: ``env-<id>`` first (the name the single env server
    always had), then ``env-<id>-1``, ``env-<id>-2``, ..."""
    return f"env-{env_id}" if i == 0 else f"env-{env_id}-{i}"


def inference_replica(i: int) -> str:
    return f"inference-{POLICY}-{i}"


# -- the processes ----------------------------------------------------------------------


@dataclass
class Pool:
    """The replicas of one role: ``members`` by replica index (serving), ``retiring`` (told
    to drain, not exited yet), ``make(i)`` builds replica ``i``'s process."""

    name: str
    rule: PoolRule
    members: dict[int, RoleProcess]
    make: Callable[[int], RoleProcess]
    consumer: str | None = None  # an env pool's durable; None: an inference pool
    concurrency: int = 1  # an env pool: groups in flight per replica
    retiring: dict[int, RoleProcess] = field(default_factory=dict)
    load: Load | None = None  # the last reading
    scaled: list[dict[str, Any]] = field(default_factory=list)  # every resize
    serving: list[dict[str, Any]] = field(default_factory=list)  # when added replicas served
    added: dict[str, float] = field(default_factory=dict)  # replica -> added at, till it serves
    state: PoolState = field(init=False)
    peak: int = field(init=False)

    def __post_init__(self) -> None:
        self.state = PoolState(len(self.members))
        self.peak = len(self.members)

    def free_index(self) -> int:
        used = set(self.members) | set(self.retiring)
        return next(i for i in range(len(used) + 1) if i not in used)

    def row(self) -> tuple[str, str, str]:
        """(pool, replicas, load) for the live view."""
        n = len(self.members)
        bounds = f" ({self.rule.low}..{self.rule.high})" if self.rule.elastic else ""
        draining = f", {len(self.retiring)} draining" if self.retiring else ""
        return self.name, f"{n}{bounds}{draining}", self.load.text if self.load else "-"

    def summary(self) -> dict[str, Any]:
        return {
            "min": self.rule.low, "max": self.rule.high, "replicas": len(self.members),
            "peak": self.peak, "scaled": self.scaled, "serving": self.serving,
        }  # fmt: skip


def run_pools(
    cfg: RunConfig, roles: Sequence[RoleProcess], make: Callable[[str, list[str]], RoleProcess]
) -> list[Pool]:
    """The pools of a run, over the replicas ``roles`` already holds (``env_replica``,
    ``inference_replica`` names); ``make(name, args)`` builds a role process."""
    by_name = {r.name: r for r in roles}
    s = cfg.env_server
    pools = []
    for env in served_envs(cfg):
        low, high = env.pool
        pools.append(
            Pool(
                env_replica(env.id, 0),
                PoolRule(low, high, s.scale_up_after_s, s.scale_down_idle_s),
                members={i: by_name[env_replica(env.id, i)] for i in range(env.servers)},
                make=_env_maker(make, env.id),
                consumer=durable_name("env", env.key),
                concurrency=env.max_concurrent or s.groups_in_flight,
            )
        )
    inf = cfg.inference
    low, high = inf.pool
    pools.append(
        Pool(
            f"inference-{POLICY}",
            PoolRule(low, high, inf.scale_up_after_s, inf.scale_down_idle_s),
            members={i: by_name[inference_replica(i)] for i in range(inf.replicas)},
            make=lambda i: make(inference_replica(i), ["inference", "--model", POLICY]),
        )
    )
    return pools


def served_envs(cfg: RunConfig) -> list[EnvConfig | EvalEnvConfig]:
    """The envs ``rlbus up`` starts servers for: each train env, then each eval-only env
    (a static pool of its ``replicas``; none when the run does not evaluate)."""
    o = cfg.orchestrator
    return [*o.train.env, *o.eval_only_envs()]


def _env_maker(
    make: Callable[[str, list[str]], RoleProcess], env_id: str
) -> Callable[[int], RoleProcess]:
    return lambda i: make(env_replica(env_id, i), ["env", "--env", env_id])


class Notes(Protocol):
    def note(self, text: str) -> None: ...


@dataclass
class PoolKeeper:
    """Reads each pool's load every ``check_s`` and resizes the elastic ones: a new
    replica joins ``roles`` (the launcher's processes: restarted if it dies, shown,
    stopped in order at the end) and is started with ``start``; a retired one drains and
    leaves ``roles`` once it exited. Every resize is a ``pool.scaled`` log line and a note."""

    pools: list[Pool]
    roles: list[RoleProcess]
    start: Callable[[RoleProcess], None]
    bus: Bus
    view: Notes
    log: Any
    check_s: float
    up_backlog: float
    up_busy: float
    # producer instance -> (ts_ns, busy share) of its last inference report (RunMonitor.busy)
    busy: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    started_at: float = field(default_factory=time.monotonic)
    # Stopped by this event, not by cancelling (nats-py can swallow a cancellation).
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        while not self.stop.is_set():
            try:
                await self.check()
            except Exception as e:  # noqa: BLE001 - the server may be away; the next check sees
                self.log.warning("pool.check_failed", error=repr(e))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.check_s)

    async def check(self) -> None:
        """One round: reap retired replicas, read every pool's load, resize."""
        self.reap(time.monotonic())
        elastic = [p for p in self.pools if p.rule.elastic]
        serving = await self._serving_pids() if elastic else set()
        for pool in self.pools:
            self._note_serving(pool, serving)
            pool.load = await self._load(pool)
            if pool.load is None or not pool.rule.elastic or self.stop.is_set():
                continue
            starting = sum(1 for r in pool.members.values() if _pid(r) not in serving)
            scale = pool.state.step(pool.rule, pool.load, time.monotonic(), starting)
            if scale is not None:
                self._resize(pool, scale)

    def _note_serving(self, pool: Pool, serving: set[int]) -> None:
        """Replicas added that now beat in the registry: how long they took to serve."""
        now = time.monotonic()
        for r in pool.members.values():
            if r.name in pool.added and _pid(r) in serving:
                after_s = round(now - pool.added.pop(r.name), 1)
                at_s = round(now - self.started_at, 1)
                pool.serving.append({"replica": r.name, "at_s": at_s, "after_s": after_s})
                self.log.info("pool.replica_serving", pool=pool.name, replica=r.name, after_s=after_s)  # fmt: skip

    def _resize(self, pool: Pool, scale: Scale) -> None:
        if scale.after > scale.before:
            i = pool.free_index()
            r = pool.make(i)
            self.roles.append(r)
            self.start(r)
            pool.members[i] = r
            pool.added[r.name] = time.monotonic()
            pool.peak = max(pool.peak, len(pool.members))
        else:
            i = max(pool.members)
            r = pool.members.pop(i)
            pool.added.pop(r.name, None)
            pool.retiring[i] = r
            r.retire()
        at_s = round(time.monotonic() - self.started_at, 1)
        pool.scaled.append(
            {"at_s": at_s, "from": scale.before, "to": scale.after, "why": scale.why}
        )
        self.log.info(
            "pool.scaled", pool=pool.name, before=scale.before, after=scale.after,
            why=scale.why, replica=r.name, pid=_pid(r),
        )  # fmt: skip
        self.view.note(f"{pool.name}: {scale.before} -> {scale.after} replicas ({scale.why})")

    def reap(self, now: float) -> None:
        """Retired replicas that exited leave the launcher's roles; one that did not drain
        in ``RETIRE_TIMEOUT_S`` is killed."""
        for pool in self.pools:
            for i, r in list(pool.retiring.items()):
                since = r.retiring_since or now
                if r.alive and now - since > RETIRE_TIMEOUT_S and r.proc is not None:
                    self.log.warning("pool.retire_killed", replica=r.name, after_s=RETIRE_TIMEOUT_S)
                    r.proc.kill()
                if r.alive:
                    continue
                r.wait(0.1)  # closes its log
                del pool.retiring[i]
                self.roles.remove(r)
                code = r.proc.returncode if r.proc else None
                self.log.info(
                    "pool.retired", pool=pool.name, replica=r.name, exit_code=code,
                    drained_s=round(now - since, 2),
                )  # fmt: skip
                self.view.note(
                    f"{r.name} retired ({exit_text(code)}, drained in {now - since:.1f}s)"
                )

    async def _serving_pids(self) -> set[int]:
        """Pids of role processes beating in the registry: started and serving."""
        beats = await self.bus.live_roles()
        return {hb.pid for hb in beats if hb.status == "running"}

    async def _load(self, pool: Pool) -> Load | None:
        if pool.consumer is None:
            now_ns = time.time_ns()
            shares = [self._busy(_pid(r), now_ns) for r in pool.members.values()]
            return inference_load(shares, self.up_busy)
        backlog = await consumer_backlog(self.bus, pool.consumer)
        if backlog is None:
            return None
        return env_load(*backlog, len(pool.members), self.up_backlog, pool.concurrency)

    def _busy(self, pid: int | None, now_ns: int) -> float | None:
        """The busy share the replica with ``pid`` last reported (None: none lately)."""
        suffix = f"-{pid}"
        for producer, (ts_ns, share) in self.busy.items():
            if producer.endswith(suffix) and (now_ns - ts_ns) / 1e9 <= BUSY_STALE_S:
                return share
        return None

    def rows(self) -> list[tuple[str, str, str]]:
        return [p.row() for p in self.pools]

    def summary(self) -> dict[str, Any]:
        return {p.name: p.summary() for p in self.pools}


def _pid(r: RoleProcess) -> int | None:
    return r.proc.pid if r.proc is not None else None


async def consumer_backlog(bus: Bus, durable: str) -> tuple[int, int] | None:
    """(waiting, in flight) on the run's durable consumer ``durable``: its
    ``num_pending`` and ``num_ack_pending``; None when it does not exist (yet) or the
    server does not answer."""
    try:
        return await bus.consumer_backlog(durable)
    except Exception:  # noqa: BLE001 - no server answering: unknown, as a missing one
        return None


async def env_backlogs(bus: Bus, cfg: RunConfig) -> dict[str, tuple[int, int]]:
    """Each served env's consumer -> (waiting, in flight), for those that exist."""
    out = {}
    for env in served_envs(cfg):
        consumer = durable_name("env", env.key)
        if (backlog := await consumer_backlog(bus, consumer)) is not None:
            out[consumer] = backlog
    return out


# -- `rlbus status` ----------------------------------------------------------------------


def pool_rows(
    cfg: RunConfig,
    beats: Iterable[RoleHeartbeat],
    backlogs: Mapping[str, tuple[int, int]],
    interval_s: float,
    now_ns: int | None = None,
) -> list[tuple[str, str, str, str]]:
    """(pool, replicas alive, bounds, backlog) of a run, from its registry ``beats`` and
    its env consumers' ``backlogs`` (durable -> (waiting, in flight)): each train env's
    env servers, each eval-only env's, and each model's inference replicas."""
    alive = [hb for hb in beats if is_alive(hb, interval_s, now_ns)]
    rows = []
    for env in served_envs(cfg):
        consumer = durable_name("env", env.key)
        n = sum(1 for hb in alive if hb.role == "env" and hb.consumer == consumer)
        low, high = env.pool
        backlog = "-"
        if consumer in backlogs:
            waiting, in_flight = backlogs[consumer]
            backlog = f"{waiting + in_flight} ({in_flight} in flight)"
        rows.append((env_replica(env.id, 0), str(n), _bounds(low, high), backlog))
    models = [hb.info.get("model", POLICY) for hb in alive if hb.role == "inference"]
    for model in dict.fromkeys([POLICY, *sorted(models)]):
        n = models.count(model)
        bounds = _bounds(*cfg.inference.pool) if model == POLICY else "1"
        rows.append((f"inference-{model}", str(n), bounds, "-"))
    return rows


def _bounds(low: int, high: int) -> str:
    return str(low) if low == high else f"{low}..{high}"
