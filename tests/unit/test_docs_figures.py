"""The README's and the docs' figures of a default run are what `just docs-figures` last
measured (benchmarks/docs_figures.py): no quoted figure drifts from the latest run."""

from __future__ import annotations

import pytest

from benchmarks import docs_figures as df


def test_every_figure_region_holds_the_latest_measured_run() -> None:
    history = df.load_history()
    assert history, "benchmarks/results/docs_figures.json: run `just docs-figures`"
    figures = df.render(history)
    seen = set()
    for doc in df.DOCUMENTS:
        for name, bodies in df.regions((df.ROOT / doc).read_text()).items():
            seen.add(name)
            assert bodies == [figures[name]] * len(bodies), f"{doc}: figure {name}"
    assert seen == set(figures), "a figure no document quotes, or a region nothing fills"


def _record(run: str, final: float, wall: float) -> dict[str, object]:
    return {
        "run": run, "wall_s": wall, "steps": 500, "warmup_steps": 120, "eval_key": "e/avg@4",
        "eval_k": 4, "eval_tasks": 64, "eval_start": [0.04, 0.01],
        "eval_after_warm_start": [0.36, 0.015], "eval_final": [final, 0.015],
        "run_dir_mb": 180, "filtered_pct": 2.04,
    }  # fmt: skip


def test_render_quotes_the_latest_run_and_the_range_of_the_history() -> None:
    figures = df.render([_record("a", 0.40, 150.0), _record("b", 0.456, 200.0)])
    assert "0.456 ± 0.015 after 380 GRPO steps in the latest run" in figures["default_run_eval"]
    assert "final score ranged 0.400–0.456" in figures["default_run_eval"]
    assert figures["default_run_wall"] == "~2.5–3.3 minutes"
    assert figures["filtered_pct"] == "2.0%"
    assert figures["run_dir_mb"] == "~180 MB"


def test_rewrite_fills_known_regions_and_refuses_unknown_ones() -> None:
    text = "size <!-- figure:run_dir_mb -->~1 MB<!-- /figure --> end"
    assert df.rewrite(text, {"run_dir_mb": "~180 MB"}) == text.replace("~1 MB", "~180 MB")
    with pytest.raises(KeyError, match="no figure named 'run_dir_mb'"):
        df.rewrite(text, {"other": "x"}, "README.md")
