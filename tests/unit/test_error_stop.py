"""The error stop: rollouts that only error stop the run with one line saying why
(issue 31, item 1: a run whose every rollout failed looped for minutes without a word)."""

from __future__ import annotations

import msgspec

from roles.algorithm.samples import error_counts
from roles.orchestrator.policy import error_stop
from roles.orchestrator.role import ErrorClock
from schemas import RunStopped, SamplesScored, TaskRef, TaskRequested, Trace, TraceError
from tests.unit.test_orchestrator import make, scored, started, step, tasks, weights

INDEX_ERROR = "internal: IndexError('list index out of range')"


def errored(req: TaskRequested, headline: str = INDEX_ERROR) -> SamplesScored:
    """The algorithm's answer for a group whose every rollout errored."""
    n = req.group_size
    return SamplesScored(
        run="r", event_id=f"scored-{req.group_id}", algorithm="grpo", env=req.env,
        group_id=req.group_id, request_id=req.event_id, task_index=req.task.index,
        step=req.step, samples=[], excluded=n, excluded_errors={headline: n}, zero_advantage=True,
    )  # fmt: skip


def test_rollouts_that_only_error_stop_the_run_naming_the_error() -> None:
    """Every group errors: nothing stops it before `error_stop_s`; after, one line names
    how many errored, the error's kind and message, the env and model, and what to do."""
    cfg, state = make("orchestrator.error_stop_s=60", "orchestrator.max_no_signal_batches=1")
    reqs = tasks(step(state, cfg, started(cfg)))
    for req in reqs:
        out = step(state, cfg, errored(req))
        assert not [e for e in out if isinstance(e, RunStopped)]  # not no_learning_signal
    assert state.error_streak == 4 * len(reqs) and state.trainable_rollouts == 0
    assert error_stop(state, cfg, erroring_s=59.0) is None
    detail = error_stop(state, cfg, erroring_s=61.0)
    assert detail is not None and "\n" not in detail
    assert f"{state.error_streak} rollouts in a row errored" in detail
    assert INDEX_ERROR in detail and "env reverse-text, model policy" in detail
    assert "its log has the traceback" in detail and "orchestrator.error_stop_s" in detail


def test_the_stop_names_the_most_frequent_error_and_its_advice() -> None:
    cfg, state = make("orchestrator.error_stop_s=10")
    reqs = tasks(step(state, cfg, started(cfg)))

    def too_long(n: int) -> str:
        return f"context_too_long: prompt has {n} tokens; the model takes 8 in all"

    # The kind that errs most (its messages differ), named with its most frequent message.
    for req, headline in zip(
        reqs, [INDEX_ERROR, too_long(40), too_long(41), too_long(40)], strict=True
    ):
        step(state, cfg, errored(req, headline))
    detail = error_stop(state, cfg, erroring_s=11.0)
    assert detail is not None and f"; 12 of them {too_long(40)} [" in detail
    assert "`inference.max_model_len`" in detail


def test_one_rollout_that_can_train_ends_the_streak() -> None:
    """A run with some errors that still trains is not stopped: a group with a rollout
    that can train (errored or filtered ones beside it) resets the streak."""
    cfg, state = make("orchestrator.error_stop_s=10")
    reqs = tasks(step(state, cfg, started(cfg)))
    step(state, cfg, errored(reqs[0]))
    mixed = msgspec.structs.replace(
        scored(reqs[1], [1.0]), excluded=3, excluded_errors={INDEX_ERROR: 3}
    )
    step(state, cfg, mixed)
    assert state.error_streak == 0 and state.trainable_rollouts == 1
    assert state.errored_rollouts == 7
    assert error_stop(state, cfg, erroring_s=1000.0) is None


def test_filtered_rollouts_neither_train_nor_end_the_streak() -> None:
    cfg, state = make("orchestrator.error_stop_s=10")
    reqs = tasks(step(state, cfg, started(cfg)))
    step(state, cfg, errored(reqs[0]))
    all_filtered = msgspec.structs.replace(scored(reqs[1], [1.0, 0.0]), samples=[], filtered=2)
    step(state, cfg, all_filtered)
    assert state.error_streak == 4 and state.filtered_rollouts == 2
    assert state.trainable_rollouts == 0
    assert error_stop(state, cfg, erroring_s=11.0) is not None


def test_zero_never_stops() -> None:
    cfg, state = make("orchestrator.error_stop_s=0")
    for req in tasks(step(state, cfg, started(cfg))):
        step(state, cfg, errored(req))
    assert error_stop(state, cfg, erroring_s=10**6) is None


def test_an_old_algorithm_without_error_texts_still_stops_the_run() -> None:
    """A SamplesScored from before `excluded_errors` says only how many errored."""
    cfg, state = make("orchestrator.error_stop_s=10")
    req = tasks(step(state, cfg, started(cfg)))[0]
    step(state, cfg, msgspec.structs.replace(errored(req), excluded_errors={}))
    detail = error_stop(state, cfg, erroring_s=11.0)
    assert detail is not None and "4 of them unknown error [" in detail


def test_the_clock_runs_from_the_later_of_the_streak_and_the_newest_weights() -> None:
    """A slow trainer step while rollouts error is no reason to wait less: a new version
    restarts the clock; a streak that ends and starts again starts it anew."""
    cfg, state = make()
    clock = ErrorClock()
    reqs = tasks(step(state, cfg, started(cfg)))
    assert clock.seconds(state, 100.0) == 0.0  # no errors yet
    step(state, cfg, errored(reqs[0]))
    assert clock.seconds(state, 105.0) == 0.0  # the streak seen now
    assert clock.seconds(state, 125.0) == 20.0
    state.apply(weights(1))
    assert clock.seconds(state, 130.0) == 0.0
    assert clock.seconds(state, 140.0) == 10.0
    step(state, cfg, scored(reqs[1], [1.0]))  # a rollout that can train: streak over
    assert clock.seconds(state, 150.0) == 0.0
    step(state, cfg, errored(reqs[2]))
    assert clock.seconds(state, 160.0) == 0.0
    assert clock.seconds(state, 163.0) == 3.0


def test_the_algorithm_counts_each_errored_rollouts_first_error() -> None:
    """`SamplesScored.excluded_errors`: kind and the message's first line, counted."""

    def trace(i: int, errors: list[TraceError]) -> Trace:
        return Trace(
            rollout_id=f"r{i}", env="e", task=TaskRef(index=0), group_id="g",
            sample_index=i, messages=[], branches=[], errors=errors,
        )  # fmt: skip

    boom = TraceError(kind="internal", message="IndexError: list index\nTraceback ...")
    late = TraceError(kind="inference_timeout", message="no reply")
    traces = [trace(0, [boom, late]), trace(1, [boom]), trace(2, []), trace(3, [late])]
    assert error_counts(traces) == {
        "internal: IndexError: list index": 2,
        "inference_timeout: no reply": 1,
    }
    assert list(error_counts([trace(0, [TraceError(kind="k", message="x" * 500)])])) == [
        "k: " + "x" * 197
    ]
