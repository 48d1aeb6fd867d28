"""A synchronous GRPO loop in ONE process, on rlbus's own code: a reference, not the peer.

It was the baseline rlbus was measured against until TRL's ``GRPOTrainer`` did the same
work 1.65x faster than it; the peer is now TRL itself (``benchmarks.peer_bench``, which
also uses ``SyncGrpo.evaluate`` as its one offline evaluator for both sides).

Each step generates every completion of a batch, scores them, trains on them, then
starts the next: no bus, no second process, no overlap. The work per step is the run
config's (the default preset: 8 reverse-text tasks x group_size 8 = 64 completions,
temperature 1, at most 12 tokens, GRPO with std_normalize, AdamW lr 1e-3, grad clip 1),
done by the same functions the roles run, called directly (where a role wraps a piece in
bus I/O, the pure function underneath is called):

- tasks and seeds: the orchestrator's ``Decider.dispatch_group("rl")`` on an
  ``OrchestratorState`` (task index, group id and sampling seed from the run seed and the
  group counter, exactly as a run dispatches);
- rollouts: the env server's ``rollout_group`` (``run_rollout`` per completion: the env's
  opening messages rendered by ``Renderer.render_prompt``, the rubric's reward, the
  env's rollout filters), its ``outputs_for`` making the ``TraceCompleted`` events;
- generation: the torch backend (``TorchBackend``: the engine's decode loop, at most
  ``inference.max_batch_size`` rows, no batch window: a step's requests are all queued
  before the loop runs);
- advantages and samples: the algorithm worker's ``ScoringCore`` (``score_group``, the
  registered grpo's ``from_rewards``), for every non-shadow algorithm of the config;
- the batch: the orchestrator's fold, ``OrchestratorState.apply`` (merging several
  algorithms' samples as ``merge_scored`` does) into a ``BatchAssembled``;
- training: ``TrainerCore.train_step`` (packing, loss, AdamW, grad clip, deterministic
  kernels);
- eval (``--eval-every N``): ``rlbus eval``'s requests (``plan_requests`` +
  ``build_requests``: tasks 0..num_tasks-1 of the eval split, the orchestrator's eval
  seeds, k samples each) and the orchestrator's ``eval_metrics`` (avg@k).

Weights. The engine is built around the trainer's own model object: generation reads the
weights the last step wrote, so moving weights costs nothing (the engine is told the new
version, which drops the prompt prefixes it kept: they were computed by the old weights). That is what any
single-process loop would do, and it is the cheapest possible hand-off, so the
comparison is conservative (rlbus pays for serialising, storing and loading every
version). On CUDA it means inference in the trainer's float32, not rlbus's bfloat16.

Where it departs from a run, on purpose. Every completion trains: groups with all-equal
rewards stay in the batch (zero advantage, so they add train compute and loss tokens
but no gradient), unless ``--skip-zero-groups`` (``orchestrator.skip_zero_advantage_groups``)
drops them like the orchestrator does; a rollout an enforced filter flags never trains,
as in a run. ``max_async_level``, staleness and the SFT warm start do not apply: every
step is phase "rl" at the policy's current version. The group counter restarts at 0, so
a run resumed from a checkpoint draws other tasks than the run itself did after it.

Timing. ``gen_s`` is the engine's time decoding (the decode loop's busy time);
``train_s`` is ``train_step``; ``score_s`` is the rest of the step: dispatch, prompt
rendering, rubric, filters, advantages, samples, batch. Eval time is kept out of every
throughput figure.

    python -m benchmarks.sync_grpo [--steps 40] [--start RUN_DIR_OR_CHECKPOINT] [--threads 2]
        [--eval-every N] [--skip-zero-groups] [-c PRESET] [dotted.key=value ...]

``--start`` takes a checkpoint directory (``<run>/checkpoints/step-N``), a run directory
(``runs/demo`` or ``runs/demo:120``) or ``RUN[:STEP]`` under the data directory, resolved
as ``rlbus eval --checkpoint`` resolves them; the run's ``config.toml`` is then the config
(unless ``-c``), and the checkpoint's weights, AdamW state and step are loaded as the
trainer role loads them. Results: ``benchmarks/results/sync_grpo.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import save
from configs import RunConfig
from configs.orchestrator import POLICY
from roles.algorithm.builtin import flat
from roles.algorithm.core import ScoringCore
from roles.env_server.role import outputs_for, rollout_group
from roles.inference.engine import TorchEngine
from roles.inference.torch_backend import TorchBackend
from roles.lib.envs.filters import build_filters
from roles.lib.envs.harness import completion_tokens
from roles.lib.envs.registry import make_env
from roles.lib.model import materialize_model
from roles.lib.model.loading import load_tokenizer
from roles.lib.model.render import Renderer
from roles.orchestrator.eval_stats import eval_metrics
from roles.orchestrator.policy import Decider, trains_on
from roles.orchestrator.state import OrchestratorState
from roles.trainer.core import TrainerCore
from schemas import (
    BatchAssembled,
    GenerateRequest,
    GenerateResult,
    InferenceFailed,
    SamplesScored,
    SamplingParams,
    TaskRequested,
    Trace,
    TraceCompleted,
    batch_id,
)
from schemas.arrays import pack_i32

RUN = "sync-grpo"  # the run id of the events built here (none is published)


@dataclass
class Rollouts:
    """One step's work before training: what was asked, rolled out, scored and batched."""

    requests: list[TaskRequested]
    traces: list[Trace]
    scored: list[SamplesScored]
    batch: BatchAssembled


