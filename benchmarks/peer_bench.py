"""rlbus against TRL's ``GRPOTrainer`` on the same work, side by side: ``just bench-peer``.

The peer is TRL itself (the ``peer`` extra: ``trl==1.16.0``), run in its own process by
``benchmarks.peer_trl`` with a torch thread per CPU in fp32 on this machine; rlbus is
``rlbus up`` as a user runs it. Both start from the same bytes and do the same work:

1. **Start.** The default preset's post-warm-start policy: ``rlbus up`` for its 120 SFT
   steps, exported with ``rlbus model export`` (``overlap_bench.warm_model``; kept under
   ``--root`` and reused).
2. **Work.** The default preset's: ``reverse-text`` train tasks, 8 tasks x 8 completions
   per step, at most 12 tokens at temperature 1, the model's stop tokens, group-normalised
   advantages (std), AdamW lr 1e-3 betas (0.9, 0.999) no weight decay, grad clip 1, no KL
   term, a token-mean loss (TRL ``loss_type="dapo"``, rlbus ``normalize="tokens"``). The
   settings TRL gets are read from the same ``RunConfig`` (``trl_spec``); TRL's own
   activation checkpointing and fused AdamW are turned off (rlbus does neither). Where
   the two still differ, by design: TRL trains every completion (zero-advantage groups
   included), a default rlbus run regenerates a group whose rewards are all equal
   (``skip_zero_advantage_groups``), so it reports generated and trained; rlbus's
   enforced rollout filters keep gibberish and repetition out of its batches; its
   samples may be a version or two old (``max_async_level``), with tokens outside the
   trust region masked (TRL's ratio is 1: one update per generation); the group's std is
   the population one (TRL: Bessel-corrected, ~7% larger for 8, so its advantages are
   ~7% smaller, which Adam mostly absorbs).
3. **Checked equal, in the bench itself** (``check_same_work``, on round 1's first
   ``--check`` rollouts of each side; a difference stops the bench). Prompts: every
   prompt TRL generated from (recorded inside TRL) has the token ids rlbus's renderer
   gives the same task's opening messages. Stops: each TRL completion ends at its first
   stop token of rlbus's renderer, else at the token limit. Rewards: TRL's reward
   function (the env's rubric over the completion's ids read as rlbus reads them,
   ``peer_trl.reward_func``) gives the reward rlbus recorded on rlbus's rollouts.
4. **Rounds.** ``--rounds`` times, interleaved (a noisy neighbour hits both alike): an
   rlbus run per set-up (``--setups``: ``defaults``, and ``keep-equal``, which trains an
   equal-reward group with zero advantage as TRL does instead of regenerating it), then a
   TRL run, each for ``2 W`` seconds of training (``--wall`` = W). Round i runs both
   sides under seed i (rlbus's ``seed``, TRL's ``seed``), so rounds differ in their draws.
   Time counts from when training can begin: rlbus's once the last of the loop's roles
   (orchestrator, env server, inference, algorithm, trainer) has logged ``role.started``
   (each has loaded what it needs; nats-server, process starts and model loads before
   are left out), TRL's at ``on_train_begin`` (its model is loaded). The policy at W/2, W and
   2W is the newest one whose step ended by then: rlbus keeps a checkpoint every 10
   steps (``trainer.keep_checkpoints = 0`` keeps them all), TRL every step's weights.
5. **Eval.** One offline evaluator for both (``SyncGrpo.evaluate``: ``rlbus eval``'s
   requests and the orchestrator's ``eval_metrics``, served by the torch engine in this
   process): avg@4 on the first 64 tasks of the eval split, at temperature 1, under
   ``--seeds`` sampling seeds (the run seed of the eval requests); a policy's score is the
   mean over its seeds.

Reported (median over rounds, with the min-max range): seconds per step, completions
generated and trained per second over the window (from t = 0 to the last step ending by
2W), each rlbus set-up's ratios to TRL (its speed over TRL's), and eval at W/2, W, 2W;
``benchmarks/results/peer.json`` and ``peer.md``, and ``peer.png`` (eval vs wall time,
and each side's train reward); ``--name`` changes the stem.

    just bench-peer                          # W = 75 s, 3 rounds, 8 eval seeds
    just bench-peer --rounds 2 --setups defaults,keep-equal
    python -m benchmarks.peer_bench --wall 20 --rounds 1 --seeds 2   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, run_events, save
from benchmarks.overlap_bench import warm_model
from configs import RunConfig, load_config
from roles.up.cpu_plan import available_cpus

POINTS = (0.5, 1.0, 2.0)  # eval points, in units of W
RATES = ("s_per_step", "generated_per_s", "trained_per_s")
TRL = "TRL"
# rlbus set-ups (``--setups``): the side's name in the report, and its overrides.
SETUPS: dict[str, tuple[str, list[str]]] = {
    "defaults": ("rlbus", []),
    # A group whose rewards are all equal trains with zero advantage, as TRL's do,
    # instead of being regenerated.
    "keep-equal": ("rlbus keep-equal", ["orchestrator.skip_zero_advantage_groups=false"]),
}
UP_GRACE_S = 120.0  # start-up and drain of an rlbus run beyond its 2W of training


def trl_spec(cfg: RunConfig, model: Path, out: Path, wall: float, check: int) -> dict[str, Any]:
    """What ``benchmarks.peer_trl`` trains: the run config's work, spelt in TRL's terms."""
    (entry,) = cfg.orchestrator.train.env
    (algorithm,) = [a for a in cfg.orchestrator.algorithms if not a.shadow]
    if algorithm.name != "grpo":
        raise ValueError(f"the peer trains GRPO; the config's algorithm is {algorithm.name!r}")
    sampling = cfg.orchestrator.train.sampling
    t = cfg.trainer
    return {
        "out": str(out), "model": str(model), "env": entry.id, "env_args": dict(entry.args),
        "tasks_per_step": cfg.orchestrator.batch_size // entry.group_size,
        "group_size": entry.group_size, "max_tokens": sampling.max_completion_tokens,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
        "lr": t.lr, "betas": list(t.betas), "weight_decay": t.weight_decay,
        "grad_clip": t.grad_clip, "std_normalize": bool(algorithm.options.get("std_normalize")),
        "epsilon_low": t.loss.trust_region_low, "epsilon_high": t.loss.trust_region_high,
        "seed": cfg.seed, "threads": len(available_cpus()), "max_steps": int(2 * wall / 0.05),
        "wall_s": 2 * wall, "points": [p * wall for p in POINTS], "record": check,
    }  # fmt: skip


# -- rlbus ------------------------------------------------------------------------------------


def run_rlbus(root: Path, model: Path, run: str, wall: float, overrides: list[str]) -> None:
    """``rlbus up`` from ``model`` (no warm start, no in-run eval), stopped like Ctrl-C
    once 2W have passed since its first step line (the log says when training began;
    the stop comes a little after 2W, which the timeline cuts at 2W anyway). A run that
    stops by itself before (a role that died, the run's own stop rules) fails the bench."""
    cmd = [sys.executable, "-m", "roles.cli", "up", "--no-view", "--fresh", "--run", run,
           f"bus.data_dir={root}", f"model.path={model}", "orchestrator.warmup.steps=0",
           "orchestrator.eval.interval=0", "orchestrator.eval.at_start=false",
           "max_steps=100000", "trainer.keep_checkpoints=0", *overrides]  # fmt: skip
    out = root / f"{run}.out"
    with out.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    began, deadline = None, time.monotonic() + 2 * wall + UP_GRACE_S
    while proc.poll() is None and time.monotonic() < deadline:
        if began is None and "] step" in out.read_text():
            began = time.monotonic()
        if began is not None and time.monotonic() - began > 2 * wall + 2.0:
            break
        time.sleep(0.1)
    if proc.poll() is not None:
        raise RuntimeError(f"rlbus up {run} stopped by itself (exit {proc.returncode}): {out}")
    proc.send_signal(signal.SIGINT)  # drains every role, as Ctrl-C does
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every role it started
        raise RuntimeError(f"rlbus up {run} did not stop on Ctrl-C: {out}") from None
    if began is None:
        raise RuntimeError(f"rlbus up {run} trained no step in {UP_GRACE_S:g} s: {out}")


# The roles a train step needs: the run's clock starts once the last of them is up.
LOOP_ROLES = ("orchestrator", "env-", "inference-policy", "algorithm-", "trainer")


def roles_up_ns(root: Path, run: str) -> int:
    """When the last of the loop's roles logged ``role.started`` (ns since the epoch):
    the orchestrator asks for tasks before inference has loaded its model, and the
    seconds until it has are start-up, as TRL's model load is."""
    last = 0
    for path in (root / run / "logs").glob("*.log"):
        if not path.name.startswith(LOOP_ROLES):
            continue
        for line in path.read_text().splitlines():
            if '"role.started"' in line:
                when = datetime.fromisoformat(json.loads(line)["timestamp"])
                last = max(last, int(when.timestamp() * 1e9))
                break
    if not last:
        raise RuntimeError(f"{run}: no loop role logged role.started under {root / run / 'logs'}")
    return last


def rlbus_timeline(root: Path, run: str, wall: float) -> dict[str, Any]:
    """Steps, throughput and the checkpoint kept at each point, from the run's own log."""
    from bus.subjects import Topic
    from schemas import BatchAssembled, TaskRequested, TraceCompleted, WeightsPublished

    log = run_events(
        root / run,
        {
            "tasks": (Topic.TASK_REQUESTED, TaskRequested),
            "weights": (Topic.WEIGHTS_PUBLISHED, WeightsPublished),
            "traces": (Topic.TRACE_COMPLETED, TraceCompleted),
            "batches": (Topic.BATCH_ASSEMBLED, BatchAssembled),
        },
    )
    t0 = max(min(e.ts_ns for e in log["tasks"]), roles_up_ns(root, run))
    at = {w.version: (w.ts_ns - t0) / 1e9 for w in log["weights"] if w.version > 0}
    done = sorted(v for v, t in at.items() if t <= 2 * wall)
    last = done[-1]
    window = at[last]
    if window < 0.9 * 2 * wall:
        raise RuntimeError(f"{run}: its last step by 2W ended at {window:.1f} s, not near 2W")
    samples = {b.step: len(b.samples) for b in log["batches"]}
    rewards = {}
    for e in log["traces"]:
        if e.trace.task.split == "train":
            rewards.setdefault(e.step, []).append(e.trace.reward)
    checkpoints = {
        int(p.name.removeprefix("step-")): p for p in (root / run / "checkpoints").glob("step-*")
    }
    kept = []
    for p in POINTS:
        step = max((s for s in checkpoints if at.get(s, 1e9) <= p * wall), default=None)
        if step is None:
            raise RuntimeError(
                f"{run}: no checkpoint by {p * wall:g} s (first: {min(checkpoints)})"
            )
        kept.append({"point": p * wall, "step": step, "t": round(at[step], 3),
                     "checkpoint": str(checkpoints[step])})  # fmt: skip
    return {
        "steps": last,
        "window_s": round(window, 3),
        "s_per_step": round(window / last, 4),
        "generated_per_s": round(
            sum(1 for e in log["traces"] if 0 <= (e.ts_ns - t0) / 1e9 <= window) / window, 1
        ),
        "trained_per_s": round(sum(samples.get(s, 0) for s in done) / window, 1),
        "kept": kept,
        "curve": [
            {"t": round(at[v], 3), "reward": statistics.fmean(rewards[v - 1])}
            for v in done
            if rewards.get(v - 1)
        ],
        "traces": [e.trace for e in log["traces"] if e.trace.task.split == "train"],
    }


# -- TRL --------------------------------------------------------------------------------------


def run_trl(spec: dict[str, Any], root: Path) -> dict[str, Any]:
    """``benchmarks.peer_trl`` in its own process; its record, with throughput added."""
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    with (out / "trl.log").open("w") as log:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.peer_trl", str(out / "spec.json")],
            stdout=log, stderr=subprocess.STDOUT, timeout=spec["wall_s"] + 600,
        )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"TRL failed (exit {done.returncode}): see {out / 'trl.log'}")
    record: dict[str, Any] = json.loads((out / "trl.json").read_text())
    steps = [s for s in record["steps"] if s["t"] <= spec["wall_s"]]
    window = steps[-1]["t"]
    if window < 0.9 * spec["wall_s"]:  # max_steps reached first, or a crash TRL survived
        raise RuntimeError(f"TRL's last step ended at {window:.1f} s, not near 2W: {out}")
    per_step = record["completions_per_step"]
    record.update(
        steps=len(steps),
        window_s=round(window, 3),
        s_per_step=round(window / len(steps), 4),
        generated_per_s=round(per_step * len(steps) / window, 1),
        trained_per_s=round(per_step * len(steps) / window, 1),
        curve=[{"t": s["t"], "reward": s["reward"]} for s in steps if "reward" in s],
    )
    return record


