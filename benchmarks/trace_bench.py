"""Trace benchmark: ``rlbus trace`` by a scan of the log against through the lake's index.

Records one run (``rlbus up -c <preset>`` for ``--steps`` steps; or reuses a recorded
one: ``--data-dir D --run R``), then, on that run, for ``--rollouts`` rollouts spread
over it (train ones and an eval one):

- **full scan** (what ``rlbus trace`` did before): read every event of the seven topics
  ``trace_chain`` looks at (median of ``--repeats``), load the tokenizer through
  transformers, build the chain;
- **trace index** (what it does now): sync the lake if the stream moved past the index
  (a run recorded by ``rlbus up`` has its lake written live: a check), look the chain's
  events up in the index (``replay.trace_index``), fetch those by sequence, load the
  tokenizer from its ``tokenizer.json``, build the chain.

The chain JSON must be the same both ways for every rollout (asserted). Then the
command itself, as a user types it after the run (a new process, which starts the run's
embedded server): ``rlbus trace --run <run> <rollout prefix> --json`` and
``--no-tokens``, median wall time of 3, its output asserted equal to the full scan's
chain with the transformers tokenizer (the old command's output). And the **first**
trace after the run, each on its own copy of the run (median of 3): as ``rlbus up``
left it (``cli_first_trace_s``: the lake and its index written by the live lake role),
and with the lake deleted (``cli_first_trace_no_lake_s``: a run without the live role,
whose first trace syncs the whole log; ``full_sync_s`` is that sync alone). Tokenizer
loads are timed in fresh processes (their imports are most of their cost).

    python -m benchmarks.trace_bench [--preset default] [--steps 60] [--rollouts 10]
    python -m benchmarks.trace_bench --data-dir runs --run smoke1    # an existing run
    python -m benchmarks.trace_bench --data-dir runs --run smoke1 --name trace_smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import save
from bus.reader import read_log
from bus.runtime import Bus
from bus.server import reachable_server
from configs.paths import RunPaths
from replay.inspect import TOPICS, TYPES, trace_chain
from replay.lake import sync_run
from replay.trace_index import IndexPart, chain_seqs, fetch, load_index, resolve, sync_if_behind

RUN = "bench-trace"
CLI = [sys.executable, "-m", "roles.cli"]


def record(root: Path, preset: str, steps: int) -> float:
    """Run ``rlbus up`` to the end; its wall time."""
    cmd = [*CLI, "up", "-c", preset, "--no-view", "--run", RUN, f"bus.data_dir={root}",
           f"max_steps={steps}"]  # fmt: skip
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"rlbus up failed:\n{out.stdout[-3000:]}")
    return time.perf_counter() - start


def spread(index: IndexPart, n: int) -> list[str]:
    """``n - 1`` train rollouts evenly over the log, and the first eval one."""
    topic = {event_id: t for _, event_id, t in index.events}
    train: dict[str, None] = {}
    evals: list[str] = []
    for _, event_id, rollout_id, *_ in sorted(index.rollouts):
        if topic.get(event_id) == "eval.completed":
            evals.append(rollout_id)
        else:
            train.setdefault(rollout_id)
    step = max(1, len(train) // max(1, n - 1))
    return [*list(train)[::step][: n - 1], *evals[:1]]


def old_token_text(paths: RunPaths) -> Callable[[list[int]], list[str]]:
    """What the old command used: the run's tokenizer through transformers."""
    from roles.lib.model.loading import load_tokenizer

    tok = load_tokenizer(paths.initial_model)
    return lambda ids: list(tok.convert_ids_to_tokens(ids))


def load_time(code: str) -> float:
    """Seconds ``code`` takes in a fresh process (imports included)."""
    timed = f"import time; t = time.perf_counter(); {code}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", timed], capture_output=True, text=True, check=True)
    return round(float(out.stdout.split()[-1]), 3)


def median(values: list[float]) -> float:
    return statistics.median(values)


