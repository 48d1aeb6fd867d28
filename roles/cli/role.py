"""``rlbus role <name>``: run one role process attached to a run.

Every role takes ``--run``, ``--nats-url`` and optionally ``--config`` (default: the
config recorded in the run's ``run.started`` event) and ``--data-dir`` (default:
$RLBUS_DATA_DIR, else the config's ``bus.data_dir``: ``configs.paths.resolve_data_dir``).
``rlbus up`` starts these same commands as subprocesses; on another machine the same
command attaches one more replica to a live run, given the run's URLs (a cluster's:
comma-separated) and the role's credentials file (``--creds``, copied from
``runs/<run>/auth/<kind>.creds``; ``$RLBUS_NATS_CA`` names the CA under TLS):

    rlbus role env --env reverse-text --run R --nats-url nats://a:4222,nats://b:4222 --creds env.creds
"""

from __future__ import annotations

import importlib
from typing import Any

import typer

from bus.subjects import token_for
from roles.cli.common import run_async, run_option, server_for

app = typer.Typer(help="Run one role process (attach it to a live run).", no_args_is_help=True)

RUN = run_option()
URL = typer.Option(None, "--nats-url", help="NATS URL (default: the run's embedded server).")
CONFIG = typer.Option(
    None, "--config", "-c", help="Config (default: the run's run.started config)."
)
CREDS = typer.Option(
    None,
    "--creds",
    help="Credentials file of the run's identity for this role (default: the run's own, when local).",
)
DATA = typer.Option(
    None, "--data-dir", help="Runs directory (default: $RLBUS_DATA_DIR, else bus.data_dir)."
)


def _start(
    role: str,
    run: str,
    nats_url: str | None,
    config: str | None,
    data_dir: str | None,
    suffix: str | None = None,
    *,
    creds: str | None = None,
    **options: Any,
) -> None:
    """Import the role's entry (``bus.kinds.ROLES``) lazily (torch only loads when needed)
    and run it, as the run's ``role`` identity (``--creds``, else the run's own file when
    it is local)."""
    import os

    from bus.auth import CREDS_ENV
    from bus.kinds import ROLES
    from bus.log import configure
    from roles.runtime.context import role_context
    from roles.up.cpu_plan import apply_cpus

    apply_cpus()  # $RLBUS_CPUS (the launcher's CPU plan), before torch starts threads
    if creds:
        os.environ[CREDS_ENV] = creds  # this process's connections (bus.runtime)

    module, func = ROLES[role].entry.split(":")
    main = getattr(importlib.import_module(module), func)
    with server_for(run, nats_url, data_dir, identity=role) as url:
        ctx = run_async(role_context(run, url, role, config, suffix, data_dir=data_dir))
        configure(run=run, role=role, instance=ctx.instance)
        try:
            run_async(main(ctx, **options))
        except Exception as e:
            if (lost := _server_lost(e)) is None:
                raise
            typer.echo(f"{role}: {lost}", err=True)  # one line, not a traceback
            raise typer.Exit(3) from None


def _server_lost(e: BaseException | None) -> BaseException | None:
    """The ``ServerLost`` behind ``e``: what failed while the role drained without a
    server is a consequence, the lost server the cause."""
    from bus.errors import ServerLost

    while e is not None and not isinstance(e, ServerLost):
        e = e.__cause__ or e.__context__
    return e


@app.command("inference")
def inference(
    run: str = RUN, nats_url: str | None = URL, config: str | None = CONFIG, data_dir: str | None = DATA,
    creds: str | None = CREDS,
    model: str = typer.Option("policy", "--model", "-m", help="Model key to serve (policy, or a key of orchestrator.models)."),
) -> None:  # fmt: skip
    """Answer generate/score requests for one model (queue group; replicas share load)."""
    _start(
        "inference",
        run,
        nats_url,
        config,
        data_dir,
        model,
        model=model,
        creds=creds,
    )