# -- the equality checks ----------------------------------------------------------------------


def check_same_work(
    cfg: RunConfig, model: Path, trl: dict[str, Any], traces: list[Any], max_tokens: int
) -> dict[str, str]:
    """Prompts, stops and rewards checked equal on recorded rollouts of both sides: TRL's
    prompt ids are rlbus's rendering of the same task; each TRL completion ends where an
    rlbus one would (at its first stop token, else at ``max_tokens``); TRL's reward
    function gives the reward rlbus recorded on rlbus's rollouts. Raises on any
    difference, and when either side recorded nothing."""
    from benchmarks.peer_trl import reward_func
    from roles.lib.envs.registry import make_env
    from roles.lib.model.loading import load_tokenizer
    from roles.lib.model.render import Renderer

    (entry,) = cfg.orchestrator.train.env
    env = make_env(entry.id, dict(entry.args))
    renderer = Renderer(load_tokenizer(model, local_files_only=True))
    stops = set(renderer.stop_token_ids)
    reward = reward_func(env, renderer)
    recorded = trl["recorded"]
    prompts_equal = stops_equal = 0
    for r in recorded:
        messages = env.harness.initial_messages(json.loads(r["task"]))
        prompts_equal += renderer.render_prompt(messages) == r["prompt_ids"]
        ids = r["completion_ids"]
        first_stop = next((k for k, t in enumerate(ids) if t in stops), None)
        ends = len(ids) - 1 if first_stop is not None else None
        stops_equal += first_stop == ends and (ends is not None or len(ids) == max_tokens)
    mine = [t for t in traces if t.ok][: len(recorded)]
    rewards_equal = 0
    for t in mine:
        ids, sampled, _, _ = t.branch_tokens(t.branches[0])
        completion = [int(i) for i, s in zip(ids, sampled, strict=True) if s]
        task = t.task.data
        messages = env.harness.initial_messages(task)
        trl_reward = reward(
            prompts=[messages], completion_ids=[completion], task=[json.dumps(task)]
        )[0]
        rewards_equal += abs(trl_reward - t.reward) < 1e-9
    out = {
        "trl_prompts_as_rlbus_renders": f"{prompts_equal}/{len(recorded)}",
        "trl_completions_stop_as_rlbus": f"{stops_equal}/{len(recorded)}",
        "rlbus_rewards_from_trl_reward_fn": f"{rewards_equal}/{len(mine)}",
    }
    if not recorded or not mine or (prompts_equal, stops_equal, rewards_equal) != (
        len(recorded), len(recorded), len(mine),
    ):  # fmt: skip
        raise RuntimeError(f"not the same work: {out}")
    return out


