"""The monitor's feed: scalar names are the lake's, a sink gets the run's config once,
and a restarted feed goes on after the last sequence its sink recorded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from roles.monitor.feed import MetricFeed, SinkPosition, scalar_values
from roles.monitor.sinks import flat_config, wandb_id
from schemas import MetricsReported, RunStopped, run_stopped_id


class Recording:
    name = "recording"

    def __init__(self) -> None:
        self.configs: list[dict[str, Any] | None] = []
        self.points: list[tuple[int, dict[str, float]]] = []
        self.closed = False

    def start(self, config: dict[str, Any] | None) -> None:
        self.configs.append(config)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.points.append((step, values))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def metrics(role: str, step: int, **values: float) -> MetricsReported:
    return MetricsReported(run="r", role=role, step=step, values=values)


LOG = [
    metrics("algorithm-grpo", 0, groups_scored=0.0),
    metrics("trainer", 1, loss=0.5),
    RunStopped(run="r", event_id=run_stopped_id("r"), reason="max_steps", step=2),
    metrics("eval", 2, **{"reverse-text/avg@4": 0.25}),
]


def test_scalar_names_are_role_slash_metric() -> None:
    event = metrics("eval", 3, **{"reverse-text/avg@4": 0.5, "reverse-text/pass@4": 1.0})
    assert scalar_values(event) == {"eval/reverse-text/avg@4": 0.5, "eval/reverse-text/pass@4": 1.0}


def test_a_fresh_feed_writes_every_metric_with_the_config(tmp_path: Path) -> None:
    sink = Recording()
    feed = MetricFeed(sink, SinkPosition(tmp_path / "pos.json", "r"), {"max_steps": 2})
    for seq, event in enumerate(LOG, 1):
        feed.apply(event, seq)
    feed.close()
    assert sink.configs == [{"max_steps": 2}]
    assert [step for step, _ in sink.points] == [0, 1, 2]
    assert sink.points[1] == (1, {"trainer/loss": 0.5})
    assert sink.closed and feed.delivered == 3
    assert SinkPosition(tmp_path / "pos.json", "r").read() == 4


def test_a_restarted_feed_writes_nothing_twice(tmp_path: Path) -> None:
    position = SinkPosition(tmp_path / "pos.json", "r")
    first = MetricFeed(Recording(), position, {"max_steps": 2})
    for seq, event in enumerate(LOG[:2], 1):
        first.apply(event, seq)
    first.checkpoint()  # then the process dies
    sink = Recording()
    second = MetricFeed(sink, position, {"max_steps": 2})
    assert second.from_seq == 3
    for seq, event in enumerate(LOG, 1):  # a follower from from_seq; replays are skipped too
        second.apply(event, seq)
    assert sink.configs == [None]  # the first start recorded the config
    assert [step for step, _ in sink.points] == [2]


def test_a_position_of_another_run_is_ignored(tmp_path: Path) -> None:
    SinkPosition(tmp_path / "pos.json", "other").write(50)
    assert SinkPosition(tmp_path / "pos.json", "r").read() == 0


def test_flat_config_and_wandb_ids() -> None:
    flat = flat_config({"trainer": {"lr": 0.1, "betas": [0.9, 0.99]}, "run": None, "seed": 3})
    assert flat == {"trainer.lr": 0.1, "trainer.betas": "[0.9, 0.99]", "run": "null", "seed": 3}
    assert wandb_id("run-2026.11/x") == "run-2026-11-x"
