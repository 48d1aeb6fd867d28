"""Events in, scalars out: the one mapping from a run's log to a metric sink.

    feed = MetricFeed(sink, SinkPosition(path, run), config)   # config: the run's, as a dict
    feed.apply(event, seq)          # a metrics event -> scalars; anything else is stepped over
    feed.close()                    # flush, record the position, close the sink

A scalar's name is ``<role>/<metric>``, the lake's ``metrics`` table's ``role`` and
``metric`` columns (``trainer/loss``, ``orchestrator/reward_mean``, per env
``eval/reverse-text/avg@4``, ``env-reverse-text/...``), and its step is the event's
``step``: the trainer step (eval: the policy version, which is the trainer step that
produced it). A feed remembers the last stream sequence its sink has written in
``SinkPosition`` (a small JSON file in the sink's directory), so a restarted monitor goes
on where the last one stopped instead of writing every point twice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from schemas import MetricsReported


class Sink(Protocol):
    """Where scalars go. ``start`` comes once before the first scalar: with the run's
    resolved config, or ``None`` when the sink resumes (it has the config already)."""

    name: str

    def start(self, config: dict[str, Any] | None) -> None: ...

    def scalars(self, step: int, values: dict[str, float]) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


@dataclass
class SinkPosition:
    """The last stream sequence a sink has written, kept beside its output."""

    path: Path
    run: str

    def read(self) -> int:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return 0
        return int(data.get("seq", 0)) if data.get("run") == self.run else 0

    def write(self, seq: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"run": self.run, "seq": seq}))
        tmp.replace(self.path)


def scalar_values(event: MetricsReported) -> dict[str, float]:
    """``<role>/<metric>`` -> value, the names of the lake's ``metrics`` table."""
    return {f"{event.role}/{k}": float(v) for k, v in sorted(event.values.items())}


class MetricFeed:
    """Delivers a run's metrics to one sink, in log order, from where it left off. The
    sink starts at the first scalar, with the run's config when it starts from the
    beginning (roles report metrics before the orchestrator publishes ``run.started``,
    so the config is given, not waited for)."""

    def __init__(self, sink: Sink, position: SinkPosition, config: dict[str, Any] | None):
        self.sink = sink
        self.position = position
        self.seq = position.read()
        self.config = config if self.seq == 0 else None  # a resumed sink has it already
        self.started = False
        self.delivered = 0  # metrics events written by this feed

    @property
    def from_seq(self) -> int:
        return self.seq + 1

    def apply(self, event: Any, seq: int) -> None:
        if seq <= self.seq:
            return
        if isinstance(event, MetricsReported):
            if not self.started:
                self.started = True
                self.sink.start(self.config)
            self.sink.scalars(event.step, scalar_values(event))
            self.delivered += 1
        self.seq = seq

    def checkpoint(self) -> None:
        """Flush the sink, then record how far it got."""
        if self.started:
            self.sink.flush()
        self.position.write(self.seq)

    def close(self) -> None:
        self.checkpoint()
        if self.started:
            self.sink.close()
