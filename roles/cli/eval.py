"""``rlbus eval``: avg@k (± its standard error) and pass@k of a model on the eval split
of one or more envs.

    rlbus eval                                   # the config's eval envs, a fresh run, the tiny model
    rlbus eval --run demo                        # a live run's policy, with the run's own eval settings
    rlbus eval --checkpoint demo:200             # run demo's checkpoint of step 200, its eval settings
    rlbus eval -m runs/demo/checkpoints/step-00000200 -n 64 -k 8
    rlbus eval -m ./my-hf-model -c default --env reverse-text --out report.json
    rlbus eval --env reverse-text --env alphabet-sort -n 64 -k 4 --json
    rlbus eval -m teacher orchestrator.eval.sampling.temperature=1.0
    rlbus eval --run demo --resume               # an interrupted eval of run demo, continued

It evaluates the way a run's own eval does: ``k`` samples of each of the first ``n``
tasks of each env's eval split (at most the split's size), with the orchestrator's eval
seeds and sampling (``orchestrator.eval.*``), scored by the orchestrator's
``eval_metrics``. The defaults come from the config: envs ``orchestrator.eval.env``
(empty: the train envs; each with its own task count and sampling), ``n`` = each env's
``num_tasks``, ``k`` = ``k``. The config is ``-c``,
else the config of the run the model comes from (``--run R``, or the run of a
checkpoint), else the smoke preset.

What is evaluated (``--model``/``-m``, ``--checkpoint``; ``model_source``):

- a model key, ``policy`` (default) or a key of ``orchestrator.models``: served as a run
  serves it. Against a live run (``--run R`` with its roles up) the run's inference
  answers with its current weights; otherwise what is missing is started as
  ``rlbus rollout`` does (the embedded nats-server, an inference and an env role
  process per env) and stopped afterwards;
- a model directory: a Hugging Face one (``config.json``), or a run's trainer
  checkpoint (``<run>/checkpoints/step-N``: ``model.safetensors`` + ``state.json``),
  which is written out as a loadable directory (the run's initial model's config and
  tokenizer, the checkpoint's weights, as ``rlbus model export`` does) under the eval
  run's ``model/``; ``--checkpoint RUN[:STEP]`` names the same by run and step (newest
  without a step). The eval then has a run of its own (``--run`` must be new) whose
  policy is that directory (``model.path``), served as weights v0.

The eval's requests carry the run's newest weights version, and inference holds that
version for the eval's generate requests (``inference.eval_pin_*``), so the figures are
those version's; ``answered by`` says which versions answered, and the share answered
wholly by the pinned one. The requests and their answers go on the run's log (phase
``adhoc``; a live orchestrator keeps them out of the run's eval, ``roles.up.rollout``),
and so do the figures, as ``metrics.reported.eval-adhoc`` (``rlbus sql``: the
``rollouts`` and ``metrics`` tables). The JSON report is written to ``--out`` or
``<run dir>/eval-<UTC time>.json``; stdout gets a table (or the JSON with ``--json``).
pass@k is ``-`` (null) when an env's rewards are not all 0 or 1, as in a run's eval.

Each task's answer is written to the eval's journal as it comes (``journal_path``: next
to ``--out``, else ``<run dir>/eval.tasks.jsonl``; ``roles.up.eval_journal`` says what it
is keyed on), and ``--resume`` continues an interrupted eval of ``--run`` from it: only
the tasks without an answer are asked (again under their first request ids), and the
report is the one an uninterrupted eval gives. A resume with other settings exits 2 with
one line naming the first setting that differs.
Exit 0; 1 when a started role died or the wait timed out; 2 for a bad option, config,
model or env. Registered in the app by ``roles.cli`` (``app.command("eval")(evaluate)``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from roles.cli.common import fail
from roles.cli.rollout import collect, load_cfg, split_sizes

if TYPE_CHECKING:
    from configs import RunConfig
    from roles.up.rollout import Plan, RolloutResult

# The key of the figures an ad-hoc eval publishes (``metrics.reported.<role>``); a run's
# own are "eval", which its orchestrator refuses from anyone else.
REPORT_ROLE = "eval-adhoc"


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
    model: str = typer.Option(
        "policy",
        "--model",
        "-m",
        help="Model key (policy, a key of orchestrator.models) or a model directory: "
        "Hugging Face, or a run's checkpoint (<run>/checkpoints/step-N).",
    ),  # fmt: skip
    checkpoint: str | None = typer.Option(
        None, "--checkpoint", help="RUN[:STEP]: that run's checkpoint (default: its newest)."
    ),
    config: str | None = typer.Option(
        None, "--config", "-c", help="Preset or TOML file (default: the run's, else smoke)."
    ),
    run: str | None = typer.Option(None, "--run", "-r", help="Run id (default: a new one)."),
    nats_url: str | None = typer.Option(None, "--nats-url", help="Use this NATS server."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for every rollout."),
    out: Path | None = typer.Option(
        None, "--out", "-o", help="JSON report file (default: <run dir>/eval-<time>.json)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the JSON report."),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue the run's interrupted eval: ask only the tasks its "
        "journal has no answer of (same settings needed).",
    ),
) -> None:
    """avg@k ± stderr and pass@k on the eval split of envs: a live run's policy, a model
    directory or a run's checkpoint."""
    from configs.paths import RunPaths
    from roles.up.eval_journal import EvalJournal, JournalMismatch, eval_settings
    from roles.up.rollout import eval_envs, eval_tasks, plan_requests

    if resume and run is None:
        fail("error: --resume needs --run RUN, the run of the interrupted eval")
    cfg = run_config(config, run, overrides or [])
    source = model_source(cfg, model, checkpoint)
    if source.dir is not None and config is None and source.config is not None:
        cfg = own_config(cfg, source.config, overrides or [])
    # A directory gets a run of its own: never the run id its checkpoint's config names.
    cfg.run = run_id = (
        run or (cfg.run if source.dir is None else None)
        or time.strftime("eval-%Y%m%d-%H%M%S", time.gmtime())
    )  # fmt: skip
    k = cfg.orchestrator.eval.k if k is None else k
    if (tasks is not None and tasks < 1) or k < 1:
        fail("error: -n and -k must be >= 1")
    paths = RunPaths.of(cfg)
    if source.dir is not None and paths.dir.exists() and not resume:
        fail(f"error: a model directory is evaluated in a run of its own; run {cfg.run!r} exists")
    names = list(dict.fromkeys(envs or eval_envs(cfg)))
    # -n, else each env's own count (its `orchestrator.eval.env` entry's, else num_tasks).
    plans = [
        plan_requests(cfg, env, "eval", (tasks or eval_tasks(cfg, env)) * k, k, source.key)
        for env in names
    ]
    sizes = split_sizes(plans)
    plans = [replace(p, groups=min(p.groups, size)) for p, size in zip(plans, sizes, strict=True)]
    settings = eval_settings(plans, k, source.label)
    where = journal_path(out, paths.dir)
    try:
        journal = (EvalJournal.resume if resume else EvalJournal.start)(where, settings)
    except JournalMismatch as e:
        fail(f"error: --resume: {e}")
    if resume:
        typer.echo(f"resuming: {len(journal.answers)} task(s) answered in {where}", err=True)
    if source.dir is not None:
        cfg.model.path = str(served_dir(source, paths.dir / "model", cfg.model.path))

    def figures(result: RolloutResult) -> list[Any]:
        return [eval_event(run_id, result, k)]

    result = collect(cfg, plans, sizes, nats_url, timeout, "eval", figures, journal)
    if not result.role_died:
        report = eval_report(cfg, plans, result, k, source)
        path = out or paths.dir / time.strftime("eval-%Y%m%d-%H%M%S.json", time.gmtime())
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        typer.echo(f"report: {path}", err=True)
        typer.echo(json.dumps(report) if as_json else render(report))
        # Lake rows: the requests, rollouts and figures, for `rlbus sql --run <eval run>`.
        from roles.cli.lake import sync_before_query

        sync_before_query(cfg.run, paths.data_dir, nats_url, named=False)
        typer.echo(f"lake: {paths.lake}  (rlbus sql --run {cfg.run} ...)", err=True)
    raise typer.Exit(result.code)


