"""``rlbus eval``: avg@k and pass@k of a model on the eval split of one or more envs.

    rlbus eval                                   # the config's eval envs, a fresh run, the tiny model
    rlbus eval --run demo                        # a live run's policy, with the run's own eval settings
    rlbus eval --env reverse-text --env alphabet-sort -n 64 -k 4 --json
    rlbus eval -m teacher orchestrator.eval.sampling.temperature=1.0

It evaluates the way a run's own eval does: ``k`` samples of each of the first ``n``
tasks of each env's eval split (at most the split's size), with the orchestrator's eval
seeds and sampling (``orchestrator.eval.*``), scored by the orchestrator's
``eval_metrics``. The defaults come from the config: envs ``orchestrator.eval.envs``
(empty: the train envs), ``n`` = ``num_tasks``, ``k`` = ``k``. The config is ``-c``, else
the run's ``config.toml`` when ``--run`` names a run that has one, else the smoke preset.

Against a live run (``--run R`` with its roles up) the run's inference answers, with its
current policy weights; otherwise it starts what is missing as ``rlbus rollout`` does
(the embedded nats-server, an inference and an env role process per env) and stops it
afterwards. The requests and their answers go on the run's log; a live orchestrator
keeps them out of the run's eval (``roles.up.rollout``). Output: one row per env (tasks,
avg@k, pass@k, errors: rollouts with an error), or one JSON object with ``--json``.
pass@k is ``-`` (null) when an env's rewards are not all 0 or 1, as in a run's eval.
Exit 0; 1 when a started role died or the wait timed out; 2 for a bad option, config or
env. Registered in the app by ``roles.cli`` (``app.command("eval")(evaluate)``).
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from roles.cli.common import fail
from roles.cli.rollout import collect, load_cfg, split_sizes

if TYPE_CHECKING:
    from configs import RunConfig
    from roles.up.rollout import Plan, RolloutResult


def evaluate(
    overrides: list[str] = typer.Argument(
        None, help="Config overrides, dotted: orchestrator.eval.sampling.temperature=1.0"
    ),
    envs: list[str] | None = typer.Option(
        None, "--env", "-e", help="Env id (repeat for more); default: the config's eval envs."
    ),
    tasks: int | None = typer.Option(
        None, "-n", "--tasks", help="Tasks per env (default: orchestrator.eval.num_tasks)."
    ),
    k: int | None = typer.Option(
        None, "-k", help="Samples per task (default: orchestrator.eval.k)."
    ),
    model: str = typer.Option("policy", "--model", "-m", help="Inference model that acts."),
    config: str | None = typer.Option(
        None, "--config", "-c", help="Preset or TOML file (default: the run's, else smoke)."
    ),
    run: str | None = typer.Option(None, "--run", "-r", help="Run id (default: a new one)."),
    nats_url: str | None = typer.Option(None, "--nats-url", help="Use this NATS server."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for every rollout."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """avg@k and pass@k on the eval split of envs (a live run's policy, or what it starts)."""
    from configs.orchestrator import POLICY
    from roles.up.rollout import eval_envs, plan_requests

    cfg = run_config(config, run, overrides or [])
    cfg.run = run or cfg.run or time.strftime("eval-%Y%m%d-%H%M%S", time.gmtime())
    n = cfg.orchestrator.eval.num_tasks if tasks is None else tasks
    k = cfg.orchestrator.eval.k if k is None else k
    if n < 1 or k < 1:
        fail("error: -n and -k must be >= 1")
    if model != POLICY and model not in cfg.orchestrator.models:
        fail(f"error: --model {model!r} is neither policy nor a key of orchestrator.models")
    names = list(dict.fromkeys(envs or eval_envs(cfg)))
    plans = [plan_requests(cfg, env, "eval", n * k, k, model) for env in names]
    sizes = split_sizes(plans)
    plans = [replace(p, groups=min(p.groups, size)) for p, size in zip(plans, sizes, strict=True)]
    result = collect(cfg, plans, sizes, nats_url, timeout, "eval")
    if not result.role_died:
        report = eval_report(cfg, plans, result, k)
        typer.echo(json.dumps(report) if as_json else render(report))
    raise typer.Exit(result.code)


def run_config(config: str | None, run: str | None, overrides: list[str]) -> RunConfig:
    """``-c``; else the run's ``config.toml`` (a run's eval settings are its own), in the
    data directory the overrides and environment choose; else the smoke preset."""
    from configs.paths import RunPaths

    cfg = load_cfg(config or "smoke", overrides)
    own = RunPaths(Path(cfg.bus.data_dir), run).config if run and config is None else None
    if own is None or not own.exists():
        return cfg
    data_dir = cfg.bus.data_dir
    cfg = load_cfg(str(own), overrides)
    cfg.bus.data_dir = data_dir
    return cfg


def eval_report(cfg: RunConfig, plans: list[Plan], result: RolloutResult, k: int) -> dict[str, Any]:
    """The JSON object: what was evaluated, how, and the scores per env."""
    from roles.up.rollout import eval_scores
    from schemas.arrays import mask

    sampling = plans[0].sampling
    versions = {
        m.policy_version for t in result.traces for m in t.messages if mask(m.sampled).any()
    }
    return {
        "run": cfg.run,
        "model": plans[0].model,
        "k": k,
        "temperature": sampling.temperature,
        "max_completion_tokens": sampling.max_completion_tokens,
        "policy_versions": sorted(versions),
        "rollouts": len(result.traces),
        "wall_s": round(result.wall_s, 1),
        "envs": eval_scores(plans, result.results, k),
    }


def render(report: dict[str, Any]) -> str:
    """The table: a header line, then env | tasks | avg@k | pass@k | errors."""
    k, versions = report["k"], report["policy_versions"]
    weights = f" (weights v{', v'.join(map(str, versions))})" if versions else ""
    lines = [
        f"eval of run {report['run']}: model {report['model']}{weights}, k {k}, "
        f"temperature {report['temperature']}, {report['rollouts']} rollouts "
        f"in {report['wall_s']:.1f}s",
    ]
    rows = [["env", "tasks", f"avg@{k}", f"pass@{k}", "errors"]]
    for env, s in report["envs"].items():
        rows.append([env, str(s["tasks"]), _num(s[f"avg@{k}"]), _num(s[f"pass@{k}"]), str(s["errors"])])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True)]  # fmt: skip
        lines.append("  ".join(cells))
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
