"""``rlbus rollout``: run N rollouts of one environment against a model and show them.

    rlbus rollout --env reverse-text -n 32 --group-size 8
    rlbus rollout --env alphabet-sort -n 4 -g 2 orchestrator.train.sampling.max_completion_tokens=40
    rlbus rollout --env examples.word_count_env:make_env -n 8 -g 4
    rlbus rollout --run demo --split eval -n 8 -g 1     # against a live run's roles

It starts only what is not running already: an embedded nats-server under
``<data_dir>/<run>/nats`` (unless ``--nats-url`` or the run's server is up), the tiny
model (built once under the run directory), one ``rlbus role inference --model <model>``
and one ``rlbus role env --env <env>`` process (``--config`` = the resolved config
written to ``<run>/config.toml``; logs in ``<run>/logs/<name>.log``). A role counts as
running when its heartbeat in the role registry is fresh. Then it publishes
``ceil(n / group_size)`` ``TaskRequested`` events (tasks 0, 1, ... of the split, seeds
derived from the run seed; ``--split eval`` asks as ``rlbus eval`` does, see
``roles.up.rollout``), follows ``trace.completed.<env>`` (``eval.completed.<env>`` for
``--split eval``) for their results, prints a summary and one rendered trace, and stops
what it started (SIGTERM, then waits for the drain).

The work itself (planning, the requests, starting and stopping the missing roles,
collecting the traces) is ``roles.up.rollout``; this module is the command and its
output, and the steps ``rlbus eval`` (``roles/cli/eval.py``) shares with it: loading the
config, sizing the env splits, and collecting with a progress bar
(``roles.cli.progress``: rollouts done / expected). Registered in the app by
``roles.cli`` (``app.command("rollout")(rollout)``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import typer

from roles.cli.common import fail, run_option

if TYPE_CHECKING:
    from configs import RunConfig
    from roles.up.eval_journal import EvalJournal
    from roles.up.rollout import Plan, Report, RolloutResult


def rollout(
    overrides: list[str] = typer.Argument(
        None, help="Config overrides, dotted: bus.data_dir=/tmp/r"
    ),
    env: str = typer.Option(
        "reverse-text", "--env", "-e", help="Env id: built-in name or module:function."
    ),
    n: int = typer.Option(32, "-n", help="Rollouts in all (rounded up to whole groups)."),
    group_size: int = typer.Option(8, "--group-size", "-g", help="Rollouts per task."),
    config: str = typer.Option("smoke", "--config", "-c", help="Preset name or TOML file."),
    nats_url: str | None = typer.Option(None, "--nats-url", help="Use this NATS server."),
    run: str | None = run_option(None, "Run id (default: a new one)."),
    split: str = typer.Option("train", "--split", help="train or eval."),
    model: str = typer.Option("policy", "--model", "-m", help="Inference model that acts."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for every trace."),
) -> None:
    """Run N rollouts of one env (starting NATS, inference and the env server if needed)."""
    from roles.up.rollout import plan_requests

    if split not in ("train", "eval"):
        raise typer.BadParameter("--split must be train or eval")
    if n < 1 or group_size < 1:
        raise typer.BadParameter("-n and --group-size must be >= 1")
    cfg = load_cfg(config, overrides or [])
    cfg.run = run or cfg.run or time.strftime("rollout-%Y%m%d-%H%M%S", time.gmtime())
    plan = plan_requests(cfg, env, split, n, group_size, model)
    sizes = split_sizes([plan])
    result = collect(cfg, [plan], sizes, nats_url, timeout, f"rollout {plan.env}")
    if not result.role_died:
        print_summary(plan, result.traces, result.wall_s)
        if result.traces:
            print_trace(pick_trace(result.traces), cfg, cfg.run, plan.model)
    raise typer.Exit(result.code)


# -- the steps `rlbus eval` shares ----------------------------------------------------------


def load_cfg(config: str, overrides: list[str]) -> RunConfig:
    """The preset or TOML file with the overrides, its data directory settled."""
    from configs import ConfigError, load_config
    from configs.paths import settle_data_dir

    try:
        return settle_data_dir(load_config(config, overrides), overrides)
    except ConfigError as e:
        fail(f"config error: {e}")


def split_sizes(plans: Sequence[Plan]) -> list[int]:
    """Tasks in each plan's split, checking that every env can be made (exit 2 if not)."""
    from roles.up.rollout import split_size

    try:
        return [split_size(p) for p in plans]
    except (ValueError, TypeError) as e:  # UnknownEnv is a ValueError
        fail(f"env error: {e}")


