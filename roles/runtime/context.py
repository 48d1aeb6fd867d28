"""What every role process starts from: its run, its bus, its config, its run directory.

A role gets its config from ``--config`` (what ``rlbus up`` passes) or, when attached
to a live run, from the run's own ``run.started`` event: the log is the run. Its data
directory is resolved like every command's (``configs.paths.resolve_data_dir``: a
``--data-dir`` flag, else $RLBUS_DATA_DIR, else the config's ``bus.data_dir``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bus.reader import first_event
from bus.runtime import Bus, BusSettings
from bus.subjects import Topic
from configs import RunConfig, load_config, resolve
from configs.paths import RunPaths, settle_data_dir
from roles.lib.model import materialize_model
from schemas import RunStarted


def bus_settings(cfg: RunConfig) -> BusSettings:
    b = cfg.bus
    return BusSettings(
        offload_threshold_bytes=b.offload_threshold_bytes,
        duplicate_window_s=b.duplicate_window_s,
        max_deliver=b.max_deliver,
        ack_wait_s=b.ack_wait_s,
        nak_delay_s=b.nak_delay_s,
        server_lost_s=b.server_lost_s,
        replicas=b.resolved_replicas(),
    )


def policy_model_dir(cfg: RunConfig, run: str) -> Path:
    """The initial policy weights (policy version 0)."""
    return materialize_model(cfg, cfg.model.path, RunPaths.of(cfg, run).dir)


def instance_name(role: str, suffix: str | None = None) -> str:
    """A unique, readable role instance id: role[-suffix]-host-pid."""
    host = socket.gethostname().split(".")[0].replace("_", "-")[:16]
    parts = [role, suffix, host, str(os.getpid())]
    return "-".join(p for p in parts if p)


async def read_run_started(bus: Bus) -> RunStarted | None:
    """The run's ``run.started`` event (the first one: the orchestrator's, or what a
    fork or an import wrote first), or None if the run has not started yet. Garbage or a
    second ``run.started`` published after it is neither fatal nor believed."""
    started: RunStarted | None = await first_event(
        bus, Topic.RUN_STARTED, (RunStarted,), lambda e: True
    )
    return started


@dataclass
class RoleContext:
    run: str
    url: str
    cfg: RunConfig
    instance: str
    # Whether ``cfg`` is the run's own config (its ``config.toml`` or ``run.started``), not
    # the one ``rlbus rollout`` started this role with (``rollout.config.toml``): the
    # env server checks the orchestrator's requests against the run's own alone.
    runs_config: bool = True

    @property
    def paths(self) -> RunPaths:
        return RunPaths.of(self.cfg, self.run)

    @property
    def run_dir(self) -> Path:
        return self.paths.dir

    def model_dir(self) -> Path:
        return policy_model_dir(self.cfg, self.run)

    def load_renderer(self) -> Any:
        """The run model's renderer (``model.renderer``; the tiny model is built if absent)."""
        from roles.lib.model.loading import load_tokenizer
        from roles.lib.model.render import make_renderer

        tokenizer = load_tokenizer(
            self.model_dir(), local_files_only=self.cfg.model.local_files_only
        )
        return make_renderer(tokenizer, self.cfg.model.renderer)

    async def connect(self, producer: str | None = None) -> Bus:
        bus = await Bus.connect(
            self.url,
            run=self.run,
            producer=producer or self.instance,
            settings=bus_settings(self.cfg),
        )
        await bus.ensure_stream()
        return bus


async def role_context(
    run: str,
    url: str,
    role: str,
    config: str | None,
    suffix: str | None = None,
    data_dir: str | Path | None = None,
) -> RoleContext:
    """Build a role's context: config from ``--config`` if given, else from ``run.started``;
    ``bus.data_dir`` settled (``data_dir``: a ``--data-dir`` flag)."""
    instance = instance_name(role, suffix)
    if config is not None:
        cfg = load_config(config)
    else:
        bus = await Bus.connect(url, run=run, producer=instance)
        try:
            started = await read_run_started(bus)
        finally:
            await bus.close()
        if started is None:
            raise SystemExit(f"run {run!r} has no run.started event yet; pass --config")
        cfg = resolve(started.config)
    cfg.run = run
    settle_data_dir(cfg, flag=data_dir)
    own = config is None or not _is_rollout_config(config, RunPaths.of(cfg, run))
    return RoleContext(run=run, url=url, cfg=cfg, instance=instance, runs_config=own)


def _is_rollout_config(config: str, paths: RunPaths) -> bool:
    return Path(config).resolve() == paths.rollout_config.resolve()
