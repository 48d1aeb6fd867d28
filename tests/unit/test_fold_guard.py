"""The orchestrator's fold refuses impossible events and releases groups that cannot
finish; schemas refuse out-of-range values as they decode; an algorithm that cannot
score a group says so (no broker: the role's integration is tests/e2e/test_faults.py)."""

from __future__ import annotations

import msgspec
import pytest

from bus import codec
from bus.errors import DecodeError
from roles.algorithm.core import ScoringCore
from roles.orchestrator.policy import waits_for
from schemas import (
    BatchAssembled,
    MetricsReported,
    RunStopped,
    SamplesScored,
    TaskRequested,
    TraceCompleted,
)
from schemas.arrays import pack_f32
from schemas.run import ObjectRef
from tests.samples import sample, trace
from tests.unit.test_orchestrator import make, scored, started, step, weights


def running(*overrides: str):  # noqa: ANN202
    """A state with the run started and its first groups dispatched."""
    cfg, state = make(*overrides)
    out = step(state, cfg, started(cfg))
    tasks = [e for e in out if isinstance(e, TaskRequested)]
    assert tasks, "the start dispatches groups"
    return cfg, state, tasks


def test_the_orchestrators_own_decisions_pass_and_forgeries_of_them_do_not() -> None:
    cfg, state, tasks = running()
    assert all(state.check(t) is None for t in tasks)  # its own, coming back
    forged_task = msgspec.structs.replace(tasks[0], event_id="forged", group_id="g-forged")
    assert "did not dispatch" in (state.check(forged_task) or "")
    batch = BatchAssembled(run="r", event_id="forged-batch", step=1, samples=[], policy_version=0)
    assert "did not assemble" in (state.check(batch) or "")
    report = MetricsReported(run="r", event_id="forged-eval", role="eval", step=10**6, values={})
    assert "eval report" in (state.check(report) or "")
    second = msgspec.structs.replace(started(cfg), event_id="start-again")
    assert "second run.started" in (state.check(second) or "")
    stop = RunStopped(run="r", event_id="forged-stop", reason="user")
    assert "not the orchestrator's" in (state.check(stop) or "")
    # an ad-hoc request (rlbus rollout on a live run) is not the orchestrator's: allowed
    adhoc = msgspec.structs.replace(tasks[0], event_id="adhoc", phase="adhoc")
    assert state.check(adhoc) is None


def test_weights_for_a_batch_that_does_not_exist_are_refused() -> None:
    cfg, state, tasks = running()
    assert "newest batch is step 0" in (state.check(weights(10**9)) or "")
    for t in tasks[:2]:  # two groups of 4 fill the batch of 8: step 1 is assembled
        out = step(state, cfg, scored(t, [0.0, 1.0, 0.0, 1.0]))
    assert any(isinstance(e, BatchAssembled) and e.step == 1 for e in out)
    assert state.check(weights(1)) is None
    assert state.check(weights(2)) is not None


def test_a_version_is_announced_once_for_the_batch_of_its_step() -> None:
    """The issue's forgery, one of them: another announcement of version 1 (other bytes)
    after the trainer's made "step 1" twice in the fold and the lake; so does one that
    names another batch or another step. Each is refused, and the trainer's stands."""
    cfg, state, tasks = running()
    for t in tasks[:2]:
        step(state, cfg, scored(t, [0.0, 1.0, 0.0, 1.0]))
    assert "names batch None" in (state.check(weights(1, batch_id=None)) or "")
    assert "names batch b" in (state.check(weights(1, batch_id="b")) or "")
    assert "trained at step 2" in (state.check(weights(1, step=2)) or "")
    trainers = weights(1)
    step(state, cfg, trainers)
    assert state.trainer_version == 1
    other = weights(1, event_id="w1-forged", weights=ObjectRef(kind="object", location="x"))
    assert "a second weights.published for version 1 (the first: w1)" in (state.check(other) or "")
    assert state.check(trainers) is None  # the same event again: a duplicate, skipped


