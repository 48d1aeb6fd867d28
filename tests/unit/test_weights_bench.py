"""benchmarks.weights_bench's log parsing: swaps counted, each replica's first left out."""

import json

import pytest

from benchmarks.weights_bench import percentile, swap_stats


def swapped(version: int, lag: float, *, instance: str = "policy-0", via: str = "ipc") -> str:
    return json.dumps(
        {
            "run": "r",
            "instance": instance,
            "event": "weights.swapped",
            "version": version,
            "via": via,
            "bytes": 1000,
            "load_s": lag / 2,
            "lag_s": lag,
            "pause_s": lag / 10,
            "pin_held_s": 0.0,
        }  # fmt: skip
    )


def test_stats_skip_each_replicas_first_swap() -> None:
    lines = [
        swapped(1, 9.0),  # warm-up: counted, not measured
        "not json",
        json.dumps({"event": "weights.published", "version": 2}),
        swapped(2, 0.1),
        swapped(3, 0.3, via="object"),
        swapped(4, 0.2),
        swapped(1, 7.0, instance="policy-1"),  # the second replica's warm-up
        swapped(2, 0.4, instance="policy-1"),
    ]
    s = swap_stats(lines)
    assert s["swaps"] == 6 and s["measured"] == 4
    assert s["via_counts"] == {"ipc": 5, "object": 1}
    assert s["lag_s_median"] == pytest.approx(0.25)
    assert s["lag_s_max"] == pytest.approx(0.4)
    assert 0.3 < s["lag_s_p99"] <= 0.4
    assert s["pause_s_max"] == pytest.approx(0.04)
    assert s["load_s_median"] == pytest.approx(0.125)
    assert s["bytes"] == 1000


def test_only_warm_up_swaps_give_counts_alone() -> None:
    assert swap_stats([swapped(1, 1.0)]) == {"swaps": 1, "measured": 0, "via_counts": {"ipc": 1}}
    assert swap_stats([]) == {"swaps": 0, "measured": 0, "via_counts": {}}


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 50) == 3.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    assert percentile([2.0], 99) == 2.0
