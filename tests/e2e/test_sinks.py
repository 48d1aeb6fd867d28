"""Metric sinks on a real smoke run (the session fixture ``smoke``, run with
``monitor.sinks=["tensorboard","wandb"]``): what the live monitor role wrote reads back,
with each library's own reader, as the lake's metrics; ``rlbus monitor`` on the finished
run writes the same scalars again, and adds nothing to a directory that is up to date."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from replay.sql import connect
from roles.cli.monitor import monitor
from schemas import RunStarted
from tests.e2e.conftest import ANALYTICS_RUN as RUN
from tests.sink_readback import Scalars, tensorboard_scalars, wandb_run

pytestmark = pytest.mark.e2e


def lake_scalars(data: Path) -> Scalars:
    """The lake's ``metrics`` rows as ``(role/metric, step, value)``, the sinks' names."""
    con = connect(data, RUN)
    rows = con.sql("select role || '/' || metric, step, value from metrics").fetchall()
    return sorted((name, int(step), float(value)) for name, step, value in rows)


def cli() -> typer.Typer:
    """The command alone: the whole app's callback would point structlog at the
    runner's captured stderr, which is closed once the runner returns."""
    app = typer.Typer()

    @app.callback()
    def group() -> None:
        """A group, so that `monitor` is a subcommand as in rlbus."""

    app.command("monitor")(monitor)
    return app


def same(a: Scalars, b: Scalars) -> None:
    """Equal names and steps; values equal up to TensorBoard's float32."""
    assert [(n, s) for n, s, _ in a] == [(n, s) for n, s, _ in b]
    assert [v for *_, v in a] == pytest.approx([v for *_, v in b], rel=1e-6, abs=1e-6)


def test_tensorboard_sink_holds_the_lakes_metrics(smoke: tuple[Path, list[Any]]) -> None:
    data, _ = smoke
    written = tensorboard_scalars(data / RUN / "tb")
    names = {n for n, _, _ in written}
    assert {"trainer/loss", "orchestrator/reward_mean"} <= names
    assert any(n.startswith("eval/") and "avg@" in n for n in names), names
    same(written, lake_scalars(data))


def test_monitor_command_writes_the_same_scalars(
    smoke: tuple[Path, list[Any]], tmp_path: Path
) -> None:
    data, _ = smoke
    out = tmp_path / "tb"
    args = [
        "monitor",
        "--run",
        RUN,
        "--to",
        "tensorboard",
        "--out",
        str(out),
        "--data-dir",
        str(data),
    ]
    result = CliRunner().invoke(cli(), args)
    assert result.exit_code == 0, result.output
    same(tensorboard_scalars(out), tensorboard_scalars(data / RUN / "tb"))
    # Pointed at the live sink's directory, it finds nothing left to write.
    again = CliRunner().invoke(
        cli(), ["monitor", "--run", RUN, "--to", "tensorboard", "--data-dir", str(data)]
    )
    assert again.exit_code == 0, again.output
    assert "tensorboard: 0 metrics events" in again.output
    same(tensorboard_scalars(data / RUN / "tb"), lake_scalars(data))


def test_wandb_sink_writes_an_offline_run_with_config_and_scalars(
    smoke: tuple[Path, list[Any]],
) -> None:
    data, events = smoke
    config, scalars = wandb_run(data / RUN / "wandb")
    started = next(e for e in events if isinstance(e, RunStarted))
    assert {k: v for k, v in config.items() if not k.startswith("_")} == started.config
    same(scalars, lake_scalars(data))