def as_json(chain: dict[str, Any]) -> str:
    return json.dumps(chain, default=str)  # as `rlbus trace --json` prints it


async def both_ways(paths: RunPaths, url: str, n: int, repeats: int) -> dict[str, Any]:
    """Both paths on the same rollouts (the chains must be equal), phase by phase."""
    lake = paths.lake
    bus = await Bus.connect(url, run=paths.run, producer="bench")
    try:
        with tempfile.TemporaryDirectory(prefix="rlbus-trace-bench-lake-") as tmp:
            full_sync = await sync_run(bus, Path(tmp))  # the whole log into an empty lake
        t0 = time.perf_counter()
        synced = await sync_if_behind(bus, lake)
        sync_s = time.perf_counter() - t0
        scans, full = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            full = [e async for e in read_log(bus, TOPICS, TYPES)]
            scans.append(time.perf_counter() - t0)
        rollouts = spread(load_index(lake), n)
        token_text = old_token_text(paths)
        phases: dict[str, list[float]] = {"check": [], "lookup": [], "fetch": [], "chain": [],
                                          "full_chain": []}  # fmt: skip
        fetched = []
        for rid in rollouts:
            t = [time.perf_counter()]
            await sync_if_behind(bus, lake)
            t.append(time.perf_counter())
            index = load_index(lake)
            wanted = chain_seqs(index, resolve(index, rid[:8]))
            t.append(time.perf_counter())
            events = await fetch(bus, wanted)
            t.append(time.perf_counter())
            fast = as_json(trace_chain(events, rid, token_text))
            t.append(time.perf_counter())
            slow = as_json(trace_chain(full, rid, token_text))
            t.append(time.perf_counter())
            if fast != slow:
                raise AssertionError(f"the chains of rollout {rid} differ")
            for k, a, b in zip(phases, t, t[1:], strict=False):
                phases[k].append(b - a)
            fetched.append(len(events))
        first = rollouts[0]  # what the old command printed for it, for the CLI below
        old = {"tokens": as_json(trace_chain(full, first, token_text)),
               "no_tokens": as_json(trace_chain(full, first))}  # fmt: skip
    finally:
        await bus.close()
    lake_path = [sum(v) for v in zip(*(phases[k] for k in ("check", "lookup", "fetch", "chain")), strict=True)]  # fmt: skip
    old_s = median(scans) + median(phases["full_chain"])
    ms = {f"{k}_ms": round(median(v) * 1e3, 1) for k, v in phases.items()}
    return {
        "stream_events_read_by_full_scan": len(full),
        "rollouts_compared": len(rollouts),
        "chains_equal": True,
        "full_sync_s": round(full_sync.seconds, 3),
        "full_sync_events": full_sync.events,
        "first_lake_sync_s": round(sync_s, 3),  # the lake as the run left it: a check
        "lake_was_current": not synced,
        "full_scan_read_ms": round(median(scans) * 1e3, 1),
        "full_scan_chain_ms": ms["full_chain_ms"],
        "lake_sync_check_ms": ms["check_ms"],
        "lake_lookup_ms": ms["lookup_ms"],
        "lake_fetch_ms": ms["fetch_ms"],
        "lake_chain_ms": ms["chain_ms"],
        "lake_total_ms": round(median(lake_path) * 1e3, 1),
        "lake_total_max_ms": round(max(lake_path) * 1e3, 1),
        "events_fetched_median": statistics.median(fetched),
        "speedup": round(old_s / median(lake_path), 1),
        "rollouts": rollouts,
        "_old": old,
    }


def command(paths: RunPaths, *args: str) -> tuple[float, str]:
    """(median wall seconds of 3, stdout) of ``rlbus <args>`` with the run's data dir."""
    times, stdout = [], ""
    for _ in range(3):
        seconds, stdout = once(paths.data_dir, *args)
        times.append(seconds)
    return round(median(times), 3), stdout


