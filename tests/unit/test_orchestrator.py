"""The orchestrator's fold and decisions, without a broker."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from configs import load_config
from roles.orchestrator.eval_stats import eval_metrics
from roles.orchestrator.policy import decide, trains_on
from roles.orchestrator.state import OrchestratorState
from schemas import (
    AlgorithmAttached,
    AlgorithmDetached,
    BatchAssembled,
    DeadLettered,
    EvalCompleted,
    Event,
    MetricsReported,
    RunStarted,
    RunStopped,
    SamplesScored,
    TaskRequested,
    WeightsPublished,
    batch_id,
    stable_seed,
)
from schemas.run import ObjectRef
from tests.samples import sample


def make(*overrides: str):  # noqa: ANN201
    cfg = load_config(
        "smoke",
        [
            "orchestrator.batch_size=8", "orchestrator.train.env.0.group_size=4", "orchestrator.max_groups_in_flight=4",
            "orchestrator.warmup.steps=0", "orchestrator.eval.interval=0", "max_steps=5", *overrides,
        ],
    )  # fmt: skip
    cfg.run = "r"
    return cfg, OrchestratorState(trains_on=trains_on(cfg))


def step(state: OrchestratorState, cfg, event: Event) -> list[Event]:  # noqa: ANN001
    state.apply(event)
    return decide(state, cfg, cause=event.event_id)


def no_time(events: list[Event]) -> list[Event]:
    """Events without their (informational) timestamps."""
    return [msgspec.structs.replace(e, ts_ns=0) for e in events]


def started(cfg) -> RunStarted:  # noqa: ANN001
    return RunStarted(
        run="r", event_id="start", config=cfg.model_dump(mode="json"), seed=cfg.seed, model_path="m"
    )


def scored(
    req: TaskRequested,
    rewards: list[float],
    policy: int = 0,
    zero: bool = False,
    from_policy: bool = True,
) -> SamplesScored:
    samples = [
        msgspec.structs.replace(
            sample(f"{req.group_id}-{i}"),
            group_id=req.group_id,
            policy_min=policy,
            policy_max=policy,
            reward=r,
            from_policy=from_policy,
        )
        for i, r in enumerate(rewards)
    ]
    return SamplesScored(
        run="r", event_id=f"scored-{req.group_id}", algorithm="grpo", env=req.env, group_id=req.group_id,
        request_id=req.event_id, task_index=req.task.index, step=req.step, samples=samples, rewards=rewards, zero_advantage=zero,
    )  # fmt: skip


def weights(v: int, **changes: Any) -> WeightsPublished:
    """The trainer's announcement of version ``v`` (trained on the orchestrator's batch
    of step ``v``), with ``changes``."""
    event = WeightsPublished(
        run="r",
        event_id=f"w{v}",
        version=v,
        step=v,
        weights=ObjectRef(kind="object", location=f"weights.v{v}"),
        batch_id=batch_id("r", v),
    )
    return msgspec.structs.replace(event, **changes)


def tasks(events: list[Event]) -> list[TaskRequested]:
    return [e for e in events if isinstance(e, TaskRequested)]


def test_dispatch_fills_the_async_window_and_respects_in_flight_bound() -> None:
    """With async level 1 it asks for two batches of data, but never more groups than allowed in flight."""
    cfg, state = make("orchestrator.max_async_level=1")
    out = step(state, cfg, started(cfg))
    reqs = tasks(out)
    assert len(reqs) == 4  # two batches need 4 groups of 4; the in-flight bound is also 4
    assert len({r.group_id for r in reqs}) == 4 and all(
        r.phase == "rl" and r.model == "policy" for r in reqs
    )


def test_decisions_are_deterministic() -> None:
    """The same log gives the same decisions and ids (task choice derives from the seed)."""
    cfg, s1 = make()
    _, s2 = make()
    a, b = step(s1, cfg, started(cfg)), step(s2, cfg, started(cfg))
    assert no_time(a) == no_time(b)
    assert all(e.causation_id == "start" for e in a)


def test_synchronous_mode_waits_for_new_weights() -> None:
    """max_async_level=0: data for step 2 is requested only after weights v1 exist."""
    cfg, state = make("orchestrator.max_async_level=0")
    reqs = tasks(step(state, cfg, started(cfg)))
    assert len(reqs) == 2
    out: list[Event] = []
    for r in reqs:
        out += step(state, cfg, scored(r, [1.0, 0.0, 1.0, 0.0]))
    batches = [e for e in out if isinstance(e, BatchAssembled)]
    assert [b.step for b in batches] == [1] and len(batches[0].samples) == 8
    assert tasks(out) == []  # nothing more until the trainer catches up
    more = tasks(step(state, cfg, weights(1)))
    assert len(more) == 2


def test_stale_samples_are_dropped_and_counted() -> None:
    """Samples older than max_off_policy_steps versions behind the batch's policy never train."""
    cfg, state = make("orchestrator.max_async_level=3", "orchestrator.max_off_policy_steps=1")
    reqs = tasks(step(state, cfg, started(cfg)))
    for v in (1, 2, 3):  # pretend the trainer advanced (e.g. on other data)
        step(state, cfg, weights(v))
    state.assembled = 3  # the next batch is step 4, trained from version 3
    out: list[Event] = []
    out += step(state, cfg, scored(reqs[0], [1, 0, 1, 0], policy=0))  # staleness 3 > 1: dropped
    out += step(state, cfg, scored(reqs[1], [1, 0, 1, 0], policy=2))  # staleness 1: kept
    out += step(state, cfg, scored(reqs[2], [1, 0, 1, 0], policy=3))
    (batch,) = [e for e in out if isinstance(e, BatchAssembled)]
    assert batch.step == 4 and batch.dropped_stale == 4
    assert all((batch.step - 1) - s.policy_min <= 1 for s in batch.samples)


