"""The fault suite's table: each fault against a live smoke run, and what the run did.

Two `rlbus up` runs (the scenarios of tests/e2e/test_faults.py, with timings):

- **bad input**: garbage and schema-valid but impossible events into every topic a role
  reads, a batch id squatted by another identity, roles reaching for another's work with
  their own credentials, a user algorithm that raises on one group in three, then a
  SIGSTOPped trainer (how long until the stall report) and a SIGSTOPped algorithm worker
  (its groups released at their deadline);
- **kills**: kill -9 of the env server, inference, the algorithm worker, the
  orchestrator, the trainer and the nats-server, in turn: the recovery is the longest
  gap between two trained steps from the last step before the kill to the third after
  it (a step whose batch was nearly ready can come at once after a kill, so the gap
  that holds the restart shows), against the run's median step time; also the time
  until three more steps.

Each run's log is checked afterwards (tests.e2e.faults.invariants): steps reached, every
injected event dead-lettered, traces lost or twice, samples trained twice.

    python -m benchmarks.fault_bench       # just bench-faults; results/faults.{json,md}
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, save
from bus.reader import read_log
from bus.runtime import Bus
from bus.server import EmbeddedServer
from bus.subjects import Topic, subject
from schemas import EVENT_TYPES, BatchAssembled, DeadLettered, SamplesScored, WeightsPublished
from tests.e2e.faults import (
    FORGED,
    inject,
    invariants,
    overreach,
    pause,
    sigkill,
    time_to_next_step,
)
from tests.e2e.helpers import reached_version, rlbus_up, running_role

FLAKY = 'orchestrator.algorithms=[{id="grpo",name="tests.e2e.flaky_algorithm:FailsEveryThird"}]'
SETTLE_S = 3.0  # between two kills
KILLED = ["env", "inference", "algorithm", "orchestrator", "trainer", "nats-server"]


def say(line: str) -> None:
    print(f"[faults] {line}", flush=True)


async def finish(proc: subprocess.Popen[str], root: Path, run: str, steps: int) -> dict[str, Any]:
    out, _ = await asyncio.to_thread(proc.communicate, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"run {run} failed:\n{out[-3000:]}")
    with EmbeddedServer(root / run / "nats") as server:
        bus = await Bus.connect(server.url, run=run, producer="bench")
        try:
            topics = [(t, None) for t in Topic]
            events = [x async for x in read_log(bus, topics, EVENT_TYPES, with_seq=True)]
        finally:
            await bus.close()
    found = invariants(events, steps)
    weights = sorted(
        (e.ts_ns, e.version) for _, e in events
        if isinstance(e, WeightsPublished) and not e.event_id.startswith(FORGED)
    )  # fmt: skip
    gaps = [(b[0] - a[0]) / 1e9 for a, b in zip(weights, weights[1:], strict=False)]
    found["median_step_s"] = round(statistics.median(gaps), 2) if gaps else 0.0
    found["events"] = events  # type: ignore[assignment]
    return found


async def bad_input(root: Path, steps: int = 30) -> list[dict[str, Any]]:
    run = "bad-input"
    say(f"{run}: starting a smoke run of {steps} steps")
    proc = rlbus_up(
        root, run, f"max_steps={steps}", FLAKY, "bus.heartbeat_interval_s=1",
        "orchestrator.stall_min_s=3", "orchestrator.stall_factor=2",
        "orchestrator.group_timeout_s=4", "orchestrator.stall_stop_s=120",
    )  # fmt: skip
    url = await reached_version(proc, root, run, 2, timeout_s=600)
    if url is None:
        raise RuntimeError(f"{run} never reached version 2")
    say(f"{run}: injecting bad events")
    injected = await inject(url, run, steps // 2, root)
    refused = await overreach(url, root, run)
    bus = await Bus.connect(url, run=run, producer="bench")
    try:
        say(f"{run}: SIGSTOP trainer for 10 s")
        trainer = (await running_role(url, run, "trainer")).pid
        stopped_at = time.monotonic()
        stall = asyncio.create_task(first_stall(bus))
        await pause(trainer, 10)
        stall_after = await asyncio.wait_for(stall, 60) - stopped_at
        say(f"{run}: SIGSTOP algorithm worker for 10 s")
        await pause((await running_role(url, run, "algorithm", "grpo")).pid, 10)
    finally:
        await bus.close()
    found = await finish(proc, root, run, steps)
    events = found.pop("events")
    dead = {e.stream_seq for _, e in events if isinstance(e, DeadLettered)}
    failed = [e.failed for _, e in events if isinstance(e, SamplesScored) and e.failed]
    batch_steps = [e.step for _, e in events
                   if isinstance(e, BatchAssembled) and not e.event_id.startswith(FORGED)]  # fmt: skip
    logs = "".join(p.read_text() for p in (root / run / "logs").glob("*.log"))
    common = {
        "steps": found["steps"],
        "lost": found["traces_lost"],
        "duplicated": found["traces_twice"] + found["samples_trained_twice"],
    }
    return [
        {**common, "scenario": "garbage + impossible events, every topic a role reads",
         "injected": len(injected), "dead_lettered": len(set(injected) & dead)},
        {**common, "scenario": "a batch's id and its 3 salts squatted by the env identity",
         "injected": 4, "batch_stored_once": batch_steps.count(steps // 2) == 1,
         "squat_noticed": logs.count('"publish.squatted"') > 0},
        {**common, "scenario": "roles reaching for another's work, with their own credentials",
         "injected": 7, "refused_by_the_server": len(refused)},
        {**common, "scenario": "algorithm raises on 1 group in 3",
         "released": sum(f.startswith("ValueError") for f in failed)},
        {**common, "scenario": "SIGSTOP trainer 10 s",
         "stall_report_after_s": round(stall_after, 1)},
        {**common, "scenario": "SIGSTOP algorithm worker 10 s (group_timeout_s 4)",
         "released": sum(f.startswith("deadline") for f in failed)},
    ]  # fmt: skip


async def first_stall(bus: Bus) -> float:
    """When the first stall report reaches the log (monotonic clock)."""
    subject_ = subject(bus.run, Topic.METRICS_REPORTED, "stall")
    while True:
        try:
            await bus.js.get_last_msg(bus.stream, subject_)
            return time.monotonic()
        except Exception:  # noqa: BLE001 - none yet
            await asyncio.sleep(0.1)


async def kills(root: Path, steps: int = 150) -> list[dict[str, Any]]:
    run = "kills"
    say(f"{run}: starting a smoke run of {steps} steps")
    proc = rlbus_up(root, run, f"max_steps={steps}", "trainer.checkpoint_interval=4")
    url = await reached_version(proc, root, run, 2, timeout_s=600)
    if url is None:
        raise RuntimeError(f"{run} never reached version 2")
    await inject(url, run, steps - 5, root)  # restarted roles meet bad events too
    bus = await Bus.connect(url, run=run, producer="bench")
    times: dict[str, float] = {}
    killed_ns: dict[str, int] = {}
    try:
        for role in KILLED:
            if role == "nats-server":
                pid = json.loads((root / run / "nats" / "server.json").read_text())["pid"]
            else:
                instance = "grpo" if role == "algorithm" else ""
                pid = (await running_role(url, run, role, instance)).pid
            killed_ns[role] = time.time_ns()
            times[role] = await time_to_next_step(bus, sigkill(pid), steps=3)
            say(f"{run}: kill -9 {role}: 3 more steps after {times[role]:.1f} s")
            await asyncio.sleep(SETTLE_S)  # each fault alone: the last one's restart is over
    finally:
        await bus.close()
    found = await finish(proc, root, run, steps)
    events = found.pop("events")
    trained = sorted(e.ts_ns for _, e in events
                     if isinstance(e, WeightsPublished) and not e.event_id.startswith(FORGED))  # fmt: skip
    return [
        {"scenario": f"kill -9 {role}", "steps": found["steps"],
         "lost": found["traces_lost"],
         "duplicated": found["traces_twice"] + found["samples_trained_twice"],
         "longest_gap_s": longest_gap(trained, killed_ns[role]),
         "3_steps_after_s": round(t, 1), "median_step_s": found["median_step_s"]}
        for role, t in times.items()
    ]  # fmt: skip


def longest_gap(trained_ns: list[int], killed_ns: int, after: int = 3) -> float:
    """The longest gap (s) between consecutive trained steps from the last one before
    ``killed_ns`` to the ``after``-th after it."""
    before = [t for t in trained_ns if t <= killed_ns][-1:]
    window = before + [t for t in trained_ns if t > killed_ns][:after]
    return round(max((b - a) / 1e9 for a, b in zip(window, window[1:], strict=False)), 1)


def table(rows: list[dict[str, Any]]) -> str:
    cols = ["scenario", "steps", "injected", "dead_lettered", "lost", "duplicated"]
    extra = "what happened"
    lines = ["| " + " | ".join([*cols, extra]) + " |", "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        rest = ", ".join(f"{k} {v}" for k, v in r.items() if k not in cols)
        lines.append("| " + " | ".join([*(str(r.get(c, "")) for c in cols), rest]) + " |")
    return "\n".join(lines) + "\n"


async def main() -> None:
    with tempfile.TemporaryDirectory(prefix="rlbus-faults-") as tmp:
        root = Path(tmp)
        rows = await bad_input(root) + await kills(root)
    path = save("faults", {"rows": rows})
    md = table(rows)
    (RESULTS / "faults.md").write_text(md)
    print(md)
    say(f"wrote {path} and {RESULTS / 'faults.md'}")


if __name__ == "__main__":
    asyncio.run(main())
