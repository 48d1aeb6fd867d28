"""A short real `debate` run: the learner against a frozen snapshot, its rae worker killed.

One run checks, from the log: every sample in `batch.assembled` is a learner's branch
(the trace's seat, played by the policy; never the opponent's or the judge's), the
opponent served the policy's weights up to its pinned version and no later, eval reports
the learner's win rate at every eval, and `rlbus replay <run> algorithm rae`, an
uninterrupted replay of the same log, matches every group the worker scored, before and
after it was killed and rebuilt its baselines from its own output.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bus.server import EmbeddedServer
from schemas import BatchAssembled, MetricsReported, TraceCompleted
from tests.e2e.faults import sigkill
from tests.e2e.helpers import all_events, reached_version, running_role, summary
from tests.e2e.helpers import rlbus_up as up
from tests.e2e.test_replay import rlbus

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PIN = 2  # the opponent: the policy as published at version 2
SHORT = (
    "orchestrator.warmup.steps=0", "orchestrator.batch_size=16",
    "orchestrator.train.env.0.group_size=4", "orchestrator.max_groups_in_flight=8",
    "orchestrator.eval.interval=5", "orchestrator.eval.num_tasks=8",
    f"orchestrator.models.opponent.policy_version={PIN}", "trainer.checkpoint_interval=0",
    "orchestrator.skip_zero_advantage_groups=false",
)  # fmt: skip


async def test_debate_trains_only_the_learner_and_rae_rebuilds_its_state(tmp_path: Path) -> None:
    # 8 steps after the kill at version 4: a loaded machine ran 6 in the time the launcher
    # took to see the worker dead, and a run that ends first restarts nothing.
    run, steps = "debate1", 12
    proc = up(tmp_path, run, f"max_steps={steps}", *SHORT, config="debate")
    url = await reached_version(proc, tmp_path, run, 4, timeout_s=400)
    assert url is not None, "the run never reached version 4"
    pid = (await running_role(url, run, "algorithm", "rae")).pid
    await sigkill(pid)()
    out, _ = await asyncio.to_thread(proc.communicate, timeout=600)
    assert proc.returncode == 0, out[-4000:]
    s = summary(tmp_path, run)
    assert s["steps"] == steps and list(s["restarts"]) == ["algorithm-rae"], s["restarts"]

    with EmbeddedServer(tmp_path / run / "nats") as server:
        events = await all_events(server.url, run)
    traces = {e.trace.rollout_id: e.trace for e in events if isinstance(e, TraceCompleted)}
    batches = [e for e in events if isinstance(e, BatchAssembled)]
    assert len(batches) == steps
    for b in batches:
        assert len(b.samples) == 16
        for sample in b.samples:
            trace = traces[sample.rollout_id]
            assert sample.member == trace.seat and trace.member_models[trace.seat] == "policy"
    groups: dict[str, list[str | None]] = {}
    for t in traces.values():
        groups.setdefault(t.group_id, []).append(t.seat)
    # the learner sits in each seat twice in every group of 4
    assert all(sorted(g) == ["debater_a"] * 2 + ["debater_b"] * 2 for g in groups.values())
    # the opponent's turns: weights up to the pinned version, never later ones
    opponent = [
        m.policy_version
        for t in traces.values()
        for m in t.messages
        if m.role == "assistant" and m.model == "opponent"
    ]
    assert opponent and max(v or 0 for v in opponent) == PIN
    assert all(
        m.model == "teacher" for t in traces.values() for m in t.messages if m.member == "judge"
    )
    evals = {
        e.step: e.values for e in events if isinstance(e, MetricsReported) and e.role == "eval"
    }
    assert sorted(evals) == [0, 5, 10, steps]  # every 5 steps, and the last
    assert all(0.0 <= v["debate/win_rate"] <= 1.0 for v in evals.values()), evals

    r = rlbus(tmp_path, "replay", run, "algorithm", "rae")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "MATCH rae" in r.stdout and " 0 changed" in r.stdout