def test_a_frozen_models_samples_are_never_stale() -> None:
    """Staleness is about the policy's tokens: samples a frozen actor wrote every token of
    (version 0 forever) train at any step, and count as staleness 0."""
    cfg, state = make("orchestrator.max_async_level=3", "orchestrator.max_off_policy_steps=0")
    reqs = tasks(step(state, cfg, started(cfg)))
    for v in (1, 2, 3):
        step(state, cfg, weights(v))
    state.assembled = 3
    out: list[Event] = []
    out += step(state, cfg, scored(reqs[0], [1, 0, 1, 0], policy=0, from_policy=False))
    out += step(state, cfg, scored(reqs[1], [1, 0, 1, 0], policy=0, from_policy=False))
    (batch,) = [e for e in out if isinstance(e, BatchAssembled)]
    assert batch.dropped_stale == 0 and len(batch.samples) == 8
    (metrics,) = [e for e in out if isinstance(e, MetricsReported) and e.role == "orchestrator"]
    assert metrics.values["staleness_max"] == 0.0


def dead_letter(req: TaskRequested, n: int) -> DeadLettered:
    return DeadLettered(
        run="r", event_id=f"dead-{n}", causation_id=req.event_id, role="env", consumer="env-x",
        subject=f"rl.r.task.requested.{req.env}", stream_seq=n, deliveries=1, error_type="Rejected",
        error="env 'reverse-text' raised ZeroDivisionError: division by zero\nTraceback ...", payload=b"",
    )  # fmt: skip


def test_tasks_an_env_server_dead_letters_release_their_groups_then_stop_the_run() -> None:
    """A dead-lettered task's group is released (a new one takes its slot); at
    max_env_errors the run stops naming the env and the error. Foreign requests don't count."""
    cfg, state = make("orchestrator.max_env_errors=2")
    reqs = tasks(step(state, cfg, started(cfg)))
    foreign = msgspec.structs.replace(reqs[0], event_id="not-ours")
    assert tasks(step(state, cfg, dead_letter(foreign, 1))) == []
    assert state.released == 0
    refill = tasks(step(state, cfg, dead_letter(reqs[0], 2)))
    assert reqs[0].group_id not in state.groups and state.released == 1
    assert len(refill) == 1  # its slot went to a new group
    out = step(state, cfg, dead_letter(reqs[1], 3))
    (stop,) = [e for e in out if isinstance(e, RunStopped)]
    assert stop.reason == "env_error"
    assert "reverse-text" in stop.detail and "ZeroDivisionError" in stop.detail
    assert "rlbus events r --topic dead.lettered" in stop.detail