class SyncGrpo:
    """Trainer, engine, envs, algorithms and the orchestrator's state, in one process.

    ``start``: a trainer checkpoint (``<run>/checkpoints/step-N``) to resume, or None for
    ``model.path`` (``"tiny"``: the tiny model, built in a temporary directory).
    """

    def __init__(
        self,
        cfg: RunConfig,
        start: Path | None = None,
        threads: int = 2,
        skip_zero: bool = False,
    ) -> None:
        cfg = cfg.model_copy(deep=True)
        cfg.run = cfg.run or RUN
        o = cfg.orchestrator
        if o.actor != POLICY:
            raise ValueError(
                f"orchestrator.actor = {o.actor!r}: the baseline serves the policy only"
            )
        self.cfg, self.skip_zero, self.threads = cfg, skip_zero, threads
        torch.set_num_threads(threads)
        self._scratch: tempfile.TemporaryDirectory[str] | None = None
        if start is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="sync-grpo-")
            run_dir = Path(self._scratch.name)
        else:
            run_dir = Path(start).resolve().parent.parent  # <run>/checkpoints/step-N
        # The trainer role's model: model.path, the tiny model built under the run.
        model_dir = materialize_model(cfg, cfg.model.path, run_dir)
        self.core = TrainerCore(cfg, model_dir)
        self.core.threads = threads  # train_step runs with these intra-op threads
        if start is not None:
            self.core.load_checkpoint(start)  # weights, AdamW moments, step
        self.start_step = self.core.step
        tokenizer = load_tokenizer(model_dir, local_files_only=cfg.model.local_files_only)
        self.renderer = Renderer(tokenizer)
        self.engine = TorchEngine(
            self.core.model,
            tokenizer,
            policy_version=self.core.step,
            max_batch_size=cfg.inference.max_batch_size,
            max_model_len=cfg.inference.max_model_len,
        )
        # No window: every request of a step is queued before the loop first runs.
        self.backend = TorchBackend(self.engine, batch_window_ms=0.0)
        entries = o.train.env
        self.envs = {e.key: make_env(e.id, dict(e.args)) for e in entries}
        self.env_ids = {e.key: e.id for e in entries}
        self.filters = {e.key: build_filters(e.filters) for e in entries}
        self.scorers = {a.id: ScoringCore.for_run(cfg, a.id) for a in o.algorithms if not a.shadow}
        for a, scorer in self.scorers.items():
            if scorer.needs_refs:
                raise ValueError(f"algorithm {a!r} needs a reference model: not in the baseline")
        self.state = OrchestratorState(trains_on=trains_on(cfg))
        self.state.assembled = self.state.trainer_version = self.core.step

    # -- generation -------------------------------------------------------------------------

    async def generate(
        self,
        model: str,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        stop_token_ids: Sequence[int],
        seed: int,
        *,
        env: str | None = None,
        pin_version: int | None = None,
    ) -> GenerateResult | InferenceFailed:
        """The harness's ``Generate``: the request ``InferenceClient.generate`` would send,
        answered by the engine in this process."""
        if model != POLICY:
            raise ValueError(f"model {model!r}: the baseline serves the policy only")
        req = GenerateRequest(
            request_id=request_id, prompt_ids=pack_i32(prompt_ids), sampling=sampling,
            stop_token_ids=list(stop_token_ids), seed=seed, env=env, pin_version=pin_version,
        )  # fmt: skip
        (reply,) = await self.backend.generate([req])
        return reply

    async def run_groups(self, requests: Sequence[TaskRequested]) -> list[list[Trace]]:
        """Every request's group, rolled out concurrently so the engine batches them."""
        self.core.model.eval()
        self.engine.policy_version = self.core.step  # (forgets prefixes of older weights)
        return list(
            await asyncio.gather(
                *(
                    rollout_group(
                        self.envs[r.env],
                        r,
                        self.generate,
                        self.renderer,
                        self.env_ids[r.env],
                        self.filters[r.env],
                    )  # fmt: skip
                    for r in requests
                )
            )
        )

    # -- one step ---------------------------------------------------------------------------

    async def rollouts(self) -> Rollouts:
        """Dispatch a batch's worth of groups, roll them out, score them, assemble the batch."""
        decider = Decider(self.state, self.cfg)
        need = self.cfg.orchestrator.batch_size
        while need > 0:
            need -= decider.dispatch_group("rl")
        requests = [e for e in decider.out if isinstance(e, TaskRequested)]
        groups = await self.run_groups(requests)
        scored: list[SamplesScored] = []
        for request, traces in zip(requests, groups, strict=True):
            for event in outputs_for(request, traces):  # TraceCompleted: a train split
                assert isinstance(event, TraceCompleted)
                for algorithm in request.algorithms:
                    scorer = self.scorers[algorithm]
                    if (s := await scorer.step(event)) is not None:
                        scorer.done(s)
                        scored.append(s)
                        self.state.apply(s, skip_zero=self.skip_zero)
        queued = list(self.state.queues["rl"])
        samples = [q.sample for q in queued]
        batch = BatchAssembled(
            run=self.cfg.run or RUN,
            event_id=batch_id(self.cfg.run or RUN, self.state.assembled + 1),
            step=self.state.assembled + 1,
            samples=samples,
            policy_version=self.state.trainer_version,
            sources=sorted({x for q in queued for x in q.sources}),
            num_tokens=sum(len(s) for s in samples),
            skipped_zero_advantage=self.state.skipped_zero,
            phase="rl",
        )
        self.state.apply(batch)  # takes its samples off the queue
        return Rollouts(requests, [t for g in groups for t in g], scored, batch)

    def train(self, batch: BatchAssembled) -> dict[str, float]:
        self.core.model.train()
        metrics = self.core.train_step(batch)
        self.state.trainer_version = self.core.step
        return metrics

    async def step(self) -> dict[str, Any]:
        """One synchronous step: generate, score, train. Its record (module docstring)."""
        t0 = time.perf_counter()
        busy0 = self.backend.loop.stats.busy_s
        r = await self.rollouts()
        t1 = time.perf_counter()
        gen_s = self.backend.loop.stats.busy_s - busy0
        metrics = self.train(r.batch)
        t2 = time.perf_counter()
        first = {s.group_id: s for s in r.scored}  # every algorithm saw the same rewards
        rewards = [t.reward for t in r.traces]
        flat_groups = sum(flat(s.rewards) for s in first.values())
        return {
            "step": self.core.step,
            "gen_s": gen_s,
            "score_s": (t1 - t0) - gen_s,
            "train_s": t2 - t1,
            "step_s": t2 - t0,
            "completions": len(r.traces),
            "completion_tokens": sum(completion_tokens(t) for t in r.traces),
            "trained": len(r.batch.samples),
            "signal_completions": sum(
                len(s.rewards) for s in first.values() if not flat(s.rewards)
            ),
            "reward_mean": sum(rewards) / max(1, len(rewards)),
            "flat_group_share": flat_groups / max(1, len(first)),
            "filtered": sum(s.filtered for s in first.values()),
            "errors": sum(1 for t in r.traces if t.errors),
            "loss": metrics.get("loss", 0.0),
            "grad_norm": metrics["grad_norm"],
        }

    async def evaluate(self) -> dict[str, Any]:
        """avg@k of the current weights on the run's eval tasks (``rlbus eval``'s requests,
        the orchestrator's ``eval_metrics``)."""
        from roles.up.rollout import (
            build_requests,
            eval_envs,
            eval_tasks,
            plan_requests,
            split_size,
        )

        e = self.cfg.orchestrator.eval
        t0 = time.perf_counter()
        requests = []
        for env in eval_envs(self.cfg):
            tasks = eval_tasks(self.cfg, env)
            plan = plan_requests(self.cfg, env, "eval", tasks * e.k, e.k, POLICY)
            size = split_size(plan)
            plan.groups = min(plan.groups, size)
            requests += build_requests(
                self.cfg.run or RUN, self.cfg.seed, plan, size, self.core.step
            )
        groups = await self.run_groups(requests)
        results = [ev for r, g in zip(requests, groups, strict=True) for ev in outputs_for(r, g)]
        values = eval_metrics(results, e.k, self.core.step)
        return {"step": self.core.step, "eval_s": time.perf_counter() - t0, **values}

    async def close(self) -> None:
        await self.backend.close()
        if self._scratch is not None:
            self._scratch.cleanup()


