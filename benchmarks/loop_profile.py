"""A profile of the whole learning loop: what each role process costs, where a step's
time goes, and a timeline picture.

Runs ``rlbus up`` once (RL only by default: no warm start, no eval, so the profile shows
steady RL; ``--warm`` keeps the preset's warm start and eval) while a thread samples
every process of the launcher's tree from /proc every 0.1 s
(``benchmarks.proc_sampler``), then reads the run's log (``benchmarks.critical_path``)
and the inference logs' ``weights.swapped`` lines.

    python -m benchmarks.loop_profile [--steps 40] [--out-name loop_profile] [--warm]
        [-c PRESET] [--data-dir DIR] [dotted.key=value ...]

It writes ``benchmarks/results/<out-name>.json`` (per role: CPU s, wall s, utilisation,
threads, allowed CPUs, busy share from its own metrics or its CPU; per step: the
critical path; their medians over the steady state; throughput; CPU series) and
``benchmarks/results/<out-name>.png`` (``benchmarks.timeline_plot``), and prints a
summary. The run lives in a temporary directory unless ``--data-dir`` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, save
from benchmarks.critical_path import (
    medians,
    steady,
    step_account,
    step_rows,
    swap_times,
    throughput,
)
from benchmarks.proc_sampler import Sampler
from bus.reader import read_log
from bus.runtime import Bus
from bus.server import EmbeddedServer
from bus.subjects import Topic
from schemas import (
    BatchAssembled,
    MetricsReported,
    SamplesScored,
    TaskRequested,
    TraceCompleted,
    WeightsPublished,
)

RUN = "profile"
INFERENCE_REPORT_S = 10.0  # inference's metrics interval (roles.inference.role)
READS = {  # what is read from the log: topic -> event type
    Topic.TASK_REQUESTED: TaskRequested,
    Topic.TRACE_COMPLETED: TraceCompleted,
    Topic.SAMPLES_SCORED: SamplesScored,
    Topic.BATCH_ASSEMBLED: BatchAssembled,
    Topic.WEIGHTS_PUBLISHED: WeightsPublished,
    Topic.METRICS_REPORTED: MetricsReported,
}


def launch(root: Path, preset: str, steps: int, warm: bool, overrides: list[str]) -> Sampler:
    """Run ``rlbus up`` to its end under a sampler; the sampler's records."""
    cmd = [
        sys.executable, "-m", "roles.cli", "up", "--no-view", "-c", preset, "--run", RUN, "--fresh",
        f"bus.data_dir={root}", f"max_steps={steps}",
    ]  # fmt: skip
    if not warm:
        cmd += ["orchestrator.warmup.steps=0", "orchestrator.eval.interval=0"]
    root.mkdir(parents=True, exist_ok=True)
    out_path = root / "up.out"
    with out_path.open("wb") as out:
        proc = subprocess.Popen(cmd + overrides, stdout=out, stderr=subprocess.STDOUT)
        with Sampler(proc.pid) as sampler:
            rc = proc.wait(timeout=1800)
    if rc != 0:
        raise RuntimeError(f"rlbus up failed ({rc}):\n{out_path.read_text()[-3000:]}")
    return sampler


async def read_events(root: Path) -> dict[type, list[Any]]:
    """Every event of ``READS`` on the finished run's log, by type."""
    with EmbeddedServer(root / RUN / "nats") as server:
        bus = await Bus.connect(server.url, run=RUN, producer="bench")
        try:
            return {
                kind: [e async for e in read_log(bus, [(topic, None)], (kind,))]
                for topic, kind in READS.items()
            }
        finally:
            await bus.close()