def test_a_dead_lettered_eval_task_counts_as_answered() -> None:
    """An eval round with a dead-lettered request still reports (its errors counted)."""
    cfg, state = make("orchestrator.eval.interval=1", "orchestrator.eval.num_tasks=2")
    out = step(state, cfg, started(cfg))
    evals = [e for e in out if isinstance(e, TaskRequested) and e.phase == "eval"]
    assert len(evals) == 2
    step(state, cfg, dead_letter(evals[0], 1))
    answer = EvalCompleted(
        run="r", event_id="e1", request_id=evals[1].event_id, env=evals[1].env, step=0,
        task_index=1, rewards=[1.0],
    )  # fmt: skip
    out = step(state, cfg, answer)
    (report,) = [e for e in out if isinstance(e, MetricsReported) and e.role == "eval"]
    assert report.step == 0


def test_zero_advantage_groups_are_skipped_and_stop_the_run_when_persistent() -> None:
    """Groups without signal are counted, never batched; a long streak stops the run with a reason."""
    cfg, state = make("orchestrator.max_no_signal_batches=2")
    reqs = tasks(step(state, cfg, started(cfg)))
    out: list[Event] = []
    while not any(isinstance(e, RunStopped) for e in out):
        r = reqs.pop(0)
        new = step(state, cfg, scored(r, [1, 1, 1, 1], zero=True))
        reqs += tasks(new)
        out += new
        assert len(out) < 200
    assert not any(isinstance(e, BatchAssembled) for e in out)
    (stop,) = [e for e in out if isinstance(e, RunStopped)]
    assert stop.reason == "no_learning_signal" and "zero advantage" in stop.detail
    assert state.total_skipped_zero == 4  # 2 batches x 2 groups per batch


def filtered(req: TaskRequested, n: int, by: dict[str, int]) -> SamplesScored:
    """A group whose ``n`` rollouts an enforcing filter all flagged: rewards, no samples."""
    return msgspec.structs.replace(scored(req, [0.5] * n), samples=[], filtered=n, filtered_by=by)


def test_all_filtered_groups_are_regenerated_then_stop_the_run_naming_the_filter() -> None:
    """Each all-filtered group is replaced by a new one (nothing of it is batched); a
    group with a rollout that can train ends the streak; at max_filtered_batches' worth
    of groups in a row the run stops with reason rollouts_filtered, naming the filter
    that flagged most of them."""
    cfg, state = make("orchestrator.max_filtered_batches=2")
    reqs = tasks(step(state, cfg, started(cfg)))
    # Three all-filtered groups, then a trainable one: the streak starts over.
    for _ in range(3):
        r = reqs.pop(0)
        new = step(state, cfg, filtered(r, 4, {"gibberish": 4}))
        assert len(tasks(new)) == 1 and r.group_id not in state.groups  # regenerated
        reqs += tasks(new)
    assert state.filtered_streak == 3
    r = reqs.pop(0)
    reqs += tasks(step(state, cfg, scored(r, [1, 0, 1, 0])))
    assert state.filtered_streak == 0 and not state.streak_filters
    out: list[Event] = []
    while not any(isinstance(e, RunStopped) for e in out):
        r = reqs.pop(0)
        new = step(state, cfg, filtered(r, 4, {"repetition": 3, "gibberish": 4}))
        reqs += tasks(new)
        out += new
        assert len(out) < 100
    assert not any(isinstance(e, BatchAssembled) for e in out)
    (stop,) = [e for e in out if isinstance(e, RunStopped)]
    assert stop.reason == "rollouts_filtered"
    assert state.filtered_streak == 4  # 2 batches x 2 groups per batch
    assert "filter 'gibberish' flagged 16" in stop.detail
    assert "orchestrator.max_filtered_batches` = 2" in stop.detail
    # 0: never stops.
    cfg, state = make("orchestrator.max_filtered_batches=0")
    reqs = tasks(step(state, cfg, started(cfg)))
    for _ in range(12):
        r = reqs.pop(0)
        new = step(state, cfg, filtered(r, 4, {"gibberish": 4}))
        assert not any(isinstance(e, RunStopped) for e in new)
        reqs += tasks(new)