def test_untrainable_scores_release_their_group_and_free_its_slot() -> None:
    cfg, state, tasks = running()
    bad = scored(tasks[0], [0.0, 1.0, 0.0, 1.0])
    nan = msgspec.structs.replace(bad.samples[0], advantages=pack_f32([float("nan")] * 17))
    bad = msgspec.structs.replace(bad, samples=[nan, *bad.samples[1:]])
    reason = state.check(bad)
    assert reason is not None and "non-finite" in reason
    in_flight = len(state.groups)
    state.fail_group(bad, reason)
    assert tasks[0].group_id not in state.groups and len(state.groups) == in_flight - 1
    assert state.released == 1 and "non-finite" in state.last_release
    assert not state.queues["rl"], "nothing of a released group is queued"


def test_a_failed_answer_releases_the_group_and_the_slot_is_reused() -> None:
    cfg, state, tasks = running()
    dispatched = state.dispatched
    failed = msgspec.structs.replace(
        scored(tasks[0], [0.0, 1.0, 0.0, 1.0]), samples=[], rewards=[], failed="deadline: 5 s"
    )
    assert state.check(failed) is None
    out = step(state, cfg, failed)
    assert state.released == 1 and tasks[0].group_id not in state.groups
    assert state.dispatched == dispatched + 1, "the freed slot is dispatched again"
    assert any(isinstance(e, TaskRequested) for e in out)


def test_waits_for_names_the_algorithm_and_the_trainer() -> None:
    cfg, state, tasks = running("orchestrator.max_async_level=0")
    wants = waits_for(state, cfg)
    assert any("samples: 0 of 8 for step 1" in w for w in wants)
    assert f"algorithm grpo: {len(tasks)} group(s) of reverse-text not scored" in wants
    for t in tasks[:2]:
        step(state, cfg, scored(t, [0.0, 1.0, 0.0, 1.0]))
    assert state.assembled == 1
    # step 2 needs weights v1 on an on-policy run (max_async_level=0)
    assert any(
        w.startswith("trainer: weights v1 to assemble step 2") for w in waits_for(state, cfg)
    )


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("group_size", 0, ">= 1"),
        ("group_size", -3, ">= 1"),
        ("phase", "bogus", "Invalid enum value 'bogus'"),
        ("policy_version", -1, ">= 0"),
    ],
)
def test_task_values_outside_their_declared_range_fail_to_decode(
    field: str, value: object, error: str
) -> None:
    _, _, tasks = running()
    raw = msgspec.msgpack.decode(codec.encode(tasks[0]))
    raw[field] = value
    with pytest.raises(DecodeError, match=error):
        codec.decode(msgspec.msgpack.encode(raw), [TaskRequested])


def test_a_non_finite_reward_fails_to_decode() -> None:
    _, _, tasks = running()
    good = scored(tasks[0], [0.0, 1.0, 0.0, 1.0])
    raw = msgspec.msgpack.decode(codec.encode(good))
    raw["rewards"][1] = float("nan")
    with pytest.raises(DecodeError, match="rewards"):
        codec.decode(msgspec.msgpack.encode(raw), [SamplesScored])


async def test_an_algorithm_that_raises_answers_the_group_as_failed() -> None:
    cfg, _, _ = running()
    core = ScoringCore.for_run(cfg, "grpo")
    base = trace(run="r", rollout="x")
    group_id, request_id = "g1", "req1"
    out = None
    for i in range(4):
        t = msgspec.structs.replace(
            base, rollout_id=f"x{i}", group_id=group_id, reward=float("nan") if i == 1 else 1.0
        )
        event = TraceCompleted(
            run="r", env=t.env, request_id=request_id, group_size=4, step=0, trace=t
        )
        out = await core.step(event)
    assert out is not None and out.failed and out.samples == []
    assert out.group_id == group_id
    ok = sample()
    assert ok.problem() is None


def test_scores_answer_a_group_only_through_the_request_made_for_it() -> None:
    """An adhoc request may reuse a pending group's id (``rlbus rollout`` runs any
    adhoc task): its scores are not the group's, and the group waits for its own."""
    cfg, state, tasks = running()
    t = tasks[0]
    adhoc = msgspec.structs.replace(scored(t, [0.0, 1.0, 0.0, 1.0]), request_id="adhoc-req")
    assert not state.expects(adhoc)
    step(state, cfg, adhoc)
    assert t.group_id in state.groups  # still waiting
    assert state.expects(scored(t, [0.0, 1.0, 0.0, 1.0]))