@app.command("env")
def env(
    run: str = RUN, nats_url: str | None = URL, config: str | None = CONFIG, data_dir: str | None = DATA,
    creds: str | None = CREDS,
    env: str = typer.Option(..., "--env", "-e", help="Environment id (built-in name or module:function)."),
) -> None:  # fmt: skip
    """Run rollouts of one environment (replicas share one durable consumer)."""
    _start(
        "env",
        run,
        nats_url,
        config,
        data_dir,
        token_for(env),
        env=env,
        creds=creds,
    )


@app.command("teacher")
def teacher(
    run: str = RUN, nats_url: str | None = URL, config: str | None = CONFIG, data_dir: str | None = DATA,
    creds: str | None = CREDS,
    model: str = typer.Option("teacher", "--model", "-m", help="Model key it answers as."),
) -> None:  # fmt: skip
    """A scripted frozen teacher that answers the built-in tasks correctly (warm start)."""
    _start(
        "teacher",
        run,
        nats_url,
        config,
        data_dir,
        model,
        model=model,
        creds=creds,
    )


@app.command("gateway")
def gateway(
    run: str = RUN, nats_url: str | None = URL, config: str | None = CONFIG, data_dir: str | None = DATA,
    creds: str | None = CREDS,
) -> None:  # fmt: skip
    """The OpenAI-compatible endpoint over the run's inference ([gateway]; `rlbus serve`)."""
    _start("gateway", run, nats_url, config, data_dir, creds=creds)


@app.command("algorithm")
def algorithm(
    run: str = RUN, nats_url: str | None = URL, config: str | None = CONFIG, data_dir: str | None = DATA,
    creds: str | None = CREDS,
    name: str = typer.Option("grpo", "--name", "-n", help="Algorithm id from orchestrator.algorithms."),
) -> None:  # fmt: skip
    """Turn complete groups of traces into scored samples (one worker per algorithm)."""
    _start(
        "algorithm",
        run,
        nats_url,
        config,
        data_dir,
        name,
        name=name,
        creds=creds,
    )


@app.command("orchestrator")
def orchestrator(
    run: str = RUN,
    nats_url: str | None = URL,
    config: str | None = CONFIG,
    data_dir: str | None = DATA,
    creds: str | None = CREDS,
) -> None:
    """Dispatch tasks, assemble batches, run evals, stop the run (one per run)."""
    _start("orchestrator", run, nats_url, config, data_dir, creds=creds)


@app.command("trainer")
def trainer(
    run: str = RUN,
    nats_url: str | None = URL,
    config: str | None = CONFIG,
    data_dir: str | None = DATA,
    creds: str | None = CREDS,
    nproc: int | None = typer.Option(
        None, "--nproc", min=1, help="Ranks to train on (default: trainer.world_size)."
    ),
) -> None:
    """Train on assembled batches in order and publish new weights (on --nproc ranks)."""
    _start(
        "trainer",
        run,
        nats_url,
        config,
        data_dir,
        nproc=nproc,
        creds=creds,
    )


@app.command("lake")
def lake(
    run: str = RUN, nats_url: str | None = URL, config: str | None = CONFIG, data_dir: str | None = DATA,
    creds: str | None = CREDS,
    interval: float = typer.Option(5.0, "--interval", help="Seconds between syncs."),
) -> None:  # fmt: skip
    """Keep the run's Parquet lake in sync while it runs (optional live role)."""
    _start(
        "lake",
        run,
        nats_url,
        config,
        data_dir,
        interval_s=interval,
        creds=creds,
    )


@app.command("monitor")
def monitor(
    run: str = RUN, nats_url: str | None = URL, config: str | None = CONFIG, data_dir: str | None = DATA,
    creds: str | None = CREDS,
) -> None:  # fmt: skip
    """Follow the run's metrics into the [monitor] sinks (TensorBoard, W&B)."""
    _start("monitor", run, nats_url, config, data_dir, creds=creds)