def journal_path(out: Path | None, run_dir: Path) -> Path:
    """Where an eval records each task's answer as it comes (``roles.up.eval_journal``):
    next to ``--out`` (``report.json`` -> ``report.tasks.jsonl``), else the run's
    ``eval.tasks.jsonl``; ``--resume`` reads it back."""
    if out is None:
        return run_dir / "eval.tasks.jsonl"
    return out.with_name(out.stem + ".tasks.jsonl")


def run_config(config: str | None, run: str | None, overrides: list[str]) -> RunConfig:
    """``-c``; else the run's ``config.toml`` (a run's eval settings are its own), in the
    data directory the overrides and environment choose; else the smoke preset."""
    from configs.paths import RunPaths

    cfg = load_cfg(config or "smoke", overrides)
    own = RunPaths(Path(cfg.bus.data_dir), run).config if run and config is None else None
    if own is None or not own.exists():
        return cfg
    return own_config(cfg, own, overrides)


def own_config(cfg: RunConfig, path: Path, overrides: list[str]) -> RunConfig:
    """The run config at ``path`` with the overrides, in ``cfg``'s data directory."""
    data_dir = cfg.bus.data_dir
    cfg = load_cfg(str(path), overrides)
    cfg.bus.data_dir = data_dir
    return cfg


