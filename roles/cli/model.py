"""``rlbus model ...``: build the tiny local model (no hub needed)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

app = typer.Typer(help="Local models.", no_args_is_help=True)


@app.command("init")
def init(
    out: Path = typer.Option(
        Path("runs/model/tiny"), "--out", "-o", help="Directory to write the model to."
    ),
    seed: int = typer.Option(0, help="Initialisation seed: same seed, same bytes."),
    config: str = typer.Option(
        "default", "--config", "-c", help="Preset or TOML whose [model.tiny] sizes to use."
    ),
) -> None:
    """Build the tiny Llama-style model and character tokenizer in Hugging Face layout."""
    from configs import load_config
    from roles.model.tiny import init_model

    tiny = load_config(config).model.tiny.model_dump()
    tiny.pop("init_seed", None)
    summary = init_model(out, seed=seed, **tiny)
    typer.echo(json.dumps(summary, indent=2, default=str))