# -- the loop and its summary ------------------------------------------------------------------


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Throughput over the steps (eval excluded) and where the wall time went."""
    wall = sum(r["step_s"] for r in records)
    parts = {k: sum(r[f"{k}_s"] for r in records) for k in ("gen", "score", "train")}

    def per_s(key: str) -> float:
        return sum(r[key] for r in records) / wall if wall else 0.0

    tail = records[-10:]
    return {
        "steps": len(records),
        "wall_s": wall,
        "s_per_step": wall / len(records) if records else 0.0,
        "s_per_step_median": statistics.median(r["step_s"] for r in records) if records else 0.0,
        "completions_per_s": per_s("completions"),
        "completions_trained_per_s": per_s("trained"),
        "signal_completions_per_s": per_s("signal_completions"),
        "completion_tokens_per_s": per_s("completion_tokens"),
        "split": {k: v / wall if wall else 0.0 for k, v in parts.items()},
        "split_s": parts,
        "flat_group_share": sum(r["flat_group_share"] for r in records) / max(1, len(records)),
        "reward_mean_last10": sum(r["reward_mean"] for r in tail) / max(1, len(tail)),
    }


def _line(r: dict[str, Any]) -> str:
    return (
        f"step {r['step']:4d}  {r['step_s']:.3f}s = gen {r['gen_s']:.3f} + score "
        f"{r['score_s']:.3f} + train {r['train_s']:.3f}  completions {r['completions']} "
        f"({r['completion_tokens']} tok)  reward {r['reward_mean']:.3f}  "
        f"flat groups {r['flat_group_share']:.2f}  grad {r['grad_norm']:.3f}"
    )


def _eval_line(values: dict[str, Any]) -> str:
    avgs = "  ".join(
        f"{k} {v:.4f}" for k, v in values.items() if "/avg@" in k and "stderr" not in k
    )
    return f"eval v{values['step']}: {avgs}  ({values['eval_s']:.1f}s)"


async def _run(
    cfg: RunConfig, start: Path | None, steps: int, threads: int, progress: bool,
    eval_every: int, skip_zero: bool,
) -> dict[str, Any]:  # fmt: skip
    loop = SyncGrpo(cfg, start, threads, skip_zero)
    records: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []

    async def evaluate() -> None:
        evals.append(await loop.evaluate())
        if progress:
            print(_eval_line(evals[-1]), flush=True)

    try:
        if eval_every:
            await evaluate()
        for n in range(1, steps + 1):
            records.append(await loop.step())
            if progress:
                print(_line(records[-1]), flush=True)
            if eval_every and (n % eval_every == 0 or n == steps):
                await evaluate()
    finally:
        await loop.close()
    c = loop.cfg
    entry = c.orchestrator.train.env[0]
    return {
        "setup": {
            "start": str(start) if start is not None else c.model.path,
            "start_step": loop.start_step,
            "threads": threads,
            "device": loop.core.device,
            "batch_size": c.orchestrator.batch_size,
            "envs": [e.id for e in c.orchestrator.train.env],
            "group_size": entry.group_size,
            "algorithms": sorted(loop.scorers),
            "skip_zero_groups": skip_zero,
            "weights": "shared: the engine generates with the trainer's model object",
        },
        # The first step pays one-time costs (first forward and backward passes: kernel
        # and allocator warm-up, up to seconds here), so the summary leaves it out.
        "summary": summarize(records[1:] if len(records) > 1 else records),
        "summary_with_first_step": summarize(records),
        "steps": records,
        "evals": evals,
    }


def run_sync_grpo(
    cfg: RunConfig,
    start: str | Path | None,
    steps: int,
    threads: int = 2,
    progress: bool = True,
    eval_every: int = 0,
    skip_zero: bool = False,
) -> dict[str, Any]:
    """Run ``steps`` synchronous steps from ``start`` (a checkpoint directory) or, when
    None, from ``model.path``; returns ``setup``, ``summary`` (``summarize`` of every
    step but the first, a warm-up), ``summary_with_first_step``, ``steps`` (one record
    per step) and ``evals`` (``eval_every`` > 0: avg@k at the start, every ``eval_every``
    steps and at the end)."""
    path = Path(start) if start is not None else None
    return asyncio.run(_run(cfg, path, steps, threads, progress, eval_every, skip_zero))


# -- command line -----------------------------------------------------------------------------


def resolve_start(spec: str, data_dir: Path) -> Path:
    """The checkpoint ``--start`` names: a checkpoint directory, a run directory with an
    optional ``:STEP``, else ``RUN[:STEP]`` under ``data_dir`` (newest without a step)."""
    from roles.cli.eval import is_checkpoint, run_checkpoint

    path = Path(spec).expanduser()
    if is_checkpoint(path):
        return path.resolve()
    head, sep, tail = spec.rpartition(":")
    base, step = (head, tail) if sep and tail.isdigit() else (spec, "")
    run_dir = Path(base).expanduser()
    if (run_dir / "checkpoints").is_dir():
        run_dir = run_dir.resolve()
        return run_checkpoint(run_dir.parent, run_dir.name + (f":{step}" if step else ""))
    return run_checkpoint(data_dir, spec)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    import typer

    from roles.cli.eval import checkpoint_source, own_config
    from roles.cli.rollout import load_cfg

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--start", help="checkpoint dir, run dir[:STEP] or RUN[:STEP]")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=0, help="avg@k every N steps (0: never)")
    p.add_argument("--skip-zero-groups", action="store_true", help="drop all-equal groups")
    p.add_argument("-c", "--config", help="preset or TOML (default: the start run's, else default)")
    p.add_argument("overrides", nargs="*", help="dotted.key=value")
    args = p.parse_args(argv)
    try:
        cfg = load_cfg(args.config or "default", args.overrides)
        start = None
        if args.start:
            start = resolve_start(args.start, Path(cfg.bus.data_dir))
            source = checkpoint_source(start)
            if args.config is None and source.config is not None:
                cfg = own_config(cfg, source.config, args.overrides)
    except typer.Exit as e:  # fail() has said why
        sys.exit(e.exit_code)
    out = run_sync_grpo(
        cfg, start, args.steps, args.threads, True, args.eval_every, args.skip_zero_groups
    )
    s = out["summary"]
    split = "  ".join(f"{k} {v:.0%}" for k, v in s["split"].items())
    print(
        f"{s['steps']} steps{' (first left out)' if len(out['steps']) > 1 else ''} "
        f"from {out['setup']['start']} (step {out['setup']['start_step']}): "
        f"{s['s_per_step']:.3f} s/step (median {s['s_per_step_median']:.3f}); "
        f"{s['completions_per_s']:.1f} completions/s generated, "
        f"{s['completions_trained_per_s']:.1f} trained, {s['signal_completions_per_s']:.1f} "
        f"with signal; wall: {split}"
    )
    print(f"results: {save('sync_grpo', out)}")
    return out


if __name__ == "__main__":
    main()
