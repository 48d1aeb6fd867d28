"""The loop profile's pure parts: the critical path of a step from hand-made events, the
/proc reading on this very process, role names, busy spans and the timeline window."""

from __future__ import annotations

import os
import subprocess
import threading

import pytest

from benchmarks.critical_path import (
    medians,
    steady,
    step_account,
    step_rows,
    swap_times,
    throughput,
)
from benchmarks.proc_sampler import Sampler, read_stat, read_status, role_name
from benchmarks.timeline_plot import busy_spans, lane_order, window
from schemas import (
    BatchAssembled,
    MetricsReported,
    ObjectRef,
    Sample,
    SamplesScored,
    TaskRef,
    TaskRequested,
    Trace,
    TraceCompleted,
    WeightsPublished,
)

S = 1_000_000_000  # ns per second


def _sample() -> Sample:
    empty = b""
    return Sample(
        rollout_id="r", branch=0, env="e", task_index=0, group_id="g", token_ids=empty,
        mask=empty, logprobs=empty, temperatures=empty, advantages=empty,
    )  # fmt: skip


def _events() -> dict[str, list]:
    """Three steps: step 1 fully linked, step 2 whose version was skipped by inference
    (version 3 went live instead), step 3 without trainer metrics."""
    requests, traces, scored, batches, published = [], [], [], [], []
    plan = {  # step: (requested, [trace times], scored, assembled, published)
        1: (1.0, [1.5, 2.0], 2.2, 2.3, 3.0),
        2: (2.1, [3.1], 3.3, 3.4, 4.0),
        3: (3.5, [4.4], 4.5, 4.6, 5.0),
    }
    for step, (req, done, sc, asm, pub) in plan.items():
        rid, sid = f"task{step}", f"scored{step}"
        task = TaskRef(index=step)
        requests.append(
            TaskRequested(
                run="r",
                event_id=rid,
                env="e",
                task=task,
                group_id=f"g{step}",
                group_size=len(done),
                ts_ns=int(req * S),
            )  # fmt: skip
        )
        for i, t in enumerate(done):
            trace = Trace(
                rollout_id=f"{rid}-{i}", env="e", task=task, group_id=f"g{step}",
                sample_index=i, messages=[], branches=[],
            )  # fmt: skip
            traces.append(
                TraceCompleted(
                    run="r",
                    env="e",
                    request_id=rid,
                    group_size=len(done),
                    step=0,
                    trace=trace,
                    ts_ns=int(t * S),
                )  # fmt: skip
            )
        scored.append(
            SamplesScored(
                run="r",
                event_id=sid,
                algorithm="grpo",
                env="e",
                group_id=f"g{step}",
                request_id=rid,
                task_index=step,
                step=0,
                samples=[],
                ts_ns=int(sc * S),
            )  # fmt: skip
        )
        batches.append(
            BatchAssembled(
                run="r",
                step=step,
                samples=[_sample()] * 4,
                policy_version=step - 1,
                sources=[sid],
                ts_ns=int(asm * S),
            )  # fmt: skip
        )
        published.append(
            WeightsPublished(
                run="r",
                version=step,
                step=step,
                weights=ObjectRef(kind="object", location="w"),
                ts_ns=int(pub * S),
            )  # fmt: skip
        )
    trainer = [
        MetricsReported(run="r", role="trainer", step=1, values={"step_s": 0.5, "wait_s": 0.1}),
        MetricsReported(run="r", role="trainer", step=2, values={"step_s": 0.4, "wait_s": 0.2}),
    ]
    return {"requests": requests, "traces": traces, "scored": scored, "batches": batches,
            "published": published, "trainer": trainer}  # fmt: skip