def test_each_rl_batch_reports_its_trainable_share_and_warns_under_the_floor() -> None:
    """``trainable_share`` (and ``filtered_share/<filter>``) over the rollouts scored since
    the last batch; under ``orchestrator.min_trainable_share`` the role's warning names
    the filter that kept the most out; the next batch counts afresh."""
    from roles.orchestrator.policy import share_warning

    cfg, state = make("orchestrator.min_trainable_share=0.7")
    reqs = tasks(step(state, cfg, started(cfg)))
    out = step(state, cfg, filtered(reqs[0], 4, {"gibberish": 4}))
    out += step(state, cfg, scored(reqs[1], [1, 0, 1, 0]))
    out += step(state, cfg, scored(reqs[2], [1, 0, 0, 0]))
    (m,) = [e for e in out if isinstance(e, MetricsReported) and e.role == "orchestrator"]
    assert m.values["trainable_share"] == pytest.approx(8 / 12)
    assert m.values["filtered_share/gibberish"] == pytest.approx(4 / 12)
    warning = share_warning(m, cfg)
    assert warning is not None and "only 67%" in warning and "'gibberish' flagged 33%" in warning
    assert "`orchestrator.min_trainable_share` = 0.7" in warning
    reqs += tasks(out)
    out = step(state, cfg, scored(reqs[3], [1, 0, 1, 0]))
    out += step(state, cfg, scored(reqs[4], [0, 1, 0, 1]))
    (m2,) = [e for e in out if isinstance(e, MetricsReported) and e.role == "orchestrator"]
    assert m2.values["trainable_share"] == 1.0 and "filtered_share/gibberish" not in m2.values
    assert share_warning(m2, cfg) is None
    off, _ = make("orchestrator.min_trainable_share=0")
    assert share_warning(m, off) is None


def test_warm_start_batches_are_sft_from_the_teacher() -> None:
    """The first warmup.steps batches come from the warmup actor and are phase sft."""
    cfg, state = make(
        "orchestrator.warmup.steps=1",
        "orchestrator.models.teacher.kind=teacher",
        "orchestrator.max_async_level=1",
        "orchestrator.warmup.group_size=4",
    )
    reqs = tasks(step(state, cfg, started(cfg)))
    assert [r.phase for r in reqs] == ["sft", "sft", "rl", "rl"]
    assert [r.model for r in reqs] == ["teacher", "teacher", "policy", "policy"]
    sft = SamplesScored(
        **{
            **msgspec.structs.asdict(scored(reqs[0], [1, 1, 1, 1])),
            "algorithm": "sft",
            "event_id": "s0",
        }
    )
    sft2 = SamplesScored(
        **{
            **msgspec.structs.asdict(scored(reqs[1], [1, 1, 1, 1])),
            "algorithm": "sft",
            "event_id": "s1",
        }
    )
    step(
        state, cfg, scored(reqs[0], [1, 1, 1, 1], zero=True)
    )  # grpo's view of a teacher group: ignored
    out = step(state, cfg, sft) + step(state, cfg, sft2)
    (batch,) = [e for e in out if isinstance(e, BatchAssembled)]
    assert batch.phase == "sft" and batch.step == 1


def test_warm_start_groups_default_to_one_rollout_per_task() -> None:
    """A deterministic teacher's copies teach nothing: warm-start groups have one rollout."""
    cfg, state = make(
        "orchestrator.warmup.steps=1", "orchestrator.models.teacher.kind=teacher",
        "orchestrator.max_groups_in_flight=64",
    )  # fmt: skip
    sft = [r for r in tasks(step(state, cfg, started(cfg))) if r.phase == "sft"]
    assert len(sft) == cfg.orchestrator.batch_size and all(r.group_size == 1 for r in sft)