def busy(
    rows: list[dict[str, Any]], metrics: list[MetricsReported], series: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Each role's busy share over the steady rows: the trainer's from its step and wait
    times, inference's from its ``busy_frac`` reports, every role's CPU utilisation."""
    stamped = [r for r in rows if r["published"] is not None]
    t0, t1 = (stamped[0]["published"], stamped[-1]["published"]) if stamped else (0.0, 0.0)
    inside = [i for i, t in enumerate(series["t"]) if t0 < t <= t1]
    out: dict[str, dict[str, Any]] = {}
    for name, util in series["util"].items():
        cpu = round(statistics.fmean(util[i] for i in inside), 3) if inside else None
        runq = series["runq"][name]
        wait = round(statistics.fmean(runq[i] for i in inside), 3) if inside else None
        out[name] = {"cpu_util_window": cpu, "runq_window": wait, "busy": cpu, "busy_from": "cpu"}
    full = [r for r in rows if None not in (r.get("step_wall"), r["step_s"], r["wait_s"])]
    wall = sum(r["step_wall"] for r in full)
    if wall > 0:  # busy: not waiting for a batch (training, storing and announcing weights)
        train, wait = sum(r["step_s"] for r in full), sum(r["wait_s"] for r in full)
        out.setdefault("trainer", {"cpu_util_window": None, "runq_window": None})
        out["trainer"] |= {"busy": round(1 - wait / wall, 3), "busy_from": "metrics"}
        out["trainer"] |= {"train_frac": round(train / wall, 3), "wait_frac": round(wait / wall, 3)}
    # Inference reports every 10 s: those whose window lies in the steady one, else those
    # ending in it (their window starts earlier), else all of them.
    reports = [m for m in metrics if m.role == "inference" and "busy_frac" in m.values]
    ending = [m for m in reports if t0 < m.ts_ns / 1e9 <= t1 + INFERENCE_REPORT_S]
    chosen = [m for m in ending if m.ts_ns / 1e9 - INFERENCE_REPORT_S >= t0] or ending or reports
    for name in [n for n in out if n.startswith("inference")]:
        if chosen:
            means = {
                k: round(statistics.fmean(m.values[k] for m in chosen if k in m.values), 4)
                for k in ("busy_frac", "tokens_per_s", "batch_size_mean", "queue_s_mean")
                if any(k in m.values for m in chosen)
            }
            out[name] |= {"busy": means.get("busy_frac"), "busy_from": "metrics", **means}
    return out


def started_roles(lines: list[str]) -> set[str]:
    """The role processes the launcher says it started (its ``role.started`` lines)."""
    names = set()
    for line in lines:
        if '"role.started"' in line:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                names.add(str(json.loads(line)["name"]))
    return names


def relative(series: dict[str, Any]) -> dict[str, Any]:
    """The CPU series with times in seconds from its first sample (``t0``: wall clock)."""
    t0 = series["t"][0] if series["t"] else 0.0
    return series | {"t0": t0, "t": [round(t - t0, 3) for t in series["t"]]}


def print_summary(result: dict[str, Any]) -> None:
    """The tables: per role (util: CPU s / wall s alive; win: cores busy in the steady
    window; runq: cores' worth of its threads waiting for a CPU there), then the step."""
    head = f"{'role':<20}{'CPU s':>7}{'util':>6}{'win':>6}{'runq':>6}{'threads':>9}  cpus"
    print(head)
    for name, r in result["processes"].items():
        b = result["busy"].get(name, {})
        threads = f"{r['threads_max'] or 0}/{r['threads_mean'] or 0:.1f}"
        print(
            f"{name:<20}{r['cpu_s']:>7.1f}{r['cpu_util'] or 0:>6.2f}"
            f"{b.get('cpu_util_window') or 0:>6.2f}{b.get('runq_window') or 0:>6.2f}"
            f"{threads:>9}  {','.join(r['cpus_allowed'])}"
        )
    print(
        "busy:", ", ".join(f"{n} {b['busy']} ({b['busy_from']})" for n, b in result["busy"].items())
    )
    print("median seconds per step:")
    for key, value in result["medians"].items():
        print(f"  {key:<26}{'-' if value is None else f'{value:.3f}':>8}")
    print(
        "mean step account (s):", ", ".join(f"{k} {v}" for k, v in result["step_account"].items())
    )
    if result["unsampled"]:
        print("not sampled (missed by /proc sampling):", ", ".join(result["unsampled"]))
    print("throughput:", ", ".join(f"{k} {v}" for k, v in result["throughput"].items()))


def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.data_dir or tmp).absolute()
        sampler = launch(root, args.config, args.steps, args.warm, args.overrides)
        events = asyncio.run(read_events(root))
        started = started_roles((root / "up.out").read_text(errors="replace").splitlines())
        swaps: dict[int, float] = {}  # read before the temporary run directory goes
        for log in sorted((root / RUN / "logs").glob("inference-policy-*.log")):
            for version, t in swap_times(log.read_text(errors="replace").splitlines()).items():
                swaps[version] = min(swaps.get(version, t), t)
    if not any(o.startswith("bus.url=") for o in args.overrides):
        started.add("nats-server")  # the embedded one
    metrics = events[MetricsReported]
    rows = step_rows(
        events[TaskRequested], events[TraceCompleted], events[SamplesScored],
        events[BatchAssembled], events[WeightsPublished],
        [m for m in metrics if m.role == "trainer"], swaps,
    )  # fmt: skip
    window, series = steady(rows), sampler.series()
    speed = throughput(window, events[TraceCompleted])
    settings = f"{args.config}, {args.steps} steps" + ("" if args.warm else ", RL only")
    settings += "".join(f", {o}" for o in args.overrides)
    processes = sampler.roles()
    result = {
        "settings": settings,
        # roles the launcher started that the sampler never saw (none, unless it missed one)
        "unsampled": sorted(started - processes.keys()),
        "processes": processes,
        "busy": busy(window, metrics, series),
        "medians": medians(window),
        "step_account": step_account(window),
        "steady_steps": [window[0]["step"], window[-1]["step"]] if window else None,
        "throughput": speed,
        "steps": rows,
        "cpu_series": relative(series),
    }
    from benchmarks.timeline_plot import plot_timeline  # matplotlib only now

    title = (
        f"rlbus loop profile ({settings}): {speed['steps_per_s']} steps/s, "
        f"{speed['generated_per_s']} completions/s generated, {speed['trained_per_s']}/s trained"
    )
    png = plot_timeline(RESULTS / f"{args.out_name}.png", rows, window, series, title)
    result["png"] = str(png) if png else None
    return result


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out-name", default="loop_profile")
    p.add_argument("--warm", action="store_true", help="keep the preset's warm start and eval")
    p.add_argument("-c", "--config", default="default", help="preset name or TOML file")
    p.add_argument("--data-dir", help="keep the run here (default: a temporary directory)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value, passed to rlbus up")
    args = p.parse_args()
    result = main(args)
    print_summary(result)
    print("saved", save(args.out_name, result), result["png"] or "(no timeline: too few steps)")
