"""Orchestrator replay: re-make every decision of a recorded run and diff it with the log.

    rlbus replay <run> orchestrator

The orchestrator is a pure transition (``roles.orchestrator.core.OrchestratorCore``):
the same inputs in the same order give the same decisions with the same ids. Replay
reads what the orchestrator's follower reads (``core.INPUTS``, from sequence 1), steps
every input through a fresh core built from the config in force at the log's end (what
a restarted orchestrator is built from), and compares:

- **decisions**: every task request, batch, eval report, stop and per-batch metrics it
  re-makes with the recorded event of the same type and id, field by field (all but the
  producer's clock ``ts_ns`` and name ``producer``);
- **refusals**: every input it refuses (``Transition.rejected``), and every input the
  reader cannot decode, with the orchestrator's dead letters (``dead_lettered.orchestrator``,
  by the refused message's sequence), and the reason with the recorded error.

A recorded decision the core does not re-make cannot pass unnoticed: read back as an
input, it is refused as "not the orchestrator's" and has no dead letter. Inputs after
the last one the run's orchestrator is known to have acted on (the newest cause of a
recorded decision or dead letter) may never have been read by it (it stopped first):
what they cause is counted in ``tail``, not as a difference. Events the watch published
on the clock (deadline releases, a stall stop) are inputs here, as on a restart.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from bus.reader import LogReader, Progress
from bus.runtime import Bus
from bus.subjects import Topic, filter_subject
from configs import RunConfig, resolve
from schemas import DeadLettered, Event, RunStarted

if TYPE_CHECKING:
    from roles.orchestrator.core import Transition

Key = tuple[str, str]  # (event type, event id)
UNCOMPARED = ("ts_ns", "producer")  # the producer's clock and name: not decisions
# Fields added since a log may have been written: a recorded None is "not recorded yet"
ADDED = ("number",)  # TaskRequested.number (the group counter)


def key(event: Event) -> Key:
    return type(event).__name__, event.event_id


@dataclass
class OrchestratorLog:
    cfg: RunConfig  # the config in force at the log's end, run set
    inputs: list[tuple[int, Event]]  # what the orchestrator's follower reads, in order
    unreadable: dict[int, str] = field(default_factory=dict)  # input seq -> why undecodable
    recorded: dict[Key, Event] = field(default_factory=dict)  # every event read, first wins
    dead_letters: dict[int, DeadLettered] = field(default_factory=dict)  # by refused seq


async def read_orchestrator_log(bus: Bus, on_progress: Progress | None = None) -> OrchestratorLog:
    """The orchestrator's inputs, its per-batch metrics and its dead letters, in order."""
    from roles.orchestrator.core import INPUTS

    metrics = filter_subject(bus.run, Topic.METRICS_REPORTED, "orchestrator")
    dead = filter_subject(bus.run, Topic.DEAD_LETTERED, "orchestrator")
    topics = [*INPUTS, (Topic.METRICS_REPORTED, "orchestrator"), (Topic.DEAD_LETTERED, "orchestrator")]  # fmt: skip
    reader = LogReader(bus, topics=topics, idle_timeout_s=10.0, on_progress=on_progress)
    inputs: list[tuple[int, Event]] = []
    recorded: dict[Key, Event] = {}
    dead_letters: dict[int, DeadLettered] = {}
    async for entry in reader.entries():
        e = entry.event
        if entry.subject == dead:
            if isinstance(e, DeadLettered) and e.consumer == "orchestrator":
                dead_letters.setdefault(e.stream_seq, e)
            continue
        recorded.setdefault(key(e), e)
        if entry.subject != metrics:
            inputs.append((entry.seq, e))
    unreadable = {s.seq: s.reason for s in reader.skipped if s.subject not in (metrics, dead)}
    return OrchestratorLog(_config_at_end(bus.run, inputs), inputs, unreadable, recorded, dead_letters)  # fmt: skip