def test_replaying_the_log_rebuilds_state_and_decides_nothing_new() -> None:
    """A restarted orchestrator folding the log reproduces every decision (same ids) and no more."""
    cfg, state = make("orchestrator.max_async_level=1")
    log: list[Event] = [started(cfg)]
    log += step(state, cfg, log[0])
    for r in tasks(log):
        ev = scored(r, [1, 0, 0, 1])
        log.append(ev)
        log += step(state, cfg, ev)
    fresh_cfg, fresh = make("orchestrator.max_async_level=1")
    redone: list[Event] = []
    for e in log:
        redone += step(fresh, fresh_cfg, e)
    assert {e.event_id for e in redone} <= {e.event_id for e in log}
    assert fresh.assembled == state.assembled and fresh.dispatched == state.dispatched
    assert decide(fresh, fresh_cfg) == []
    assert no_time(redone) == no_time(
        [e for e in log if e.event_id in {r.event_id for r in redone}]
    )


def test_eval_rounds_report_avg_and_pass_at_k_then_the_run_stops() -> None:
    """Eval at v0 and at max_steps; the stop waits for the final eval's metrics."""
    cfg, state = make(
        "orchestrator.eval.interval=5",
        "orchestrator.eval.num_tasks=2",
        "orchestrator.eval.k=2",
        "max_steps=1",
    )
    out = step(state, cfg, started(cfg))
    evals = [r for r in tasks(out) if r.task.split == "eval"]
    assert [r.task.index for r in evals] == [0, 1] and all(r.group_size == 2 for r in evals)
    results = [
        EvalCompleted(
            run="r",
            event_id=f"ec{i}",
            request_id=r.event_id,
            env=r.env,
            step=0,
            task_index=i,
            rewards=[1.0, 0.0] if i else [0.0, 0.0],
        )
        for i, r in enumerate(evals)
    ]
    out = step(state, cfg, results[0]) + step(state, cfg, results[1])
    (metrics,) = [e for e in out if isinstance(e, MetricsReported)]
    assert metrics.role == "eval" and metrics.values["reverse-text/avg@2"] == 0.25
    assert metrics.values["reverse-text/pass@2"] == 0.5
    out = step(state, cfg, weights(1))
    assert not any(isinstance(e, RunStopped) for e in out)  # final eval still pending
    final = [r for r in tasks(out) if r.task.split == "eval"]
    out = []
    for i, r in enumerate(final):
        out += step(
            state,
            cfg,
            EvalCompleted(
                run="r",
                event_id=f"f{i}",
                request_id=r.event_id,
                env=r.env,
                step=1,
                task_index=i,
                rewards=[1.0, 1.0],
            ),
        )
    (stop,) = [e for e in out if isinstance(e, RunStopped)]
    assert stop.reason == "max_steps"


def test_the_run_stops_only_when_every_eval_round_is_reported() -> None:
    """The final round answered before the first (inference loaded late, the first
    round's env server slower): the run goes on until the first is reported too, so
    every round reaches the summary."""
    cfg, state = make("orchestrator.eval.interval=1", "orchestrator.eval.num_tasks=1",
                      "max_steps=1")  # fmt: skip
    (first,) = [r for r in tasks(step(state, cfg, started(cfg))) if r.task.split == "eval"]
    (final,) = [r for r in tasks(step(state, cfg, weights(1))) if r.task.split == "eval"]

    def answer(r: TaskRequested, version: int) -> EvalCompleted:
        return EvalCompleted(run="r", event_id=f"a{version}", request_id=r.event_id, env=r.env,
                             step=version, task_index=0, rewards=[1.0])  # fmt: skip

    out = step(state, cfg, answer(final, 1))
    assert [e.step for e in out if isinstance(e, MetricsReported)] == [1]
    assert not any(isinstance(e, RunStopped) for e in out)  # v0's round is still out
    out = step(state, cfg, answer(first, 0))
    assert [e.step for e in out if isinstance(e, MetricsReported)] == [0]
    (stop,) = [e for e in out if isinstance(e, RunStopped)]
    assert stop.reason == "max_steps"


