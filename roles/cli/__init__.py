"""The ``rlbus`` command line: one typer app; heavy imports live inside command bodies.

rlbus --help
rlbus up --dry-run -c smoke
rlbus topology
"""

from __future__ import annotations

import typer

from roles.cli import algorithm, core, model, nats, role
from roles.cli.eval import evaluate
from roles.cli.lake import lake_app, sql
from roles.cli.monitor import monitor
from roles.cli.replay import export, import_run, plot, replay_app
from roles.cli.rollout import rollout
from roles.cli.serve import serve
from roles.cli.trace import trace

app = typer.Typer(
    name="rlbus",
    help="Asynchronous RL post-training on a NATS JetStream bus.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
core.register(app)
app.command("rollout")(rollout)
app.command("serve")(serve)
app.command("eval")(evaluate)
app.command("sql")(sql)
app.add_typer(lake_app, name="lake")
app.add_typer(replay_app, name="replay")
app.command("trace")(trace)
app.command("export")(export)
app.command("import")(import_run)
app.command("plot")(plot)
app.command("monitor")(monitor)


@app.callback()
def _setup() -> None:
    """Logs go to stderr (stdout is for command output); roles re-configure with their ids."""
    from bus.log import configure

    configure(level="WARNING")


app.add_typer(role.app, name="role")
app.add_typer(model.app, name="model")
app.add_typer(algorithm.app, name="algorithm")
app.add_typer(nats.app, name="nats")


def prepare_imports() -> None:
    """rlbus's top-level packages imported, then the working directory on the import
    path, last: user code (``--env my_envs.qa:make_env``) is found there, and a folder of
    the user's named like one of those packages cannot hide it
    (``roles.lib.plugins.user_import_path``)."""
    import bus  # noqa: F401
    import configs  # noqa: F401
    import replay  # noqa: F401
    import schemas  # noqa: F401
    from roles.lib.plugins import user_import_path

    user_import_path()


def main() -> None:
    """The ``rlbus`` script (and ``python -m roles.cli``, which role processes run)."""
    prepare_imports()
    app()
