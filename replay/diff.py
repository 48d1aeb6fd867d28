"""Comparing a replay with its recording: exact, first-difference-first, and readable.

Replay is a debugging tool, so the only useful answer to "does it reproduce?" is *the
first place it does not*: later differences are consequences of the first. Everything
here is pure (no NATS, no torch) and shared by the replay drivers:

- ``same_float``: bit-for-bit float equality (``0.1 + 0.2 != 0.3`` and ``-0.0 != 0.0``;
  a NaN equals a NaN with the same bits: a recorded NaN reproduced is a match);
- ``StepRecord`` / ``diff_step`` / ``first_divergence``: per-step metrics and weights
  digest of a trainer, recorded vs replayed; timing metrics (``step_s``,
  ``tokens_per_s``, ``wait_s``, ``mfu``, anything ending in ``_s``) are never compared;
- ``diff_values``: keyed floats (advantages per rollout, rewards per trace) compared
  exactly, with a summary (how many changed, the largest absolute difference);
- ``first_series_divergence``: where two per-step series (an original run and its
  fork) part.

    report = first_divergence(recorded, replayed)
    print("match" if report is None else report.describe())
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Metrics that measure the clock, not the computation: never reproducible.
TIMING_METRICS = frozenset({"step_s", "tokens_per_s", "wait_s", "mfu"})
DIGEST = "weights_digest"  # the pseudo-metric name a digest mismatch is reported under
STORED_DIGEST = "stored_digest"  # the same, of the bytes a weights.stored names


def is_timing(name: str) -> bool:
    """Wall-clock metrics (seconds, rates) that a replay cannot and need not reproduce."""
    return name in TIMING_METRICS or name.endswith("_s") or name.endswith("_per_s")


def same_float(a: float | None, b: float | None) -> bool:
    """Bit-for-bit equality of two doubles (None only equals None)."""
    if a is None or b is None:
        return a is b
    return struct.pack("<d", float(a)) == struct.pack("<d", float(b))


def fmt_float(x: float | None) -> str:
    """A float with every digit that matters (repr), so two different values never print equal."""
    return "-" if x is None else repr(float(x))


@dataclass(frozen=True)
class StepRecord:
    """What one trainer step produced: its metrics and the digest of the weights after it
    (as announced: of the bytes, or of the device copy), and, for a version announced on
    the device and stored after it (``weights.stored``), the digest of those bytes."""

    step: int
    metrics: Mapping[str, float]
    digest: str | None = None
    stored_digest: str | None = None


@dataclass(frozen=True)
class Mismatch:
    """One value that differs: at ``step`` (or ``key``), recorded vs replayed."""

    step: int
    name: str  # metric name, or DIGEST
    recorded: float | str | None
    replayed: float | str | None

    def describe(self) -> str:
        if self.name in (DIGEST, STORED_DIGEST):
            what = "weights digest" if self.name == DIGEST else "stored weights' digest"
            return (
                f"step {self.step}: {what} differs: recorded {self.recorded}, "
                f"replayed {self.replayed}"
            )
        rec = self.recorded if isinstance(self.recorded, str) else fmt_float(self.recorded)
        rep = self.replayed if isinstance(self.replayed, str) else fmt_float(self.replayed)
        diff = ""
        if isinstance(self.recorded, float) and isinstance(self.replayed, float):
            diff = f" (diff {self.replayed - self.recorded:+.3e})"
        return f"step {self.step}: {self.name} differs: recorded {rec}, replayed {rep}{diff}"


# Metrics a newer trainer reports under another name (old name -> new name).
RENAMED = {"sft_tokens": "ce_tokens"}


def diff_step(recorded: StepRecord, replayed: StepRecord) -> list[Mismatch]:
    """Every deterministic difference of one step: metrics in recorded order, then the digest.

    Only metrics the recording has are compared (a newer trainer may report more); a
    recorded metric the replay lacks is a mismatch. A step recorded without a digest
    (its ``weights.published`` is missing) has nothing to compare it to.
    """
    out = []
    for name, value in recorded.metrics.items():
        if is_timing(name):
            continue
        other = replayed.metrics.get(RENAMED.get(name, name))
        if not same_float(value, other):
            out.append(Mismatch(recorded.step, name, float(value), other))
    if recorded.digest is not None and recorded.digest != replayed.digest:
        out.append(Mismatch(recorded.step, DIGEST, recorded.digest, replayed.digest))
    if recorded.stored_digest is not None and recorded.stored_digest != replayed.stored_digest:
        out.append(
            Mismatch(recorded.step, STORED_DIGEST, recorded.stored_digest, replayed.stored_digest)
        )
    return out


def first_divergence(
    recorded: Mapping[int, StepRecord], replayed: Sequence[StepRecord]
) -> list[Mismatch] | None:
    """The mismatches of the first replayed step that differs from its recording, or None.

    A replayed step with no recording at all is a divergence too (the log has a batch the
    trainer never announced: the replay cannot vouch for it).
    """
    for rep in replayed:
        rec = recorded.get(rep.step)
        if rec is None:
            return [Mismatch(rep.step, "recorded step", "missing", "replayed")]
        found = diff_step(rec, rep)
        if found:
            return found
    return None


def first_series_divergence(
    original: Mapping[int, StepRecord], fork: Sequence[StepRecord], metric: str | None = None
) -> list[Mismatch] | None:
    """Where a fork first differs from its original: in ``metric`` only, or in anything."""
    for rep in fork:
        rec = original.get(rep.step)
        if rec is None:
            return None  # past the end of the original: nothing left to compare
        found = diff_step(rec, rep)
        if metric is not None:
            found = [m for m in found if m.name == metric]
        if found:
            return found
    return None


@dataclass
class ValueDiff:
    """Keyed floats compared exactly: what changed, what is missing on either side."""

    compared: int = 0
    changed: list[tuple[str, float, float]] = field(default_factory=list)  # key, recorded, new
    only_recorded: list[str] = field(default_factory=list)
    only_replayed: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.changed or self.only_recorded or self.only_replayed)

    @property
    def max_abs_diff(self) -> float:
        return max((abs(new - old) for _, old, new in self.changed), default=0.0)

    def merge(self, other: ValueDiff) -> ValueDiff:
        self.compared += other.compared
        self.changed += other.changed
        self.only_recorded += other.only_recorded
        self.only_replayed += other.only_replayed
        return self

    def summary(self, what: str = "values", examples: int = 5) -> list[str]:
        lines = [
            f"{self.compared} {what} compared, {len(self.changed)} changed"
            + (f" (max abs diff {self.max_abs_diff:.6g})" if self.changed else "")
        ]
        for key, old, new in self.changed[:examples]:
            lines.append(f"  {key}: recorded {fmt_float(old)}, now {fmt_float(new)}")
        if len(self.changed) > examples:
            lines.append(f"  ... and {len(self.changed) - examples} more")
        if self.only_recorded:
            lines.append(
                f"  {len(self.only_recorded)} recorded but not recomputed, e.g. {self.only_recorded[0]}"
            )
        if self.only_replayed:
            lines.append(
                f"  {len(self.only_replayed)} recomputed but not recorded, e.g. {self.only_replayed[0]}"
            )
        return lines


def diff_values(recorded: Mapping[str, float], replayed: Mapping[str, float]) -> ValueDiff:
    """Compare two keyed float maps bit for bit (keys in recorded order)."""
    out = ValueDiff()
    for key, old in recorded.items():
        if key not in replayed:
            out.only_recorded.append(key)
            continue
        out.compared += 1
        new = replayed[key]
        if not same_float(old, new):
            out.changed.append((key, float(old), float(new)))
    out.only_replayed = [k for k in replayed if k not in recorded]
    return out


# -- reports (rich) -----------------------------------------------------------------------


def step_printer(console: Any, recorded: Mapping[int, StepRecord], fork: bool = False) -> Any:
    """An ``on_step`` callback: a line per step when the run has at most 50 recorded
    steps, past that only for steps that differ (the command's progress bar shows the
    rest). A fork's steps are marked against the original instead of judged."""
    every = fork or len(recorded) <= 50

    def on_step(rec: StepRecord, mismatches: list[Mismatch]) -> None:
        if not (every or mismatches):
            return
        mark = "[green]ok[/]" if not mismatches else "[red]DIFF[/]"
        if fork:
            same = rec.step in recorded and not diff_step(recorded[rec.step], rec)
            mark = "[yellow]fork[/] " + ("(same as original)" if same else "(differs)")
        loss, gn = rec.metrics.get("loss", math.nan), rec.metrics.get("grad_norm", math.nan)
        stored = f"  stored {rec.stored_digest[:19]}" if rec.stored_digest else ""
        console.print(f"step {rec.step:>5}  loss {loss:+.6f}  grad_norm {gn:.6f}  {(rec.digest or '')[:23]}{stored}  {mark}")  # fmt: skip

    return on_step


def print_verdict(console: Any, steps: Sequence[StepRecord], divergence: list[Mismatch] | None,
                  stopped: str = "", wall_s: float = 0.0) -> int:  # fmt: skip
    """The final word of a replay; returns the exit code (0 reproduced, 1 diverged, 2 empty)."""
    if stopped:
        console.print(f"[yellow]note:[/] {stopped}")
    if divergence:
        first = divergence[0]
        console.print(
            f"[red bold]DIVERGED[/] at step {first.step} (first difference: {first.name})"
        )
        for m in divergence:
            console.print("  " + m.describe())
        return 1
    if not steps:
        console.print("nothing replayed")
        return 2
    last = steps[-1]
    console.print(
        f"[green bold]REPRODUCED[/] {len(steps)} steps: every deterministic metric and weights "
        f"digest matches bit for bit; final digest {last.digest} (step {last.step}, {wall_s:.2f}s)"
    )
    return 0