def test_eval_metrics_skip_pass_at_k_for_non_binary_rewards() -> None:
    results = [
        EvalCompleted(run="r", request_id="q", env="e", step=0, task_index=0, rewards=[0.5, 1.0])
    ]
    m = eval_metrics(results, 2)
    assert m["e/avg@2"] == 0.75 and "e/pass@2" not in m


def test_adhoc_requests_on_a_live_runs_log_are_not_the_orchestrators() -> None:
    """`rlbus eval` / `rlbus rollout` requests (phase "adhoc") on a live run's log change
    neither its pending eval round, nor its report, nor the groups it trains on."""
    from roles.up.rollout import build_requests, plan_requests

    cfg = load_config("smoke", ["orchestrator.eval.num_tasks=2", "orchestrator.eval.k=2"])
    cfg.run = "r"
    state = OrchestratorState(trains_on=trains_on(cfg))

    def step(event: Event) -> list[Event]:
        state.apply(event)
        return decide(state, cfg, cause=event.event_id)

    start = RunStarted(run="r", config=cfg.model_dump(mode="json"), seed=0, model_path="m")
    own = [e for e in step(start) if isinstance(e, TaskRequested) and e.task.split == "eval"]
    assert len(own) == 2  # the run's eval of v0, pending
    groups = set(state.groups)

    def answer(r: TaskRequested, rewards: list[float]) -> EvalCompleted:
        return EvalCompleted(run="r", request_id=r.event_id, env=r.env, step=0,
                             task_index=r.task.index, rewards=rewards)  # fmt: skip

    evals = build_requests(
        "r", cfg.seed, plan_requests(cfg, "reverse-text", "eval", 4, 2, "policy"), 1000
    )
    trains = build_requests(
        "r", cfg.seed, plan_requests(cfg, "reverse-text", "train", 4, 2, "policy"), 1000
    )
    out = [e for r in [*evals, *trains] for e in step(r)]
    out += [e for r in evals for e in step(answer(r, [1.0, 1.0]))]
    assert not [e for e in out if isinstance(e, MetricsReported) and e.role == "eval"]
    assert set(state.groups) == groups  # no ad-hoc train group adopted
    out = [e for r in own for e in step(answer(r, [0.0, 1.0]))]
    (report,) = [e for e in out if isinstance(e, MetricsReported) and e.role == "eval"]
    assert report.step == 0 and report.values["reverse-text/avg@2"] == 0.5  # its own answers only


EVAL_ONLY = (
    'orchestrator.eval.env=[{id="reverse-text"},'
    ' {id="alphabet-sort", num_tasks=3, sampling={max_completion_tokens=7, seed=11}}]'
)


