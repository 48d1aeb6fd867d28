"""``rlbus replay <run> orchestrator`` without a broker: a whole run's log made by the
orchestrator's core (with scores and weights answered in between), then re-decided and
diffed; tampered, forged and truncated logs are told apart. The same diff over a real
run's log: tests/e2e/test_replay.py and test_faults.py."""

from __future__ import annotations

from collections import deque

import msgspec

from replay.orchestrator import OrchestratorLog, diff_decisions, key, redecide
from roles.orchestrator.core import OrchestratorCore
from schemas import (
    BatchAssembled,
    DeadLettered,
    Event,
    MetricsReported,
    RunStarted,
    RunStopped,
    TaskRequested,
    run_started_id,
)
from tests.unit.test_orchestrator import make, scored, weights


def recorded_run(steps: int = 4) -> tuple[OrchestratorLog, list[tuple[int, Event]]]:
    """The log of a run of ``steps`` steps, as its orchestrator's follower reads it (its own
    decisions come back right after they are made; scores and weights after those)."""
    cfg, _ = make(f"max_steps={steps}")
    core = OrchestratorCore(cfg)
    start = RunStarted(
        run="r", event_id=run_started_id("r"), config=cfg.model_dump(mode="json"),
        seed=cfg.seed, model_path="m",
    )  # fmt: skip
    log: list[tuple[int, Event]] = []
    todo: deque[Event] = deque([start])
    while todo:
        assert len(log) < 10_000, "the simulated run never stops"
        event = todo.popleft()
        log.append((len(log) + 1, event))
        for out in core.step(event).outputs:
            log.append((len(log) + 1, out))  # read back: already folded, a no-op
            if isinstance(out, TaskRequested):
                todo.append(scored(out, [0.0, 1.0, 0.0, 1.0], policy=out.policy_version))
            elif isinstance(out, BatchAssembled):
                todo.append(weights(out.step))
    return as_log(cfg, log), log


def as_log(cfg, log: list[tuple[int, Event]]) -> OrchestratorLog:  # noqa: ANN001
    inputs = [(s, e) for s, e in log if not (isinstance(e, MetricsReported) and e.role == "orchestrator")]  # fmt: skip
    recorded: dict = {}
    for _, e in log:
        recorded.setdefault(key(e), e)
    return OrchestratorLog(cfg, inputs, recorded=recorded)


def test_a_recorded_run_is_re_decided_exactly() -> None:
    log, events = recorded_run(steps=4)
    d = diff_decisions(log, redecide(log))
    assert d.ok and d.tail == 0, d
    assert d.compared["BatchAssembled"] == 4 and d.compared["RunStopped"] == 1
    made = sum(1 for _, e in events if isinstance(e, TaskRequested | BatchAssembled | RunStopped))
    per_batch_metrics = 4
    assert sum(d.compared.values()) == made + per_batch_metrics


def test_a_changed_decision_is_named_with_its_fields() -> None:
    log, _ = recorded_run()
    batch = next(e for e in log.recorded.values() if isinstance(e, BatchAssembled) and e.step == 2)
    log.recorded[key(batch)] = msgspec.structs.replace(
        batch, policy_version=9, samples=batch.samples[::-1], ts_ns=1, producer="someone"
    )
    d = diff_decisions(log, redecide(log))
    assert not d.ok
    assert d.changed == [f"BatchAssembled {batch.event_id}: policy_version, samples"]


def test_a_log_written_before_the_group_number_still_matches() -> None:
    """Task requests logged before ``TaskRequested.number`` existed carry none: replay
    does not count that as a difference (a recorded number that differs still is)."""
    log, _ = recorded_run()
    tasks = [k for k, e in log.recorded.items() if isinstance(e, TaskRequested) and e.number]
    old, bent = tasks[0], tasks[1]
    log.recorded[old] = msgspec.structs.replace(log.recorded[old], number=None)
    log.recorded[bent] = msgspec.structs.replace(log.recorded[bent], number=10**6)
    d = diff_decisions(log, redecide(log))
    assert d.changed == [f"TaskRequested {bent[1]}: number"]


def test_a_forged_decision_must_have_been_dead_lettered() -> None:
    """A batch on the log that the core never made is refused; only a dead letter of it
    in the run makes the replay match (the run refused it too)."""
    log, events = recorded_run()
    forged = BatchAssembled(run="r", event_id="forged", step=3, samples=[], policy_version=0)
    seq = events[len(events) // 2][0]
    log.inputs.insert(log.inputs.index(events[len(events) // 2]) + 1, (seq, forged))
    d = diff_decisions(log, redecide(log))
    assert [r.split(":")[0] for r in d.refusals] == [f"seq {seq}"]
    assert "never dead-lettered in the run" in d.refusals[0]

    reason = redecide(log).rejected[seq]
    log.dead_letters[seq] = DeadLettered(
        run="r", role="orchestrator", consumer="orchestrator", subject="s", stream_seq=seq,
        deliveries=1, error_type="Rejected", error=reason, payload=b"",
    )  # fmt: skip
    d = diff_decisions(log, redecide(log))
    assert d.ok and d.dead_letters == 1


def test_a_decision_missing_from_the_log_is_named_but_an_unpublished_tail_is_not() -> None:
    log, _ = recorded_run()
    first = next(e for e in log.recorded.values() if isinstance(e, TaskRequested))
    del log.recorded[key(first)]
    d = diff_decisions(log, redecide(log))
    assert d.unrecorded == [f"TaskRequested {first.event_id} (caused by seq 1): not on the log"]

    log, _ = recorded_run()
    stop = next(e for e in log.recorded.values() if isinstance(e, RunStopped))
    del log.recorded[key(stop)]  # the orchestrator died as it decided the stop
    log.inputs = [(s, e) for s, e in log.inputs if e is not stop]
    d = diff_decisions(log, redecide(log))
    assert d.ok and d.tail == 1