# -- eval -------------------------------------------------------------------------------------


def evaluate(cfg: RunConfig, model_dir: Path, seeds: int) -> list[float]:
    """avg@k of the policy at ``model_dir`` under each sampling seed (one evaluator for
    both sides: ``SyncGrpo.evaluate``)."""
    from benchmarks.sync_grpo import SyncGrpo

    c = cfg.model_copy(deep=True)
    c.model.path = str(model_dir)
    loop = SyncGrpo(c, start=None, threads=len(available_cpus()))

    async def scores() -> list[float]:
        out = []
        try:
            for seed in range(seeds):
                loop.cfg.seed = seed
                values = await loop.evaluate()
                out.append(next(v for k, v in values.items() if "/avg@" in k and "stderr" not in k))
        finally:
            await loop.close()
        return out

    return asyncio.run(scores())


def rlbus_policy(root: Path, run: str, checkpoint: str) -> Path:
    """A kept rlbus checkpoint as a model directory (``rlbus model export``'s writer)."""
    from roles.lib.model.weights import write_checkpoint_model

    out = root / "eval-models" / f"{run}-{Path(checkpoint).name}"
    shutil.rmtree(out, ignore_errors=True)  # a run of an earlier bench in this root
    write_checkpoint_model(Path(checkpoint), root / "warm-model", out)
    return out


