"""``just docs-figures``: the figures the README and docs quote about a default run,
measured by a run, never typed by hand.

    python -m benchmarks.docs_figures                 # run `rlbus up` (default preset), then write
    python -m benchmarks.docs_figures --from-run R    # the figures of a finished run R

It measures one default run as a new user starts it (`python -m roles.cli up --no-view`,
the launcher's wall time from start to exit), reads what the run left (``summary.json``,
the run directory's size, the lake's share of filtered RL rollouts), appends the record
to the history in ``benchmarks/results/docs_figures.json`` (the last ``HISTORY`` runs: a
figure that varies from run to run is quoted as the latest value and the range), copies
the run's ``curves.png`` to ``docs/img/default_run_curves.png``, and rewrites every
figure region in the README and the docs:

    <!-- figure:run_dir_mb -->~180 MB<!-- /figure -->

``tests/unit/test_docs_figures.py`` checks that every region holds what ``render`` makes
of the committed history, so a quoted figure cannot drift from the latest measured run.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "docs_figures.json"
IMAGE = ROOT / "docs" / "img" / "default_run_curves.png"
DOCUMENTS = ["README.md", "docs/running.md"]
HISTORY = 5
REGION = re.compile(r"<!-- figure:(?P<name>[a-z_]+) -->(?P<body>.*?)<!-- /figure -->", re.S)
FILTERED_SQL = (
    "select round(100 * avg(is_filtered::int), 1) as pct from rollouts where split = 'train' "
    "and group_id in (select group_id from tasks where phase = 'rl')"
)


# -- measuring -------------------------------------------------------------------------


def measure(run: str, data_dir: Path) -> float:
    """Start a default run as a user would and return the launcher's wall seconds."""
    started = time.monotonic()
    cmd = [sys.executable, "-m", "roles.cli", "up", "--no-view", "--run", run]
    cmd += [f"bus.data_dir={data_dir}"]
    print("docs-figures: " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=ROOT, check=False)
    if done.returncode != 0:
        sys.exit(f"docs-figures: the default run {run} failed (exit {done.returncode})")
    return time.monotonic() - started


def record_of(run: str, data_dir: Path, wall_s: float | None) -> dict[str, Any]:
    """The figures of finished run ``run``: from its summary, its directory and its lake."""
    from configs import load_config
    from configs.paths import RunPaths

    paths = RunPaths(data_dir, run)
    summary = json.loads((paths.dir / "summary.json").read_text())
    cfg = load_config(paths.config)
    ev = cfg.orchestrator.eval
    key, points = eval_series(summary)
    warm = summary["warmup_steps"]
    size = sum(f.stat().st_size for f in paths.dir.rglob("*") if f.is_file())
    return {
        "run": run,
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "wall_s": round(wall_s if wall_s is not None else summary["wall_s"], 1),
        "steps": summary["steps"],
        "warmup_steps": warm,
        "eval_key": key,
        "eval_k": ev.k,
        "eval_tasks": ev.num_tasks,
        "eval_start": points.get(0),
        "eval_after_warm_start": points.get(warm),
        "eval_final": points[max(points)] if points else None,
        "run_dir_mb": round(size / 2**20),
        "filtered_pct": filtered_pct(run, data_dir),
    }


def eval_series(summary: Mapping[str, Any]) -> tuple[str, dict[int, list[float]]]:
    """The run's first eval score and its (mean, stderr) at each policy version."""
    evals = {int(v): m for v, m in summary["eval"].items()}
    keys = sorted(k for m in evals.values() for k in m if "@" in k and not k.endswith("_stderr"))
    if not keys:
        sys.exit("docs-figures: the run has no eval scores (orchestrator.eval.interval = 0?)")
    key = keys[0]
    return key, {
        v: [round(m[key], 3), round(m.get(f"{key}_stderr", 0.0), 3)]
        for v, m in sorted(evals.items())
        if key in m
    }


def filtered_pct(run: str, data_dir: Path) -> float:
    """The share (%) of RL rollouts the rollout filters kept out of training (the lake)."""
    cmd = [sys.executable, "-m", "roles.cli", "sql", "--run", run, "--format", "json"]
    cmd += ["--data-dir", str(data_dir), FILTERED_SQL]
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout
    rows = json.loads(out)
    return float(rows[0]["pct"] or 0.0)


