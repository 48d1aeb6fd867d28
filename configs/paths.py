"""Where runs live and where a run's files are: one function and one object.

    root = resolve_data_dir(flag, cfg.bus.data_dir)   # every command and role resolves it so
    paths = RunPaths(root, run)                        # or RunPaths.of(cfg) once it is settled
    paths.nats, paths.logs, paths.config, paths.summary, paths.lake, ...

The data directory (the root of run directories) is, first to last: an explicit choice
(a ``--data-dir`` flag, a ``bus.data_dir=...`` override on the command line), then
``$RLBUS_DATA_DIR``, then the config's ``bus.data_dir`` (default ``runs``). Commands that
start roles pass the resolved directory on with ``--data-dir``, so a role process
resolves it to the same place.

A run's directory, ``<data_dir>/<run>/``::

    nats/              the embedded nats-server's store (``jetstream/``, its log, server.json;
                       nats.conf when it has no credentials); a cluster's: one ``n<i>/`` per
                       node and cluster.json
    auth/              the run's credentials: one file per role kind (mode 0600) but the
                       launcher's, which lives in ``<data_dir>/.admin/<run>/`` with the
                       server's configuration (every password), outside every run directory:
                       role processes cannot read it (``bus.sandbox``)
    config.toml        the resolved config (rollout.config.toml: ``rlbus rollout``'s, when
                       the run already has another one)
    logs/<name>.log    one log per role process
    model/initial/     the initial policy (the tiny model is built here)
    checkpoints/       trainer checkpoints
    weights/           published weights too large for the object store
    lake/              the Parquet lake (``lake/shadow_samples/``: shadow scores)
    tb/, wandb/        the metric sinks' output ([monitor] sinks)
    summary.json, curves.png (``rlbus up``), plot.png (``rlbus plot``), import.json
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from configs.loading import parse_override
from configs.models import BusConfig, RunConfig

DATA_DIR_ENV = "RLBUS_DATA_DIR"
CHECKPOINT_PREFIX = "step-"  # checkpoints/step-00000042/


def resolve_data_dir(
    explicit: str | Path | None = None, configured: str | Path | None = None
) -> Path:
    """The root of run directories: ``explicit`` (a flag or a ``bus.data_dir`` override),
    else ``$RLBUS_DATA_DIR``, else ``configured`` (a config's ``bus.data_dir``), else the
    config default (``runs``)."""
    if explicit:
        return Path(explicit)
    if env := os.environ.get(DATA_DIR_ENV):
        return Path(env)
    return Path(configured or BusConfig().data_dir)


def data_dir_override(overrides: Sequence[str]) -> str | None:
    """The value of a ``bus.data_dir=...`` command-line override (the last one), if any."""
    found = None
    for item in overrides:
        keys, value = parse_override(item)
        if keys == ["bus", "data_dir"]:
            found = str(value)
    return found


def settle_data_dir(
    cfg: RunConfig, overrides: Sequence[str] = (), flag: str | Path | None = None
) -> RunConfig:
    """Set ``cfg.bus.data_dir`` to the resolved data directory (``resolve_data_dir``, with
    ``flag`` or a ``bus.data_dir`` override among ``overrides`` as the explicit choice)."""
    explicit = flag or data_dir_override(overrides)
    cfg.bus.data_dir = str(resolve_data_dir(explicit, cfg.bus.data_dir))
    return cfg


# Weights published with `trainer.weights_via = "shm"`: memory, not disk, one folder per run.
SHM_WEIGHTS_ROOT = Path("/dev/shm/rlbus")


@dataclass(frozen=True)
class RunPaths:
    """The files of one run under a data directory (see the module docstring)."""

    data_dir: Path
    run: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))

    @classmethod
    def of(cls, cfg: RunConfig, run: str | None = None) -> RunPaths:
        """``run`` (default ``cfg.run``) under the config's (settled) ``bus.data_dir``."""
        name = run or cfg.run
        if not name:
            raise ValueError("the config names no run")
        return cls(Path(cfg.bus.data_dir), name)

    @classmethod
    def at(cls, run_dir: str | Path) -> RunPaths:
        """The paths of the run whose directory is ``run_dir``."""
        run_dir = Path(run_dir)
        return cls(run_dir.parent, run_dir.name)

    @property
    def dir(self) -> Path:
        return self.data_dir / self.run

    @property
    def nats(self) -> Path:
        """The store of the run's embedded nats-server (``bus.server.EmbeddedServer``)."""
        return self.dir / "nats"

    @property
    def auth(self) -> Path:
        """The run's identities: its server's users and one credentials file per role
        kind (``bus.auth.RunAuth``; mode 0700, files 0600)."""
        return self.dir / "auth"

    @property
    def server_file(self) -> Path:
        """Written by the run's embedded server while it runs (url, pid): the name is
        ``bus.server.SERVER_FILE`` (configs imports no bus; a unit test ties the two)."""
        return self.nats / "server.json"

    @property
    def config(self) -> Path:
        return self.dir / "config.toml"

    @property
    def rollout_config(self) -> Path:
        """``rlbus rollout``'s config when the run's ``config.toml`` is another one."""
        return self.dir / "rollout.config.toml"

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    def log(self, name: str) -> Path:
        """The log file of one role process."""
        return self.logs / f"{name}.log"

    @property
    def summary(self) -> Path:
        return self.dir / "summary.json"

    @property
    def curves(self) -> Path:
        """``rlbus up``'s curves."""
        return self.dir / "curves.png"

    @property
    def plot(self) -> Path:
        """``rlbus plot``'s default output."""
        return self.dir / "plot.png"

    @property
    def lake(self) -> Path:
        return self.dir / "lake"

    @property
    def tensorboard(self) -> Path:
        """The TensorBoard sink's event files (``tensorboard --logdir runs/<run>/tb``)."""
        return self.dir / "tb"

    @property
    def wandb(self) -> Path:
        """The W&B sink's directory (wandb writes its runs under ``wandb/`` in it)."""
        return self.dir / "wandb"

    @property
    def shadow_samples(self) -> Path:
        """Shadow scores of ``rlbus replay <run> algorithm <id>``, beside the lake."""
        return self.lake / "shadow_samples"

    @property
    def initial_model(self) -> Path:
        """The initial policy's directory (the tiny model, an imported run's model)."""
        return self.dir / "model" / "initial"

    @property
    def checkpoints(self) -> Path:
        return self.dir / "checkpoints"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"{CHECKPOINT_PREFIX}{step:08d}"

    @property
    def weights(self) -> Path:
        """Published weights too large for the object store."""
        return self.dir / "weights"

    @property
    def shm_weights(self) -> Path:
        """Published weights in memory (``trainer.weights_via = "shm"``), outside the run
        directory: ``rlbus up --fresh`` deletes them with it."""
        return SHM_WEIGHTS_ROOT / self.run

    @property
    def import_record(self) -> Path:
        """What ``rlbus import`` loaded (archive, counts, old to new sequences)."""
        return self.dir / "import.json"


__all__ = [
    "CHECKPOINT_PREFIX",
    "DATA_DIR_ENV",
    "RunPaths",
    "data_dir_override",
    "resolve_data_dir",
    "settle_data_dir",
]
