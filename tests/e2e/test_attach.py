"""Attaching algorithm workers to a live run, as a user does it, with real processes.

One smoke run on a nats-server the test owns (so the log outlives `rlbus up`). After a
few steps, `rlbus algorithm attach max_rl --shadow --from-start` and `rlbus algorithm
attach rloo` join it; rloo's samples train once its routing event is on the log, until
`rlbus algorithm detach rloo`; the shadow scores every rollout of the run, and the
documented SQL comparison query returns one row per trained rollout for both.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats.js.errors
import pytest

import replay
from bus.server import EmbeddedServer
from replay.sql import connect
from schemas import (
    AlgorithmAttached,
    AlgorithmDetached,
    BatchAssembled,
    SamplesScored,
    TaskRequested,
)
from tests.e2e.helpers import all_events, rlbus_up

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RUN = "attach1"


def cli(url: str, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "roles.cli", "algorithm", *args, "--run", RUN, "--nats-url", url]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )


def wait_for(url: str, what: str, check: Any, timeout_s: float = 120.0) -> list[Any]:
    """Poll the run's log until ``check(events)`` holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            events = asyncio.run(all_events(url, RUN))
        except nats.js.errors.NotFoundError:  # the run's stream is not created yet
            events = []
        if check(events):
            return events
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def seq_of(events: list[Any], cls: type, **fields: Any) -> int:
    return next(
        i for i, e in enumerate(events)
        if isinstance(e, cls) and all(getattr(e, k) == v for k, v in fields.items())
    )  # fmt: skip


@pytest.fixture(scope="module")
def attached_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[Any]]]:
    data = tmp_path_factory.mktemp("attach")
    with EmbeddedServer(data / RUN / "nats") as server:
        url = server.url
        # Long enough that the attaches land mid-run (the detach came at step 31 of 500 in
        # a check run; the waits poll the log, not the clock).
        up = rlbus_up(
            data, RUN, "max_steps=150", "orchestrator.eval.interval=0", f"--nats-url={url}"
        )
        procs = [up]
        try:
            wait_for(
                url,
                "step 3",
                lambda es: any(isinstance(e, BatchAssembled) and e.step >= 3 for e in es),
            )
            shadow = cli(url, "attach", "max_rl", "--shadow", "--from-start")
            rloo = cli(url, "attach", "rloo")
            procs += [shadow, rloo]

            def rloo_trained(es: list[Any]) -> bool:
                return any(
                    isinstance(e, BatchAssembled) and any("rloo" in s.algorithms for s in e.samples)
                    for e in es
                )

            wait_for(url, "a batch with rloo samples", rloo_trained)
            detach = subprocess.run(
                [sys.executable, "-m", "roles.cli", "algorithm", "detach", "rloo", "--run", RUN, "--nats-url", url],
                capture_output=True, text=True, timeout=60,
            )  # fmt: skip
            assert detach.returncode == 0, detach.stderr
            assert rloo.wait(timeout=60) == 0  # the detached worker stops by itself
            out, _ = up.communicate(timeout=600)
            assert up.returncode == 0, out[-4000:]
            # The run stopped: the shadow finishes scoring the log, then exits by itself.
            shadow_out, _ = shadow.communicate(timeout=120)
            assert shadow.returncode == 0, shadow_out[-4000:]
            # Its catch-up over the stored traces showed its progress, to the end.
            assert re.search(r"^catch-up max_rl: (\d+)/\1 traces \(100%\)$", shadow_out, re.M), (
                shadow_out[:2000]
            )
            events = asyncio.run(all_events(url, RUN))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.communicate()
    assert replay.sync_lake(RUN, data, force=True) is not None
    yield data, events


def test_training_attach_routes_groups_dispatched_after_it(
    attached_run: tuple[Path, list[Any]],
) -> None:
    """Groups the orchestrator dispatched after folding the attach (and before the detach)
    wait for rloo and train on grpo+rloo samples; the others never see rloo."""
    _, events = attached_run
    attached = seq_of(events, AlgorithmAttached, algorithm="rloo")
    detached = seq_of(events, AlgorithmDetached, algorithm="rloo")
    assert not events[attached].shadow and attached < detached
    seq = {e.event_id: i for i, e in enumerate(events)}
    requests = {
        e.group_id: e for e in events
        if isinstance(e, TaskRequested) and e.phase == "rl" and e.task.split == "train"
    }  # fmt: skip
    for r in requests.values():
        # a decision's cause is the event the orchestrator had just folded
        routed = attached <= seq[r.causation_id] < detached
        assert r.algorithms == (["grpo", "rloo"] if routed else ["grpo"]), r.group_id
    trained = [
        (s, requests[s.group_id]) for e in events
        if isinstance(e, BatchAssembled) and e.phase == "rl" for s in e.samples
    ]  # fmt: skip
    for sample, request in trained:
        assert "grpo" in sample.algorithms and set(sample.algorithms) <= set(request.algorithms)
    assert sum("rloo" in s.algorithms for s, _ in trained) > 0
    # the first batch holding a group routed to rloo trains on rloo's samples
    first = next(
        e for e in events if isinstance(e, BatchAssembled)
        and any("rloo" in requests[s.group_id].algorithms for s in e.samples if s.group_id in requests)
    )  # fmt: skip
    assert all(
        "rloo" in s.algorithms for s in first.samples if "rloo" in requests[s.group_id].algorithms
    )


def documented_comparison_query() -> str:
    text = ROOT.joinpath("docs", "analytics.md").read_text()
    m = re.search(r"### 15\. A shadow algorithm.*?```sql\n(?P<sql>.*?)```", text, re.S)
    assert m is not None
    return m["sql"]


def test_shadow_scores_every_rollout_and_sql_compares_them(
    attached_run: tuple[Path, list[Any]],
) -> None:
    """The shadow caught up from the start: the comparison has one row per grpo-scored trace."""
    data, events = attached_run
    attach = events[seq_of(events, AlgorithmAttached, algorithm="max_rl")]
    assert attach.shadow and attach.from_seq == 1
    first_step_after = min(
        e.step for e in events[seq_of(events, AlgorithmAttached, algorithm="max_rl"):]
        if isinstance(e, BatchAssembled)
    )  # fmt: skip
    assert first_step_after > 3  # attached mid-run
    scored = {(a, s.rollout_id, s.branch) for e in events if isinstance(e, SamplesScored)
              for a in [e.algorithm] for s in e.samples}  # fmt: skip
    grpo = {(r, b) for a, r, b in scored if a == "grpo"}
    shadow = {(r, b) for a, r, b in scored if a == "max_rl"}
    assert grpo and shadow == grpo
    # never trained: no batch sample carries the shadow's channels
    assert all(
        "max_rl" not in s.algorithms
        for e in events
        if isinstance(e, BatchAssembled)
        for s in e.samples
    )
    con = connect(data, RUN)
    rows = con.sql(documented_comparison_query()).fetchall()
    assert len(rows) == len(grpo)
    assert {(r[0], r[1]) for r in rows} == grpo