# -- what is evaluated ---------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSource:
    """What ``--model``/``--checkpoint`` name: a served model key, a Hugging Face model
    directory, or a trainer checkpoint (``dir``, with its step and run)."""

    key: str  # the inference model key that acts ("policy" for a directory)
    dir: Path | None = None  # a Hugging Face directory or a trainer checkpoint
    checkpoint_step: int | None = None  # a checkpoint's step (None: not a checkpoint)
    run_dir: Path | None = None  # the run a checkpoint belongs to
    config: Path | None = None  # that run's config.toml, when it has one

    @property
    def label(self) -> str:
        return self.key if self.dir is None else str(self.dir)


def model_source(cfg: RunConfig, model: str, checkpoint: str | None) -> ModelSource:
    """Resolve ``--model``/``--checkpoint``: a model key first, then a directory; one
    line and exit 2 for anything else."""
    from configs.orchestrator import POLICY

    if checkpoint is not None:
        if model != POLICY:
            fail("error: --model and --checkpoint both name a model; give one")
        return checkpoint_source(run_checkpoint(Path(cfg.bus.data_dir), checkpoint))
    if model == POLICY or model in cfg.orchestrator.models:
        return ModelSource(model)
    path = Path(model).expanduser()
    if not path.is_dir():
        fail(
            f"error: --model {model!r} is neither policy, a key of orchestrator.models "
            f"({', '.join(sorted(cfg.orchestrator.models)) or 'none'}) nor a model directory"
        )
    if is_checkpoint(path):
        return checkpoint_source(path)
    if not (path / "config.json").exists():
        fail(
            f"error: --model {model}: a directory with neither config.json (a Hugging Face "
            "model) nor model.safetensors and state.json (a trainer checkpoint)"
        )
    return ModelSource(POLICY, dir=path.resolve())


def is_checkpoint(path: Path) -> bool:
    """A trainer checkpoint directory (``roles.trainer.core.save_checkpoint``)."""
    return (path / "model.safetensors").is_file() and (path / "state.json").is_file()


def checkpoint_source(path: Path) -> ModelSource:
    """A checkpoint ``<run>/checkpoints/step-N``, with its run and the run's config."""
    from configs.orchestrator import POLICY
    from configs.paths import CHECKPOINT_PREFIX

    path = path.resolve()
    if path.parent.name != "checkpoints":
        fail(f"error: checkpoint {path} is not in a run's checkpoints/ directory, so its "
             "run's config and tokenizer are unknown: export it with `rlbus model export`")  # fmt: skip
    name = path.name.removeprefix(CHECKPOINT_PREFIX)
    state = json.loads((path / "state.json").read_text())
    step = int(state.get("step", name if name.isdigit() else 0))
    run_dir = path.parent.parent
    own = run_dir / "config.toml"
    return ModelSource(
        POLICY, dir=path, checkpoint_step=step, run_dir=run_dir,
        config=own if own.exists() else None,
    )  # fmt: skip


def run_checkpoint(data_dir: Path, spec: str) -> Path:
    """``RUN[:STEP]`` as a checkpoint directory under ``data_dir`` (newest without STEP)."""
    from configs.paths import CHECKPOINT_PREFIX, RunPaths

    name, _, step = spec.partition(":")
    if step and not step.isdigit():
        fail(f"error: --checkpoint {spec!r}: STEP must be a number (RUN[:STEP])")
    paths = RunPaths(data_dir, name)
    found = {
        int(p.name.removeprefix(CHECKPOINT_PREFIX)): p
        for p in paths.checkpoints.glob(f"{CHECKPOINT_PREFIX}*")
        if p.name.removeprefix(CHECKPOINT_PREFIX).isdigit() and is_checkpoint(p)
    }
    if not found:
        fail(f"error: --checkpoint {spec!r}: no checkpoint under {paths.checkpoints}")
    if step and int(step) not in found:
        fail(
            f"error: --checkpoint {spec!r}: {missing_step(int(step), sorted(found), paths.config)}"
        )
    return found[int(step) if step else max(found)]


def missing_step(step: int, kept: list[int], config: Path) -> str:
    """Why a run has no checkpoint of ``step``, in a phrase: the steps it kept and the keys
    that keep more, with the run's values when its ``config`` reads
    (``roles.trainer.core.checkpoints_to_delete`` is the rule)."""
    from configs import ConfigError, load_config

    try:
        t = load_config(str(config)).trainer if config.exists() else None
    except ConfigError:
        t = None

    def key(name: str) -> str:
        return f"trainer.{name}" + ("" if t is None else f" ({getattr(t, name)})")

    return (
        f"no step {step} (kept: {', '.join(map(str, kept))}): the trainer writes a checkpoint "
        f"every {key('checkpoint_interval')} steps and keeps the newest "
        f"{key('keep_checkpoints')} and each step that is a multiple of "
        f"{key('checkpoint_keep_every')}; set them for a run to keep more"
    )