def _config_at_end(run: str, inputs: list[tuple[int, Event]]) -> RunConfig:
    """The config of the run's newest segment start (``core.segment_starts``), as a
    restarted orchestrator takes it."""
    from roles.orchestrator.core import segment_starts

    starts = segment_starts(run, [e for _, e in inputs if isinstance(e, RunStarted)])
    if not starts:
        raise ValueError(f"run {run!r} has no run.started event: nothing to replay")
    cfg = resolve(starts[-1].config, source=f"run.started {starts[-1].event_id} of {run}")
    cfg.run = run
    return cfg


@dataclass
class Redecided:
    made: dict[Key, tuple[int, Event]] = field(default_factory=dict)  # -> (cause seq, event)
    rejected: dict[int, str] = field(default_factory=dict)  # input seq -> why refused
    inputs: int = 0


def redecide(log: OrchestratorLog, on_progress: Progress | None = None) -> Redecided:
    """Step every input through a fresh core; ``on_progress(inputs stepped, inputs)``."""
    from roles.orchestrator.core import OrchestratorCore

    core = OrchestratorCore(log.cfg)
    out = Redecided(inputs=len(log.inputs))
    for done, (seq, event) in enumerate(log.inputs, 1):
        t: Transition = core.step(event)
        if t.rejected is not None:
            out.rejected[seq] = t.rejected
        for e in t.outputs:
            out.made.setdefault(key(e), (seq, e))
        if on_progress is not None:
            on_progress(done, len(log.inputs))
    return out


@dataclass
class OrchestratorDiff:
    compared: Counter[str] = field(default_factory=Counter)  # decisions found, by type
    changed: list[str] = field(default_factory=list)  # "<type> <id>: field, field"
    unrecorded: list[str] = field(default_factory=list)  # re-made, not on the log
    refusals: list[str] = field(default_factory=list)  # refused here xor dead-lettered there
    dead_letters: int = 0  # dead letters matched
    tail: int = 0  # decisions and refusals past the last input the run acted on

    @property
    def ok(self) -> bool:
        return not (self.changed or self.unrecorded or self.refusals)


def diff_decisions(log: OrchestratorLog, redone: Redecided) -> OrchestratorDiff:
    out = OrchestratorDiff()
    acted = [seq for k, (seq, _) in redone.made.items() if k in log.recorded]
    last_read = max([*acted, *log.dead_letters], default=0)
    for k, (seq, new) in redone.made.items():
        old = log.recorded.get(k)
        if old is None:
            if seq > last_read:
                out.tail += 1
            else:
                out.unrecorded.append(f"{k[0]} {k[1]} (caused by seq {seq}): not on the log")
            continue
        out.compared[k[0]] += 1
        fields = differing_fields(old, new)
        if fields:
            out.changed.append(f"{k[0]} {k[1]}: {', '.join(fields)}")
    refused = redone.rejected | log.unreadable
    for seq in sorted(refused.keys() | log.dead_letters.keys()):
        dead, reason = log.dead_letters.get(seq), refused.get(seq)
        if dead is None and reason is not None and seq > last_read:
            out.tail += 1
        elif dead is None:
            out.refusals.append(
                f"seq {seq}: refused here ({reason}), never dead-lettered in the run"
            )
        elif reason is None:
            out.refusals.append(
                f"seq {seq}: dead-lettered in the run ({dead.headline}), folded here"
            )
        elif seq in redone.rejected and dead.error != reason:
            out.refusals.append(f"seq {seq}: refused as {reason!r}, the run said {dead.error!r}")
        else:
            out.dead_letters += 1
    return out


def differing_fields(old: Event, new: Event) -> list[str]:
    """The fields (but ``UNCOMPARED``, and an ``ADDED`` one ``old`` does not record)
    whose encoded values differ."""
    a, b = msgspec.structs.asdict(old), msgspec.structs.asdict(new)
    enc = msgspec.msgpack.encode
    unrecorded = {n for n in ADDED if n in a and a[n] is None}
    names = [n for n in a.keys() | b.keys() if n not in UNCOMPARED and n not in unrecorded]
    return sorted(n for n in names if enc(a.get(n)) != enc(b.get(n)))


def describe(compared: Counter[str]) -> str:
    """``412 TaskRequested, 4 BatchAssembled, ...`` (most first)."""
    return ", ".join(f"{n} {t}" for t, n in compared.most_common()) or "none"
