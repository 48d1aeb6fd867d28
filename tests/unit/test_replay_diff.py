"""The replay diff helpers: exact float compare, first differing step/metric, digests."""

from __future__ import annotations

import io

from rich.console import Console

from replay.diff import (
    DIGEST,
    STORED_DIGEST,
    StepRecord,
    diff_step,
    diff_values,
    first_divergence,
    first_series_divergence,
    is_timing,
    print_verdict,
    same_float,
)


def steps(*records: tuple[int, dict[str, float], str | None]) -> dict[int, StepRecord]:
    return {s: StepRecord(s, m, d) for s, m, d in records}


def test_same_float_is_bit_for_bit() -> None:
    """Floats are compared by their bits: no tolerance, NaN reproduces NaN, -0.0 is not 0.0."""
    assert same_float(0.25, 0.25)
    assert not same_float(0.1 + 0.2, 0.3)
    assert not same_float(1.0, 1.0 + 2**-52)
    assert same_float(float("nan"), float("nan"))
    assert not same_float(-0.0, 0.0)
    assert not same_float(1.0, None) and same_float(None, None)


def test_timing_metrics_are_never_compared() -> None:
    """Wall-clock metrics differ on every run; a replay must not fail on them."""
    assert is_timing("step_s") and is_timing("tokens_per_s") and is_timing("wait_s")
    assert not is_timing("loss") and not is_timing("grad_norm") and not is_timing("masked_fraction")
    rec = StepRecord(1, {"loss": 1.5, "step_s": 0.2, "tokens_per_s": 900.0}, "sha256:a")
    rep = StepRecord(1, {"loss": 1.5, "step_s": 0.9, "tokens_per_s": 100.0}, "sha256:a")
    assert diff_step(rec, rep) == []


def test_first_divergence_names_the_first_step_and_metric() -> None:
    """Later differences are consequences: the report is the first differing step, with values."""
    recorded = steps(
        (1, {"loss": 1.0, "entropy": 2.0}, "sha256:a"),
        (2, {"loss": 0.5, "entropy": 1.9}, "sha256:b"),
        (3, {"loss": 0.25, "entropy": 1.8}, "sha256:c"),
    )
    replayed = [
        StepRecord(1, {"loss": 1.0, "entropy": 2.0}, "sha256:a"),
        StepRecord(2, {"loss": 0.5, "entropy": 1.9000000000000001}, "sha256:x"),
        StepRecord(3, {"loss": 0.3, "entropy": 1.7}, "sha256:y"),
    ]
    found = first_divergence(recorded, replayed)
    assert found is not None
    assert [(m.step, m.name) for m in found] == [(2, "entropy"), (2, DIGEST)]
    assert found[0].recorded == 1.9 and found[0].replayed == 1.9000000000000001
    text = found[0].describe()
    assert "step 2" in text and "entropy" in text and "1.9000000000000001" in text
    assert "sha256:b" in found[1].describe() and "sha256:x" in found[1].describe()


def test_digest_alone_diverges_and_matching_run_is_none() -> None:
    """Equal metrics with different weights are a divergence; an exact replay reports none."""
    recorded = steps((1, {"loss": 1.0}, "sha256:a"))
    assert first_divergence(recorded, [StepRecord(1, {"loss": 1.0}, "sha256:a")]) is None
    (m,) = first_divergence(recorded, [StepRecord(1, {"loss": 1.0}, "sha256:b")]) or []
    assert (m.step, m.name, m.recorded, m.replayed) == (1, DIGEST, "sha256:a", "sha256:b")


def test_the_stored_bytes_of_a_device_version_are_compared_too() -> None:
    """A version announced with a device digest and stored after it (weights.stored): the
    replayed bytes' digest must equal the stored one as well."""
    rec = StepRecord(1, {"loss": 1.0}, "dev:float32:a", "sha256:s")
    assert diff_step(rec, StepRecord(1, {"loss": 1.0}, "dev:float32:a", "sha256:s")) == []
    (m,) = diff_step(rec, StepRecord(1, {"loss": 1.0}, "dev:float32:a", "sha256:t"))
    assert m.name == STORED_DIGEST and "stored weights' digest differs" in m.describe()


def test_missing_metric_or_step_is_a_mismatch_but_new_metrics_are_not() -> None:
    """A recorded metric the replay lost, or an unrecorded step, cannot be vouched for."""
    recorded = steps((1, {"loss": 1.0, "kl": 0.0}, None))
    (m,) = diff_step(recorded[1], StepRecord(1, {"loss": 1.0, "new_metric": 3.0}, "sha256:z"))
    assert (m.name, m.recorded, m.replayed) == ("kl", 0.0, None)
    (gap,) = first_divergence(recorded, [StepRecord(2, {"loss": 1.0}, None)]) or []
    assert gap.step == 2


def test_fork_divergence_can_be_asked_per_metric() -> None:
    """A fork's lr differs at once while its loss only moves one step later."""
    original = steps(
        (3, {"loss": 1.0, "lr": 0.1}, "sha256:a"), (4, {"loss": 0.5, "lr": 0.1}, "sha256:b")
    )
    fork = [StepRecord(3, {"loss": 1.0, "lr": 0.2}, "sha256:c"), StepRecord(4, {"loss": 0.4, "lr": 0.2}, "sha256:d")]  # fmt: skip
    anything = first_series_divergence(original, fork)
    loss = first_series_divergence(original, fork, "loss")
    assert anything is not None and anything[0].step == 3 and anything[0].name == "lr"
    assert loss is not None and [(m.step, m.name) for m in loss] == [(4, "loss")]
    assert first_series_divergence(original, fork[:1], "loss") is None


def test_diff_values_reports_changes_and_missing_keys() -> None:
    """Keyed floats: exact changes with the largest difference, and keys on one side only."""
    d = diff_values({"a": 1.0, "b": 0.5, "c": 2.0}, {"a": 1.0, "b": 0.75, "d": 0.0})
    assert not d.ok and d.compared == 2
    assert d.changed == [("b", 0.5, 0.75)] and d.max_abs_diff == 0.25
    assert d.only_recorded == ["c"] and d.only_replayed == ["d"]
    lines = d.summary("rewards")
    assert lines[0].startswith("2 rewards compared, 1 changed") and any("b:" in x for x in lines)
    assert diff_values({"a": 0.1 + 0.2}, {"a": 0.3}).changed, "no tolerance"
    assert diff_values({"a": 1.0}, {"a": 1.0}).ok


def test_verdict_exit_codes() -> None:
    """0 when reproduced, 1 on divergence (naming the step), 2 when nothing was replayed."""
    out = io.StringIO()
    console = Console(file=out, width=200)
    rec = StepRecord(2, {"loss": 1.0}, "sha256:f")
    assert print_verdict(console, [rec], None) == 0 and "REPRODUCED" in out.getvalue()
    mismatch = diff_step(StepRecord(2, {"loss": 2.0}, "sha256:f"), rec)
    assert print_verdict(console, [rec], mismatch) == 1
    assert "DIVERGED at step 2" in out.getvalue()
    assert print_verdict(console, [], None) == 2
