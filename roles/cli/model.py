"""``rlbus model ...``: build a local model (no hub needed), export a run's policy."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="Local models.", no_args_is_help=True)


@app.command("init")
def init(
    out: Path | None = typer.Option(
        None,
        "--out",
        "-o",
        help="Directory to write the model to (default: <data dir>/model/tiny).",
    ),
    seed: int = typer.Option(0, help="Initialisation seed: same seed, same bytes."),
    config: str = typer.Option(
        "default", "--config", "-c", help="Preset or TOML whose [model.tiny] sizes to use."
    ),
    arch: str = typer.Option(
        "tiny",
        "--arch",
        help="tiny (character tokenizer, Llama-style), or a family with a BPE tokenizer "
        "and chat template: qwen3, llama.",
    ),
    size: str = typer.Option("tiny", "--size", help="A family model's size: tiny or small."),
) -> None:
    """Build a model in Hugging Face layout: the tiny char model, or a Qwen3 / Llama
    model with random weights, a BPE tokenizer trained here and the family's chat
    template (use it as `model.path`)."""
    from configs import load_config
    from configs.paths import resolve_data_dir
    from roles.lib.model.families import FAMILIES, SIZES, build_family_model
    from roles.lib.model.tiny import init_model, summarize

    if arch != "tiny" and arch not in FAMILIES:
        raise typer.BadParameter(f"expected tiny or one of {sorted(FAMILIES)}", param_hint="--arch")
    if size not in SIZES:
        raise typer.BadParameter(f"expected one of {sorted(SIZES)}", param_hint="--size")
    cfg = load_config(config)
    out = out or resolve_data_dir(configured=cfg.bus.data_dir) / "model" / arch
    if arch == "tiny":
        tiny = cfg.model.tiny.model_dump(exclude={"init_seed", "arch", "vocab_size"})
        summary = init_model(out, seed=seed, **tiny)
    else:
        summary = summarize(build_family_model(out, arch, size=size, seed=seed), seed)
    typer.echo(json.dumps(summary, indent=2, default=str))


@app.command("export")
def export(
    run: str = typer.Option(..., "--run", "-r", help="Run id whose trained policy to export."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory to write the model to."),
    step: int | None = typer.Option(None, "--step", help="Checkpoint step (default: newest)."),
    data_dir: Path = typer.Option(
        None, "--data-dir", help="Runs directory (default: $RLBUS_DATA_DIR or runs)."
    ),
) -> None:
    """Write a run's checkpoint as a loadable model directory (Hugging Face layout).

    The config and tokenizer files come from the run's initial model (the tiny model it
    built, or its ``model.path``), the weights from
    the checkpoint (a LoRA run's adapters merged into them): use it as `[orchestrator.models.<key>] path` (a reference for opd, a
    teacher) or as `model.path` of a new run.
    """
    from roles.cli.common import local_runs, no_run, run_paths
    from roles.lib.model.weights import write_checkpoint_model
    from roles.trainer.core import latest_checkpoint

    paths = run_paths(run, data_dir)
    if not paths.dir.is_dir():
        no_run(run, f"no run directory {paths.dir}", local_runs(data_dir))
    initial = paths.initial_model
    if not (initial / "config.json").exists() and (paths.dir / "config.toml").exists():
        from configs import load_config

        initial = Path(load_config(str(paths.dir / "config.toml")).model.path)  # model.path
    if not (initial / "config.json").exists():
        raise typer.BadParameter(f"no initial model at {initial} (the run's model.path)")
    ckpt = latest_checkpoint(paths.dir) if step is None else paths.checkpoint(step)
    if ckpt is None or not (ckpt / "model.safetensors").exists():
        raise typer.BadParameter(f"no checkpoint {'' if step is None else step} under {paths.dir}")
    write_checkpoint_model(ckpt, initial, out)
    typer.echo(json.dumps({"out": str(out), "checkpoint": str(ckpt)}))