def collect(
    cfg: RunConfig,
    plans: Sequence[Plan],
    sizes: Sequence[int],
    nats_url: str | None,
    timeout_s: float,
    label: str,
    report: Report | None = None,
    journal: EvalJournal | None = None,
) -> RolloutResult:
    """Write the run's config, reach its server (starting one on its store if none runs),
    ask for ``plans``' rollouts and collect them, with progress, and publish what
    ``report`` makes of them (``run_rollouts``; an eval's answers also to its
    ``journal``); Ctrl-C exits 130, a resume whose run moved on exits 2."""
    from bus.server import reachable_server
    from configs.paths import RunPaths
    from roles.cli.progress import progress
    from roles.up.eval_journal import JournalMismatch
    from roles.up.rollout import build_requests, run_rollouts, write_config

    paths = RunPaths.of(cfg)
    config_path = write_config(cfg, paths)  # never rewrites a live run's config
    requests = [
        r
        for plan, size in zip(plans, sizes, strict=True)
        for r in build_requests(paths.run, cfg.seed, plan, size)
    ]

    def note(text: str) -> None:
        typer.echo(text, err=True)

    # --nats-url, $RLBUS_NATS_URL, the run's running server, or one started on its store.
    with reachable_server(paths.nats, nats_url, start="always", identity="launcher") as url:
        assert url is not None
        try:
            with progress(label, sum(p.total for p in plans), "rollouts") as update:
                return asyncio.run(
                    run_rollouts(
                        cfg,
                        plans,
                        requests,
                        paths,
                        url,
                        config_path,
                        timeout_s,
                        note,
                        update,
                        report,
                        journal,
                    )  # fmt: skip
                )
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        except JournalMismatch as e:
            fail(f"error: --resume: {e}")


# -- output -------------------------------------------------------------------------------


def print_summary(plan: Plan, traces: list[Any], wall_s: float) -> None:
    from roles.up.rollout import summarize

    s = summarize(traces)
    errors = ", ".join(f"{k}: {v}" for k, v in s["errors"].items()) or "none"
    typer.echo(
        f"env {plan.env}  split {plan.split}  model {plan.model}  "
        f"groups {plan.groups} x {plan.group_size}"
    )
    typer.echo(f"rollouts: {s['rollouts']}")
    typer.echo(f"mean reward: {s['reward_mean']:.4f}")
    typer.echo(
        f"mean completion tokens: {s['completion_tokens_mean']:.1f}  (truncated: {s['truncated']})"
    )
    typer.echo(f"errors: {errors}")
    stopped = ", ".join(f"{k}: {v}" for k, v in s["stopped"].items()) or "none recorded"
    typer.echo(f"stopped: {stopped}")
    typer.echo(f"wall time: {wall_s:.1f}s  ({s['rollouts'] / max(wall_s, 1e-9):.2f} rollouts/s)")


def pick_trace(traces: list[Any]) -> Any:
    """The trace to show: the first without errors (by request, then sample index)."""
    ordered = sorted(traces, key=lambda t: (t.group_id, t.sample_index))
    return next((t for t in ordered if t.ok), ordered[0])


def _token_texts(ids: list[int], cfg: Any, run: str, model: str) -> list[str]:
    """Token strings for display; token ids when the tokenizer cannot be loaded."""
    try:
        endpoint = cfg.orchestrator.models.get(model)
        path = endpoint.path if endpoint is not None and endpoint.path else cfg.model.path
        if path == "tiny":  # the tiny model's tokenizer needs no files
            from roles.lib.model.tokenizer import build_tokenizer

            tokenizer = build_tokenizer()
        else:
            from roles.lib.model.loading import load_tokenizer

            tokenizer = load_tokenizer(path)
        return [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
    except Exception:  # noqa: BLE001 - display only
        return [f"#{i}" for i in ids]


def print_trace(trace: Any, cfg: Any, run: str, model: str) -> None:
    from schemas.arrays import f32, i32, mask

    typer.echo(
        f"\n--- trace {trace.rollout_id[:12]} (task {trace.task.split}/{trace.task.index}, "
        f"sample {trace.sample_index}, reward {trace.reward:.4f}, turns {trace.num_turns}) ---"
    )
    if trace.rewards or trace.metrics:
        typer.echo(f"rewards {trace.rewards}  metrics {trace.metrics}")
    for e in trace.errors:
        typer.echo(f"error {e.kind}: {e.message}")
    for m in trace.messages:
        typer.echo(f"[{m.role}{':' + m.name if m.name else ''}] {m.content!r}")
        sampled = mask(m.sampled)
        if not sampled.any():
            continue
        ids = i32(m.token_ids)[sampled].tolist()
        lps = f32(m.logprobs)[sampled].tolist()
        texts = _token_texts(ids, cfg, run, model)
        typer.echo(
            f"    completion ({len(ids)} tokens, policy v{m.policy_version}, T={m.temperature}):"
        )
        typer.echo("    " + "  ".join(f"{t!r}:{lp:.2f}" for t, lp in zip(texts, lps, strict=True)))