# -- rendering (pure) ------------------------------------------------------------------


def _score(point: list[float] | None) -> str:
    return "?" if point is None else f"{point[0]:.3f} ± {point[1]:.3f}"


def _minutes(seconds: list[float]) -> str:
    lo, hi = min(seconds) / 60, max(seconds) / 60
    return f"~{lo:.1f} minutes" if round(lo, 1) == round(hi, 1) else f"~{lo:.1f}–{hi:.1f} minutes"


def render(history: list[dict[str, Any]]) -> dict[str, str]:
    """Every figure region's text, from the measured runs (the latest last)."""
    last = history[-1]
    finals = [r["eval_final"][0] for r in history if r["eval_final"]]
    rl = last["steps"] - last["warmup_steps"]
    spread = (
        f"over the last {len(history)} runs the final score ranged "
        f"{min(finals):.3f}–{max(finals):.3f}"
        if len(finals) > 1
        else "one run measured so far"
    )
    eval_text = (
        f"eval reward (avg@{last['eval_k']} on {last['eval_tasks']} held-out tasks, each eval "
        f"answered by the very version it reports, ± its standard error) "
        f"{_score(last['eval_start'])} at start, {_score(last['eval_after_warm_start'])} after "
        f"the {last['warmup_steps']}-step warm start, {_score(last['eval_final'])} after {rl} "
        f"GRPO steps in the latest run ({spread}; asynchronous rollouts are not ordered the "
        f"same way twice, so it varies from run to run)"
    )
    return {
        "default_run_wall": _minutes([r["wall_s"] for r in history]),
        "default_run_eval": eval_text,
        "filtered_pct": f"{last['filtered_pct']:.1f}%",
        "run_dir_mb": f"~{last['run_dir_mb']} MB",
    }


def rewrite(text: str, figures: Mapping[str, str], where: str = "") -> str:
    """``text`` with each figure region's body replaced; an unknown region name is an
    error (a region nothing fills would silently keep a typed figure)."""

    def fill(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in figures:
            raise KeyError(f"{where}: no figure named {name!r} (known: {', '.join(figures)})")
        return f"<!-- figure:{name} -->{figures[name]}<!-- /figure -->"

    return REGION.sub(fill, text)


def regions(text: str) -> dict[str, list[str]]:
    """Each figure region's name -> its bodies as written."""
    out: dict[str, list[str]] = {}
    for m in REGION.finditer(text):
        out.setdefault(m["name"], []).append(m["body"])
    return out


# -- writing ---------------------------------------------------------------------------


def load_history(path: Path = RESULTS) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["runs"] if path.exists() else []


def write_all(
    history: list[dict[str, Any]], curves: Path | None, say: Callable[[str], None] = print
) -> None:
    """Save the history, copy the image, rewrite every document's figure regions."""
    RESULTS.write_text(json.dumps({"runs": history[-HISTORY:]}, indent=2) + "\n")
    say(f"docs-figures: {RESULTS.relative_to(ROOT)} ({len(history[-HISTORY:])} runs)")
    if curves is not None and curves.exists():
        shutil.copyfile(curves, IMAGE)
        say(f"docs-figures: {IMAGE.relative_to(ROOT)}")
    figures = render(history[-HISTORY:])
    for doc in DOCUMENTS:
        path = ROOT / doc
        text = path.read_text()
        new = rewrite(text, figures, doc)
        if new != text:
            path.write_text(new)
        say(f"docs-figures: {doc}: {', '.join(sorted(regions(new))) or 'no figure regions'}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--from-run", help="take the figures of this finished run instead of running")
    p.add_argument("--data-dir", default=str(ROOT / "runs"), help="runs directory")
    args = p.parse_args(argv)
    data_dir = Path(args.data_dir).absolute()
    run = args.from_run or time.strftime("docs-%Y%m%d-%H%M%S", time.gmtime())
    wall_s = None if args.from_run else measure(run, data_dir)
    record = record_of(run, data_dir, wall_s)
    print("docs-figures: " + json.dumps(record), flush=True)
    history = [r for r in load_history() if r["run"] != run] + [record]
    write_all(history, data_dir / run / "curves.png")


if __name__ == "__main__":
    main()
