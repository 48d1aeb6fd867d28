"""The metric sinks: TensorBoard event files and Weights & Biases runs.

    sinks = make_sinks(["tensorboard", "wandb"], cfg.monitor, paths)   # name -> (sink, dir)

Both libraries are optional extras (``pip install -e ".[monitor]"``, part of ``dev``)
and are imported only when a sink is made; ``roles.up.preflight`` says which is missing
before a run starts. TensorBoard is written with torch's ``SummaryWriter`` (the
``tensorboard`` package's event format; ``tensorboard --logdir runs/<run>/tb``): one
scalar per ``<role>/<metric>`` at its trainer step, the run's config as HParams (dotted
keys) and as a text panel. W&B runs offline by default (``wandb sync`` uploads later);
every scalar is logged against a ``trainer_step`` axis (``define_metric``), because
roles report their steps out of order and W&B's own step must only grow. The W&B run id
is the rlbus run id, so a resumed monitor and a later ``wandb sync`` land in one run.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from configs import MonitorConfig, RunPaths
    from roles.monitor.feed import MetricFeed, Sink

SINKS = ("tensorboard", "wandb")
POSITION_FILE = "rlbus-position.json"  # a sink's SinkPosition, in its directory
STEP_METRIC = "trainer_step"


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config -> ``{"trainer.lr": 3e-4, ...}``; lists and None as text."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, name + "."))
        elif isinstance(value, bool | int | float | str):
            out[name] = value
        else:
            out[name] = json.dumps(value)
    return out


class TensorBoardSink:
    name = "tensorboard"

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.writer: Any = None

    def start(self, config: dict[str, Any] | None) -> None:
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(log_dir=str(self.logdir))
        if config is not None:  # a resumed sink wrote the config the first time
            for summary in hparams(flat_config(config), {}):
                self.writer.file_writer.add_summary(summary)
            text = json.dumps(config, indent=2, sort_keys=True)
            self.writer.add_text("config", "    " + text.replace("\n", "\n    "))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    name = "wandb"

    def __init__(
        self,
        directory: Path,
        run: str,
        project: str,
        entity: str | None,
        mode: Literal["offline", "online"],
    ):
        self.directory = directory
        self.run_name = run
        self.project, self.entity, self.mode = project, entity, mode
        self.wb: Any = None

    def start(self, config: dict[str, Any] | None) -> None:
        import wandb

        self.directory.mkdir(parents=True, exist_ok=True)
        self.wb = wandb.init(
            project=self.project, entity=self.entity, name=self.run_name,
            id=wandb_id(self.run_name), resume="allow", dir=str(self.directory),
            mode=self.mode, config=config,
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )  # fmt: skip
        self.wb.define_metric(STEP_METRIC)
        self.wb.define_metric("*", step_metric=STEP_METRIC)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self.wb.log({STEP_METRIC: step, **values})

    def flush(self) -> None:
        """W&B writes as it logs; its service process persists the records."""

    def close(self) -> None:
        self.wb.finish()


def wandb_id(run: str) -> str:
    """A W&B run id from an rlbus run id (W&B ids: letters, digits, ``-`` and ``_``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", run)[:64]


def sink_dir(name: str, paths: RunPaths) -> Path:
    return paths.tensorboard if name == "tensorboard" else paths.wandb


def make_sink(name: str, directory: Path, run: str, cfg: MonitorConfig) -> Sink:
    if name == "tensorboard":
        return TensorBoardSink(directory)
    if name == "wandb":
        w = cfg.wandb
        return WandbSink(directory, run, w.project, w.entity, w.mode)
    raise ValueError(f"unknown sink {name!r} (known: {', '.join(SINKS)})")


def missing_library(name: str) -> str | None:
    """Why sink ``name`` cannot run here, in one line, or None."""
    import importlib.util

    if importlib.util.find_spec(name) is None:  # each sink's package has the sink's name
        return f"the {name} sink needs the {name!r} package: pip install -e '.[monitor]'"
    return None


def wandb_online_problem(cfg: MonitorConfig) -> str | None:
    """Online W&B needs a key; say so before the run starts rather than in a role log."""
    if cfg.wandb.mode != "online" or os.environ.get("WANDB_API_KEY"):
        return None
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="replace"):
        return None
    return (
        "monitor.wandb.mode = 'online' needs a W&B key (WANDB_API_KEY or `wandb login`); "
        "use mode = 'offline' to write the run locally"
    )


def make_feeds(
    names: list[str], cfg: MonitorConfig, paths: RunPaths, config: dict[str, Any] | None,
    out: Path | None = None,
) -> list[MetricFeed]:  # fmt: skip
    """One ``MetricFeed`` per sink name, writing under ``out`` (default: the run's sink
    directory of that name, ``runs/<run>/tb`` or ``runs/<run>/wandb``); ``config`` is
    the run's resolved config, recorded by each sink (hparams, W&B config)."""
    from roles.monitor.feed import MetricFeed, SinkPosition

    feeds: list[MetricFeed] = []
    for name in names:
        directory = out if out is not None else sink_dir(name, paths)
        sink = make_sink(name, directory, paths.run, cfg)
        position = SinkPosition(directory / POSITION_FILE, paths.run)
        feeds.append(MetricFeed(sink, position, config))
    return feeds