def test_step_rows_follow_the_ids_from_request_to_live() -> None:
    """Each segment of a step's critical path comes from the events linked to its batch;
    a version inference skipped goes live with the next one; a missing metric is None."""
    e = _events()
    rows = step_rows(**e, swaps={1: 3.2, 3: 5.2})
    one, two, three = rows
    assert one["request_to_last_trace"] == pytest.approx(1.0)
    assert one["last_trace_to_scored"] == pytest.approx(0.2)
    assert one["scored_to_assembled"] == pytest.approx(0.1)
    assert one["assembled_to_train_start"] == pytest.approx(0.2)  # published 3.0 - step_s 0.5
    assert one["train"] == pytest.approx(0.5)
    assert one["publish_to_live"] == pytest.approx(0.2)
    assert one["step_wall"] is None
    assert two["live"] == pytest.approx(5.2) and two["step_wall"] == pytest.approx(1.0)
    assert three["train_start"] is None and three["train"] is None
    assert three["publish_to_live"] == pytest.approx(0.2)
    med = medians(rows)
    assert med["train"] == pytest.approx(0.45) and med["step_wall"] == pytest.approx(1.0)
    account = step_account(rows)  # step 2 only: step 3 has no trainer metrics
    assert account["wall"] == pytest.approx(1.0) and account["other"] == pytest.approx(0.4)
    speed = throughput(rows, e["traces"])  # window (3.0, 5.0]: traces at 3.1 and 4.4
    assert speed["steps_per_s"] == pytest.approx(1.0)
    assert speed["generated_per_s"] == pytest.approx(1.0)
    assert speed["trained_per_s"] == pytest.approx(4.0)


def test_steady_drops_the_filling_pipeline() -> None:
    """The steady state is RL steps without the first fifth (at least two)."""
    rows = [{"step": s, "phase": "sft" if s <= 5 else "rl"} for s in range(1, 26)]
    assert [r["step"] for r in steady(rows)][:2] == [10, 11]
    assert len(steady(rows[:3])) == 3


def test_swap_times_reads_structlog_lines() -> None:
    """``weights.swapped`` lines give each version's first swap; other lines are skipped."""
    lines = [
        '{"event": "weights.swapped", "version": 2, "timestamp": "2026-01-01T00:00:01.5Z"}',
        '{"event": "inference.throughput", "timestamp": "2026-01-01T00:00:02Z"}',
        "not json weights.swapped",
        '{"event": "weights.swapped", "version": 2, "timestamp": "2026-01-01T00:00:03Z"}',
    ]
    swaps = swap_times(lines)
    assert list(swaps) == [2]
    assert swaps[2] % 60 == pytest.approx(1.5)


def test_proc_reading_of_this_process() -> None:
    """/proc/<pid>/stat and status parse on the current process, and a sampler rooted at
    it sees its CPU time, its threads and its allowed CPUs."""
    ppid, cpu_s, started = read_stat(os.getpid())
    assert ppid == os.getppid() and cpu_s > 0 and started > 0
    assert int(read_status(os.getpid())["Threads"]) >= 1
    sampler, stop = Sampler(os.getpid()), threading.Event()
    waiter = threading.Thread(target=stop.wait)
    waiter.start()
    try:
        sampler.sample()
        sum(range(200_000))
        sampler.sample()
    finally:
        stop.set()
        waiter.join()
    (row,) = [r for n, r in sampler.roles().items() if n == sampler.procs[os.getpid()].name]
    assert row["cpu_s"] > 0 and row["threads_max"] >= 2
    allowed = sorted(os.sched_getaffinity(0))
    assert row["cpus_allowed"][0].split("-")[0] == str(allowed[0])
    assert len(sampler.series()["t"]) == 1


def test_sampler_finds_children_and_counts_ended_ones() -> None:
    """A child process of the root is found, named by its command line, and still
    counted once it has exited."""
    sampler = Sampler(os.getpid())
    child = subprocess.Popen(["sleep", "0.3"])
    try:
        sampler.sample()
    finally:
        child.wait()
    sampler.sample()
    assert child.pid not in sampler.procs
    assert sampler.roles()["sleep"]["processes"] == 1


def test_role_names() -> None:
    """A role is named by its log file, else by its command line."""
    role = ["python", "-m", "roles.cli", "role", "env", "--env", "x"]
    assert role_name(role, "/tmp/r/runs/x/logs/env-reverse-text-1.log") == "env-reverse-text-1"
    assert role_name(role, "pipe:[123]") == "env"
    assert role_name(["/venv/bin/nats-server", "-c", "x"], "/dev/null") == "nats-server"
    assert role_name(["python", "-m", "roles.cli", "up", "--no-view"], "") == "launcher"
    assert lane_order(["trainer", "launcher", "env-a", "orchestrator"])[0] == "orchestrator"


def test_busy_spans_and_window() -> None:
    """Busy sampling intervals merge into spans; the window is the middle steps."""
    assert busy_spans([0, 1, 2, 3, 4], [0, 0.5, 0.6, 0.0, 0.9], 0.25) == [(0, 2), (3, 4)]
    rows = [{"step": s, "published": float(s)} for s in range(1, 31)]
    assert [r["step"] for r in window(rows, 10)] == list(range(11, 21))
