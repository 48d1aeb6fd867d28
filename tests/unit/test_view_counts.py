"""The launcher's view of rollouts that cannot train, stalls and a start (issue 31, items
6 and 11): errored and filtered counts beside a rate of rollouts that can train, one
console line per stall and for the stop, roles starting, honest sparklines."""

from __future__ import annotations

from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path

from rich.console import Console

from roles.up.monitor import RunMonitor, score_sparkline, sparkline
from roles.up.supervisor import BeatWatch, stopped_line
from roles.up.view import LiveView
from schemas import RoleHeartbeat, RunStarted, RunStopped, run_started_id, run_stopped_id
from tests.unit.test_monitor_view import FakeRole

ERRORING = "internal: IndexError('list index out of range')"


def beat_info(trainable: int, errored: int, filtered: int = 0, **extra: str) -> dict[str, str]:
    return {
        "trainable_rollouts": str(trainable),
        "errored_rollouts": str(errored),
        "filtered_rollouts": str(filtered),
    } | extra


def erroring_monitor() -> RunMonitor:
    """A run like issue 31's item 1: rollouts complete fast, every one errors."""
    m = RunMonitor(run="r", max_steps=10)
    m.apply(RunStarted(run="r", event_id=run_started_id("r"), config={}, seed=0, model_path="m"))
    for i in range(5):
        m.trace_completed(100)
        m.orchestrator_beat(beat_info(0, 100 * (i + 1), erroring=ERRORING), now=float(i))
    return m


def rendered(view: LiveView) -> str:
    console = Console(file=StringIO(), width=160)
    console.print(view.render())
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_errored_rollouts_are_shown_and_not_counted_as_throughput(tmp_path: Path) -> None:
    """500 rollouts that all errored: the rate is 0, the live view and the final report
    say 500 errored beside it (item 1's report said "253.9 train rollouts/s")."""
    m = erroring_monitor()
    assert m.rollouts == 500 and m.rollouts_per_s() == 0.0 and m.mean_rollouts_per_s() == 0.0
    text = rendered(LiveView(m, [], enabled=False))
    assert "500 train, 0.0/s that can train" in text and "500 errored, 0 filtered" in text
    assert ERRORING in text
    summary = m.summary()
    assert summary["errored_rollouts"] == 500 and summary["trainable_rollouts"] == 0
    report = LiveView(m, [], enabled=False).final_report(summary, tmp_path / "s.json", None)
    assert "0.0 train rollouts/s (500 errored, 0 filtered: not in the rate)" in report


def test_the_rate_counts_rollouts_that_can_train() -> None:
    m = RunMonitor(run="r", max_steps=10)
    m.trace_completed(10)  # first rollout at some monotonic time
    m.first_rollout_at = 0.0
    m.orchestrator_beat(beat_info(0, 0), now=0.0)
    m.orchestrator_beat(beat_info(30, 50, 20), now=10.0)
    assert m.mean_rollouts_per_s() == 3.0
    assert (m.trainable, m.errored, m.filtered) == (30, 50, 20)


def test_counts_unknown_until_the_orchestrator_beats() -> None:
    """Before its first beat the rate counts every completed rollout, as before."""
    m = RunMonitor(run="r", max_steps=10)
    m.trace_completed(4)
    assert m.summary()["errored_rollouts"] is None
    text = rendered(LiveView(m, [], enabled=False))
    assert "errored" not in text and "4 train" in text
    m.orchestrator_beat({"trainable_rollouts": "x", "errored_rollouts": "1"})  # unreadable
    assert m.trainable is None


def test_a_stall_and_its_end_from_the_beat() -> None:
    m = RunMonitor(run="r", max_steps=10)
    m.orchestrator_beat(beat_info(1, 0, stalled_s="31", waiting_for="samples: 0 of 8"))
    assert m.stall == "no batch for 31 s; waiting for: samples: 0 of 8"
    assert "stalled" in rendered(LiveView(m, [], enabled=False))
    m.orchestrator_beat(beat_info(2, 0))
    assert m.stall == ""


def test_the_view_is_not_blank_at_start() -> None:
    """Before any heartbeat: roles read "starting" and the phase says what it waits for."""
    roles = [FakeRole("orchestrator"), FakeRole("trainer")]
    view = LiveView(RunMonitor(run="r", max_steps=3), roles, enabled=False)
    view.beating = set()  # the registry read: nobody beats yet
    assert view.phase_text() == "starting: roles loading, waiting for the first heartbeat"
    assert rendered(view).count("starting") == 3
    view.beating = {"trainer"}
    assert view.phase_text() == "starting: 1 of 2 roles beating"
    text = rendered(view)
    assert "running" in text and text.count("starting") == 2


def test_score_sparklines_use_a_fixed_scale() -> None:
    """0.000 -> 0.016 is two low bars, not a leap to the top (item 11)."""
    assert score_sparkline([0.0, 0.016]) == "▁▁"
    assert score_sparkline([0.0, 0.5, 1.0]) == "▁▄█"
    assert score_sparkline([-2.0, 2.0]) == sparkline([-2.0, 2.0]) == "▁█"  # not in 0..1


def test_the_stop_line_is_one_line() -> None:
    stopped = RunStopped(
        run="r", event_id=run_stopped_id("r"), reason="rollout_errors", detail="a\nb"
    )
    assert stopped_line(stopped) == "run stopped: rollout_errors: a b"


@dataclass
class FakeBus:
    beats: list[RoleHeartbeat] = field(default_factory=list)

    async def live_roles(self) -> list[RoleHeartbeat]:
        return self.beats


class FakeLog:
    def __init__(self) -> None:
        self.warnings: list[str] = []

    def warning(self, event: str, **kw: object) -> None:
        self.warnings.append(event)


def orchestrator_beat(info: dict[str, str], seen: int) -> RoleHeartbeat:
    return RoleHeartbeat(
        run="r", role="orchestrator", instance="orchestrator-h-1", host="h", pid=1,
        started_ns=0, last_seen_ns=seen, info=info,
    )  # fmt: skip


async def test_a_stall_is_said_once_on_the_console(capsys) -> None:  # noqa: ANN001
    """`--no-view`: one `[rlbus] run stalled` line per stall, not one per beat."""
    m = RunMonitor(run="r", max_steps=10)
    bus, log = FakeBus(), FakeLog()
    watch = BeatWatch(bus, m, LiveView(m, [], enabled=False), log, [])  # type: ignore[arg-type]
    stalled = beat_info(0, 8, stalled_s="40", waiting_for="samples: 0 of 8 for step 1")
    for i, info in enumerate([beat_info(0, 0), stalled, stalled, beat_info(1, 8), stalled]):
        bus.beats = [orchestrator_beat(info, i)]
        await watch.check()
    out = capsys.readouterr().out
    line = "[rlbus] run stalled: no batch for 40 s; waiting for: samples: 0 of 8 for step 1"
    assert out.count(line) == 2 and log.warnings == ["run.stalled", "run.stalled"]
    assert m.errored == 8 and m.trainable == 1