def test_an_eval_only_env_is_evaluated_with_its_own_table_and_never_trained() -> None:
    """`[[orchestrator.eval.env]]` naming an env the run does not train on: each eval round
    asks its own `num_tasks` with its sampling table (unset keys from
    `orchestrator.eval.sampling`, seeds from its own `seed`), its answers are scored into
    the round's figures under its key, and no train group is ever dispatched to it."""
    cfg, state = make("orchestrator.eval.interval=5", "orchestrator.eval.num_tasks=2", EVAL_ONLY)
    first = step(state, cfg, started(cfg))
    evals = [r for r in tasks(first) if r.task.split == "eval"]
    by_env = {env: [r for r in evals if r.env == env] for env in ("reverse-text", "alphabet-sort")}
    assert [r.task.index for r in by_env["reverse-text"]] == [0, 1]
    assert [r.task.index for r in by_env["alphabet-sort"]] == [0, 1, 2]
    for r in by_env["reverse-text"]:  # the train env keeps the eval defaults
        assert r.sampling.max_completion_tokens == 16 and r.sampling.temperature == 0.0
        assert r.seed == stable_seed(0, "eval", "reverse-text", r.task.index)
    for r in by_env["alphabet-sort"]:
        assert r.sampling.max_completion_tokens == 7 and r.sampling.temperature == 0.0
        assert r.seed == stable_seed(11, "eval", "alphabet-sort", r.task.index)
        assert r.phase == "eval" and r.args == {}
    out = []
    for i, r in enumerate(evals):
        rewards = [1.0] if r.env == "alphabet-sort" else [0.0]
        out += step(state, cfg, EvalCompleted(run="r", event_id=f"ec{i}", request_id=r.event_id,
                                              env=r.env, step=0, task_index=r.task.index,
                                              rewards=rewards))  # fmt: skip
    (metrics,) = [e for e in out if isinstance(e, MetricsReported) and e.role == "eval"]
    assert metrics.values["alphabet-sort/avg@1"] == 1.0
    assert metrics.values["reverse-text/avg@1"] == 0.0
    train, new = [], first + out
    for v in range(1, 5):  # train through a few versions: train groups stay on reverse-text
        asked = [r for r in tasks(new) if r.phase == "rl"]
        train += asked
        new = [e for r in asked for e in step(state, cfg, scored(r, [0.0, 1.0, 0.0, 1.0]))]
        new += step(state, cfg, weights(v))
    assert state.assembled >= 3 and len(train) >= 6
    assert {r.env for r in train} == {"reverse-text"}


def test_the_stall_threshold_scales_with_steps_not_with_startup_or_stalls() -> None:
    """A warm start's teacher batch comes seconds before inference has loaded the policy:
    that wait (reported as a stall) is no step time, so the next real stall is reported
    at the usual threshold (it once went unreported: the 6 s wait doubled it)."""
    from roles.orchestrator.role import StepTimes

    steps = StepTimes()
    steps.batch(10.0, stalled=False)  # the teacher's batch (the first: no step yet)
    assert steps.median() == 0.0
    steps.batch(16.0, stalled=True)  # the first RL batch, after a reported stall
    steps.batch(17.0, stalled=False)
    steps.batch(18.0, stalled=False)
    assert steps.median() == 1.0
    steps.batch(30.0, stalled=False)  # a slow step that was no stall counts
    steps.batch(31.0, stalled=False)
    assert steps.median() == 1.0 and list(steps.times) == [1.0, 1.0, 12.0, 1.0]


def test_an_attached_algorithm_whose_worker_never_shows_is_named_once_past_the_bound() -> None:
    """The orchestrator's watch over attaches (``AttachWatch``): its clock starts at the
    first look; a worker seen live (its consumer in a live heartbeat) is forgotten; one
    never seen is returned once ``attach_timeout_s`` after the first look; a shadow, or
    an algorithm detached meanwhile, is never waited for."""
    from roles.orchestrator.role import AttachWatch

    watch = AttachWatch()
    ghost = AlgorithmAttached(run="r", event_id="a1", algorithm="ghost", name="grpo")
    real = AlgorithmAttached(run="r", event_id="a2", algorithm="rloo", name="rloo")
    gone = AlgorithmAttached(run="r", event_id="a3", algorithm="gone", name="grpo")
    watch.saw(
        AlgorithmAttached(run="r", event_id="a4", algorithm="shade", name="grpo", shadow=True)
    )
    for e in (ghost, real, gone):
        watch.saw(e)
    assert sorted(watch.waiting) == ["ghost", "gone", "rloo"]
    assert watch.absent(set(), now=100.0, timeout_s=30) == []  # the clock starts here
    watch.saw(AlgorithmDetached(run="r", event_id="d3", algorithm="gone"))
    assert watch.absent({"algorithm-rloo"}, now=110.0, timeout_s=30) == []
    assert sorted(watch.waiting) == ["ghost"]
    assert watch.absent(set(), now=129.9, timeout_s=30) == []
    assert watch.absent(set(), now=130.0, timeout_s=30) == [ghost]
    assert watch.waiting == {} and watch.absent(set(), now=500.0, timeout_s=30) == []