# -- the report -------------------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4),
            "max": round(max(values), 4)}  # fmt: skip


def report(runs: dict[str, list[dict[str, Any]]], wall: float) -> dict[str, Any]:
    """Per side, each figure's median and range over rounds; per rlbus set-up, its ratios
    to TRL: rates rlbus over TRL, seconds per step TRL over rlbus, so every ratio reads
    "rlbus's speed over TRL's" (> 1: rlbus is faster)."""
    sides = {
        name: {
            **{k: spread([r[k] for r in rs]) for k in RATES},
            "eval": {
                f"{p:g}W": spread([r["eval"][i]["mean"] for r in rs]) for i, p in enumerate(POINTS)
            },
        }
        for name, rs in runs.items()
    }
    t = sides[TRL]
    ratios = {}
    for name, r in sides.items():
        if name != TRL:
            ratios[name] = {k: round(r[k]["median"] / t[k]["median"], 3) for k in RATES[1:]}
            ratios[name]["s_per_step"] = round(
                t["s_per_step"]["median"] / r["s_per_step"]["median"], 3
            )
    return {"wall_W_s": wall, "sides": sides, "over_trl": ratios}


def markdown(results: dict[str, Any]) -> str:
    s, w = results["summary"]["sides"], results["wall_W_s"]
    ratios = results["summary"]["over_trl"]

    def cell(x: dict[str, float], fmt: str = "{:.3f}") -> str:
        return f"{fmt.format(x['median'])} ({fmt.format(x['min'])}–{fmt.format(x['max'])})"

    names = [*ratios, TRL]
    lines = [
        f"# rlbus vs TRL GRPOTrainer ({results['rounds']} rounds, W = {w:g} s)",
        "",
        f"Median (min–max) over rounds, interleaved; eval: avg@4 on 64 eval tasks, mean of "
        f"{results['seeds']} sampling seeds. Checks: {results['checks']}.",
        "",
        "| | " + " | ".join(names) + " | " + " | ".join(f"{n} / TRL" for n in ratios) + " |",
        "|---" * (len(names) + len(ratios) + 1) + "|",
    ]
    for label, key, fmt in (
        ("seconds per step", "s_per_step", "{:.3f}"),
        ("completions generated / s", "generated_per_s", "{:.0f}"),
        ("completions trained / s", "trained_per_s", "{:.0f}"),
    ):
        cells = [cell(s[n][key], fmt) for n in names] + [f"{ratios[n][key]:.2f}x" for n in ratios]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    for p in POINTS:
        k = f"{p:g}W"
        cells = [cell(s[n]["eval"][k]) for n in names] + [""] * len(ratios)
        lines.append(f"| eval at {k} ({p * w:g} s) | " + " | ".join(cells) + " |")
    lines += ["", "Ratios: rlbus's speed over TRL's (seconds per step: TRL's over rlbus's)."]
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, list[dict[str, Any]]], wall: float, path: Path) -> Path:
    from roles.lib.plotting import finish, new_figure, plot_smoothed, save

    fig = new_figure((12, 4.5))
    left, right = fig.subplots(1, 2)
    palette = iter(("tab:blue", "tab:green", "tab:purple"))
    for name, rs in runs.items():
        color = "tab:orange" if name == TRL else next(palette)
        for i, r in enumerate(rs):
            xs = [e["t"] for e in r["eval"]]
            ys = [e["mean"] for e in r["eval"]]
            left.plot(xs, ys, marker="o", color=color, alpha=0.7, label=None if i else name)
        plot_smoothed(right, [(c["t"], c["reward"]) for c in rs[0]["curve"]], name, color)
    for ax in (left, right):
        for p in POINTS:
            ax.axvline(p * wall, color="grey", lw=0.5, ls=":")
        ax.set_xlabel("seconds of training")
    left.set_ylabel("eval avg@4 (mean over seeds)")
    left.set_title("eval of the policy kept at W/2, W, 2W (one line per round)")
    right.set_ylabel("train reward")
    right.set_title("train reward per step (round 1)")
    left.legend()
    right.legend()
    return save(finish(fig, "rlbus vs TRL GRPOTrainer on the default preset's work"), path)