def once(data_dir: Path, *args: str) -> tuple[float, str]:
    """(wall seconds, stdout) of one ``rlbus <args>`` with ``data_dir``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLBUS_")}
    env["RLBUS_DATA_DIR"] = str(data_dir)
    t0 = time.perf_counter()
    r = subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, check=True)
    return time.perf_counter() - t0, r.stdout.strip()


def first_trace(paths: RunPaths, prefix: str, keep_lake: bool) -> float:
    """Median wall seconds of the first ``rlbus trace`` on each of 3 copies of the run
    (with its lake as the run left it, or without one)."""
    times = []
    for _ in range(3):
        with tempfile.TemporaryDirectory(prefix="rlbus-trace-bench-copy-") as tmp:
            copy = RunPaths(Path(tmp), paths.run)
            shutil.copytree(paths.dir, copy.dir, symlinks=True)
            if not keep_lake:
                shutil.rmtree(copy.lake, ignore_errors=True)
            times.append(once(copy.data_dir, "trace", "--run", paths.run, prefix, "--json")[0])
    return round(median(times), 3)


def bench(paths: RunPaths, n: int, repeats: int) -> dict[str, Any]:
    first = spread(load_index(paths.lake), n) if paths.lake.is_dir() else []
    # Before anything here syncs: the run as `rlbus up` left it (its lake written live).
    live = first_trace(paths, first[0][:8], keep_lake=True) if first else None
    with reachable_server(paths.nats) as url:
        assert url is not None, f"no store at {paths.nats}"
        r = asyncio.run(both_ways(paths, url, n, repeats))
    old, prefix = r.pop("_old"), r["rollouts"][0][:8]
    cli_s, printed = command(paths, "trace", "--run", paths.run, prefix, "--json")
    bare_s, bare = command(paths, "trace", "--run", paths.run, prefix, "--json", "--no-tokens")
    if (printed, bare) != (old["tokens"], old["no_tokens"]):
        raise AssertionError("rlbus trace printed another chain than the old command")
    model = paths.initial_model
    return {
        **r,
        "cli_first_trace_s": live,  # None: the run had no lake (recorded without the live role)
        "cli_first_trace_no_lake_s": first_trace(paths, prefix, keep_lake=False),
        "cli_trace_json_s": cli_s,
        "cli_trace_json_no_tokens_s": bare_s,
        "cli_help_s": command(paths, "--help")[0],  # the process start every command pays
        "tokenizer_transformers_s": load_time(
            f"from roles.lib.model.loading import load_tokenizer; load_tokenizer({str(model)!r})"
        ),
        "tokenizer_tokenizers_s": load_time(
            f"from tokenizers import Tokenizer; Tokenizer.from_file({str(model)!r} + '/tokenizer.json')"
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="default", help="config preset of the recorded run")
    parser.add_argument("--steps", type=int, default=60, help="trainer steps of the recorded run")
    parser.add_argument("--rollouts", type=int, default=10, help="rollouts traced both ways")
    parser.add_argument("--repeats", type=int, default=3, help="full scans timed (median)")
    parser.add_argument("--data-dir", type=Path, help="reuse a recorded run under this dir")
    parser.add_argument("--run", help="the recorded run to reuse (with --data-dir)")
    parser.add_argument(
        "--name", default="trace", help="results file: benchmarks/results/<name>.json"
    )
    args = parser.parse_args()
    if args.data_dir is not None:
        paths = RunPaths(args.data_dir, args.run or RUN)
        results = {"run": paths.run, **bench(paths, args.rollouts, args.repeats)}
    else:
        with tempfile.TemporaryDirectory(prefix="rlbus-trace-bench-") as tmp:
            paths = RunPaths(Path(tmp), RUN)
            wall = record(paths.data_dir, args.preset, args.steps)
            results = {"preset": args.preset, "steps": args.steps, "run_wall_s": round(wall, 1),
                       **bench(paths, args.rollouts, args.repeats)}  # fmt: skip
    print(save(args.name, results).read_text())


if __name__ == "__main__":
    main()
