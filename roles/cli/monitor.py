"""``rlbus monitor``: a run's metrics into TensorBoard or W&B, read from its log.

    rlbus monitor --run <run> --to tensorboard        # runs/<run>/tb (tensorboard --logdir)
    rlbus monitor --run <run> --to wandb              # runs/<run>/wandb, offline
    rlbus monitor --run <run> --to tensorboard --out /tmp/tb

The same feed as the live monitor role (``roles.monitor``): it reads the log to its end
and exits. A sink directory remembers how far it got, so pointing the command at the
directory the live sink wrote (the default) adds only what the sink had not written yet;
``--out`` writes a fresh copy. W&B settings come from the run's ``[monitor.wandb]``
(``--wandb-mode`` overrides the mode). To follow a live run, attach the role instead:
``rlbus role monitor --run <run>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from roles.cli.common import fail, run_async, run_option, run_paths, server_for

if TYPE_CHECKING:
    from configs import MonitorConfig, RunPaths
    from roles.monitor.feed import MetricFeed

DATA = typer.Option(
    None, "--data-dir", help="Runs directory (default: $RLBUS_DATA_DIR, else bus.data_dir)."
)


def monitor(
    run: str = run_option(),
    to: list[str] = typer.Option(..., "--to", help="Sink: tensorboard or wandb (repeatable)."),
    out: Path | None = typer.Option(None, "--out", help="Directory to write (one sink only)."),
    wandb_mode: str | None = typer.Option(None, "--wandb-mode", help="offline or online."),
    nats_url: str | None = typer.Option(None, "--nats-url", help="NATS URL."),
    data_dir: str | None = DATA,
) -> None:
    """Write a run's metrics (and config) into TensorBoard event files or a W&B run."""
    from roles.monitor.sinks import SINKS, missing_library, wandb_online_problem

    for name in to:
        if name not in SINKS:
            fail(f"--to {name!r}: known sinks are {', '.join(SINKS)}")
        if (why := missing_library(name)) is not None:
            fail(why)
    if out is not None and len(to) > 1:
        fail("--out takes one sink; give --to once")
    paths = run_paths(run, data_dir)
    cfg = _monitor_config(paths.config)
    if wandb_mode is not None:
        if wandb_mode not in ("offline", "online"):
            fail(f"--wandb-mode {wandb_mode!r}: offline or online")
        cfg = cfg.model_copy(update={"wandb": cfg.wandb.model_copy(update={"mode": wandb_mode})})
    if "wandb" in to and (why := wandb_online_problem(cfg)) is not None:
        fail(why)
    with server_for(run, nats_url, data_dir, existing=True) as url:
        written = run_async(_feed(url, run, list(to), cfg, paths, out))
    for feed in written:
        where = feed.position.path.parent
        typer.echo(
            f"{feed.sink.name}: {feed.delivered} metrics events up to seq {feed.seq} in {where}"
        )


def _monitor_config(config_file: Path) -> MonitorConfig:
    """The run's ``[monitor]`` section (defaults when the run has no config here)."""
    from configs import ConfigError, MonitorConfig, load_config

    if not config_file.is_file():
        return MonitorConfig()
    try:
        return load_config(str(config_file)).monitor
    except ConfigError as e:
        fail(f"{config_file}: {e}")


async def _feed(
    url: str, run: str, sinks: list[str], cfg: MonitorConfig, paths: RunPaths, out: Path | None
) -> list[MetricFeed]:
    """Feed the run's log to the sinks, the run's config from its ``run.started``."""
    import contextlib

    from bus.reader import read_log
    from bus.runtime import Bus
    from roles.cli.progress import progress
    from roles.monitor.role import TOPICS
    from roles.monitor.sinks import make_feeds
    from roles.runtime.context import read_run_started
    from schemas import MetricsReported

    bus = await Bus.connect(url, run=run, producer="cli-monitor")
    feeds: list[MetricFeed] = []
    try:
        started = await read_run_started(bus)
        feeds = make_feeds(sinks, cfg, paths, started.config if started else None, out)
        start = min(f.from_seq for f in feeds)
        with progress("monitor", unit="events") as update:
            events = read_log(bus, TOPICS, (MetricsReported,), from_seq=start,
                              with_seq=True, on_progress=update)  # fmt: skip
            async with contextlib.aclosing(events) as stream:
                async for seq, event in stream:
                    for feed in feeds:
                        feed.apply(event, seq)
    finally:
        await bus.close()
        for feed in feeds:
            feed.close()
    return feeds