def main(
    wall: float, rounds: int, seeds: int, check: int, root: Path | None, setups: list[str],
    name: str = "peer",
) -> dict[str, Any]:  # fmt: skip
    root = root or Path(tempfile.mkdtemp(prefix="rlbus-peer-"))
    model = warm_model(root)
    cfg = load_config("default", [f"model.path={model}", "trainer.device=cpu"])
    runs: dict[str, list[dict[str, Any]]] = {SETUPS[s][0]: [] for s in setups} | {TRL: []}
    checks: dict[str, Any] = {}
    for i in range(rounds):
        for setup in setups:
            run = f"peer-{setup}-{i}"
            run_rlbus(root, model, run, wall, [f"seed={cfg.seed + i}", *SETUPS[setup][1]])
            ours = rlbus_timeline(root, run, wall)
            print(f"round {i + 1}: {SETUPS[setup][0]} {ours['s_per_step']:.3f} s/step, generated "
                  f"{ours['generated_per_s']}/s, trained {ours['trained_per_s']}/s", flush=True)  # fmt: skip
            if not checks:
                traces = ours["traces"]
            ours["policies"] = [rlbus_policy(root, run, k["checkpoint"]) for k in ours["kept"]]
            ours.pop("traces")
            runs[SETUPS[setup][0]].append(ours)
        spec = trl_spec(cfg, model, root / f"trl-{i}", wall, check) | {"seed": cfg.seed + i}
        theirs = run_trl(spec, root)
        print(f"round {i + 1}: {TRL} {theirs['s_per_step']:.3f} s/step, trained "
              f"{theirs['trained_per_s']}/s", flush=True)  # fmt: skip
        if not checks:
            max_tokens = cfg.orchestrator.train.sampling.max_completion_tokens
            checks = check_same_work(cfg, model, theirs, traces, max_tokens)
            print(f"checked: {checks}", flush=True)
        theirs["policies"] = [Path(k["path"]) for k in theirs["kept"]]
        theirs.pop("recorded")
        runs[TRL].append(theirs)
    for side, rs in runs.items():  # eval after every round ran: it is not timed
        for i, r in enumerate(rs):
            r["eval"] = []
            for k, policy in zip(r["kept"], r.pop("policies"), strict=True):
                scores = evaluate(cfg, policy, seeds)
                r["eval"].append({"point": k["point"], "step": k["step"], "t": k["t"],
                                  "mean": round(statistics.fmean(scores), 4),
                                  "seeds": [round(x, 4) for x in scores]})  # fmt: skip
                print(f"eval {side} round {i + 1} at {k['point']:g}s (step {k['step']}, "
                      f"t={k['t']:.1f}s): {statistics.fmean(scores):.4f}", flush=True)  # fmt: skip
    results = {"wall_W_s": wall, "rounds": rounds, "seeds": seeds, "checks": checks,
               "setups": dict(SETUPS[s] for s in setups),
               "summary": report(runs, wall), "runs": runs}  # fmt: skip
    print(f"results: {save(name, results)}")
    (RESULTS / f"{name}.md").write_text(markdown(results))
    print(markdown(results))
    print(f"plot: {plot(runs, wall, RESULTS / f'{name}.png')}")
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--wall", type=float, default=75.0, help="W, seconds (each side runs 2W)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median)")
    ap.add_argument("--seeds", type=int, default=8, help="eval sampling seeds per policy")
    ap.add_argument("--check", type=int, default=400, help="rollouts checked equal per side")
    ap.add_argument("--root", type=Path, default=None, help="reuse this directory (its warm model)")
    ap.add_argument("--setups", default="defaults", help=f"rlbus set-ups, of {sorted(SETUPS)}")
    ap.add_argument("--name", default="peer", help="results' file stem")
    a = ap.parse_args()
    main(a.wall, a.rounds, a.seeds, a.check, a.root, a.setups.split(","), a.name)
