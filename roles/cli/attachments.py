"""Which algorithm workers a run has: the config's, plus those attached at runtime.

    rows = await algorithm_table(bus, cfg)   # one AlgorithmRow per algorithm id

The attached set is a fold over ``algorithm.attached`` / ``algorithm.detached`` (the
same events the orchestrator folds into its routing), so the CLI and the orchestrator
can never disagree about who trains on what. A worker's lag is its durable consumer's
backlog: traces stored but not yet acknowledged by ``algorithm-<id>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from bus.reader import read_log
from bus.runtime import Bus
from bus.subjects import Topic, durable_name
from configs import RunConfig
from roles.orchestrator.policy import trains_on
from roles.orchestrator.state import OrchestratorState
from schemas import AlgorithmAttached, AlgorithmDetached


@dataclass
class AlgorithmRow:
    id: str
    name: str
    source: str  # "config" | "attached" | "detached"
    shadow: bool
    envs: list[str]  # env keys it trains on (shadow: every env it scores)
    lag: int | None = None  # traces its consumer has not acknowledged (None: no consumer)


async def attachment_events(bus: Bus) -> list[AlgorithmAttached | AlgorithmDetached]:
    """Every attach/detach event of the run, in log order."""
    topics = [(Topic.ALGORITHM_ATTACHED, None), (Topic.ALGORITHM_DETACHED, None)]
    return [e async for e in read_log(bus, topics, (AlgorithmAttached, AlgorithmDetached))]


def current(events: list[AlgorithmAttached | AlgorithmDetached]) -> dict[str, AlgorithmAttached]:
    """Attached workers not detached since, by id."""
    out: dict[str, AlgorithmAttached] = {}
    for e in events:
        if isinstance(e, AlgorithmAttached):
            out[e.algorithm] = e
        else:
            out.pop(e.algorithm, None)
    return out


def routing(
    cfg: RunConfig, events: list[AlgorithmAttached | AlgorithmDetached]
) -> dict[str, set[str]]:
    """Env key -> training algorithm ids now: the orchestrator's own fold of the events."""
    state = OrchestratorState(trains_on=trains_on(cfg))
    for e in events:
        state.apply(e)
    return state.trains_on["rl"]


async def consumer_lag(bus: Bus, algorithm_id: str) -> int | None:
    backlog = await bus.consumer_backlog(durable_name("algorithm", algorithm_id))
    return None if backlog is None else sum(backlog)


async def algorithm_table(bus: Bus, cfg: RunConfig) -> list[AlgorithmRow]:
    events = await attachment_events(bus)
    route = routing(cfg, events)
    attached = current(events)
    every_env = sorted(route)

    def envs_of(algorithm_id: str, shadow: bool) -> list[str]:
        return every_env if shadow else sorted(k for k, ids in route.items() if algorithm_id in ids)

    rows = [
        AlgorithmRow(a.id, a.name or a.id, "config", a.shadow, envs_of(a.id, a.shadow))
        for a in cfg.orchestrator.algorithms
    ]
    known = {r.id for r in rows}
    for e in events:
        if isinstance(e, AlgorithmAttached) and e.algorithm not in known:
            known.add(e.algorithm)
            source = "attached" if e.algorithm in attached else "detached"
            rows.append(
                AlgorithmRow(e.algorithm, e.name, source, e.shadow, envs_of(e.algorithm, e.shadow))
            )
    for row in rows:
        if row.source == "config" and row.id not in attached and not row.shadow and not row.envs:
            row.source = "detached"
        elif row.id in attached:
            row.source = "attached"
        row.lag = await consumer_lag(bus, row.id)
    return rows