def served_dir(source: ModelSource, models: Path, base_path: str) -> Path:
    """The directory inference loads: a Hugging Face one as it is; a checkpoint written
    out under ``models`` with the config and tokenizer files of its run's initial model
    (the tiny model built under the run), else of ``base_path`` (the run's ``model.path``)."""
    assert source.dir is not None
    if source.checkpoint_step is None or source.run_dir is None:
        return source.dir
    from configs.paths import RunPaths

    base = RunPaths.at(source.run_dir).initial_model
    if not (base / "config.json").exists():
        base = Path(base_path).expanduser()
    if not (base / "config.json").exists():
        fail(f"error: checkpoint {source.dir}: no initial model of its run at {base} to "
             "take the config and tokenizer from")  # fmt: skip
    from roles.lib.model.weights import write_checkpoint_model

    target = models / f"{source.run_dir.name}-{source.dir.name}"
    write_checkpoint_model(source.dir, base, target)
    return target


# -- the report ----------------------------------------------------------------------------


def eval_event(run: str, result: RolloutResult, k: int) -> Any:
    """The figures as ``metrics.reported.eval-adhoc`` (step = the version asked at). Its
    id derives from the answers' request ids, so a resume of a finished eval
    (``--resume``, nothing left to ask) republishes the same event, which is dropped."""
    from roles.orchestrator.eval_stats import eval_metrics
    from schemas import MetricsReported, derive_id

    values = eval_metrics(list(result.results), k, result.policy_version)
    return MetricsReported(
        run=run, event_id=derive_id(REPORT_ROLE, *sorted(r.request_id for r in result.results)),
        role=REPORT_ROLE, step=result.policy_version, policy_version=result.policy_version,
        values=values,
    )  # fmt: skip


def eval_report(
    cfg: RunConfig, plans: list[Plan], result: RolloutResult, k: int, source: ModelSource
) -> dict[str, Any]:
    """The JSON object: what was evaluated, how, and the scores per env."""
    from roles.orchestrator.eval_stats import answering_versions
    from roles.up.rollout import eval_scores

    sampling = plans[0].sampling
    report: dict[str, Any] = {
        "run": cfg.run,
        "model": source.label,
        "k": k,
        "temperature": sampling.temperature,
        "max_completion_tokens": sampling.max_completion_tokens,
        "seed": cfg.seed if plans[0].seed is None else plans[0].seed,
        "pinned_version": result.policy_version,
        "policy_versions": answering_versions(result.traces),
        "rollouts": len(result.traces),
        "wall_s": round(result.wall_s, 1),
        "envs": eval_scores(plans, result, k),
    }
    if source.checkpoint_step is not None:
        report["checkpoint"] = {
            "run": source.run_dir.name if source.run_dir else None,
            "step": source.checkpoint_step,
            "path": str(source.dir),
        }
    return report


def render(report: dict[str, Any]) -> str:
    """The table: a header line, then env | tasks | k | avg@k ± stderr | pass@k | errors |
    answered by (versions, and the share answered wholly by the pinned one)."""
    k, versions = report["k"], report["policy_versions"]
    weights = f" (weights v{', v'.join(map(str, versions))})" if versions else ""
    if ckpt := report.get("checkpoint"):
        weights = f" (step {ckpt['step']} of run {ckpt['run']}, served as v0)"
    lines = [
        f"eval of run {report['run']}: model {report['model']}{weights}, k {k}, "
        f"temperature {report['temperature']}, {report['rollouts']} rollouts "
        f"in {report['wall_s']:.1f}s",
    ]
    rows = [["env", "tasks", "k", f"avg@{k} ± stderr", f"pass@{k}", "errors", "answered by"]]
    for env, s in report["envs"].items():
        avg = _num(s[f"avg@{k}"]) + (f" ± {s[f'avg@{k}_stderr']:.4f}" if s[f"avg@{k}_stderr"] is not None else "")  # fmt: skip
        rows.append([env, str(s["tasks"]), str(k), avg, _num(s[f"pass@{k}"]), str(s["errors"]), _answered(s, report["pinned_version"])])  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:-1], widths[1:-1], strict=True)] + [r[-1]]  # fmt: skip
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def _answered(scores: dict[str, Any], pinned: int) -> str:
    """The versions that answered, and the share answered wholly by the pinned one when
    that is not all of them."""
    versions = ", ".join(f"v{v}" for v in scores["policy_versions"]) or "-"
    share = scores["answered_by_pinned"]
    return versions if share in (None, 1.0) else f"{versions} ({share:.0%} wholly by v{pinned})"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
