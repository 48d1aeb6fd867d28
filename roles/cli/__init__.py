"""The ``rlbus`` command line: one typer app; heavy imports live inside command bodies.

rlbus --help
rlbus up --dry-run -c smoke
rlbus topology

Every command that names a run takes it as ``--run R`` (``-r R``), or as its first
positional where its positionals leave room (``roles.cli.common.RunCommand``). Help text
is plain (no rich markup: ``[cpus]`` and ``[monitor]`` in a docstring are config
sections, not styles). prime-rl's spellings (``@ file.toml``, ``--trainer.lr 1e-4``) are
translated before click parses (``prime_rl_argv``).

- ``core``: ``up``, ``status``, ``events``, ``topology``; ``events``: the log printed in
  order, one line per event
- ``role``: ``rlbus role <name>``, one role process attached to a run
- ``algorithm``: ``rlbus algorithm attach|detach|list`` on a live run; ``attachments``:
  which algorithm workers a run has (the config's and those attached at runtime)
- ``rollout``: ``rlbus rollout``; ``eval``: ``rlbus eval`` (avg@k and pass@k of a model)
- ``serve``: ``rlbus serve``, a model behind an OpenAI-compatible endpoint
- ``lake``: ``rlbus lake sync|info`` and ``rlbus sql``
- ``replay``: ``rlbus replay``, ``export``, ``import``, ``plot``
- ``trace``: ``rlbus trace``, one rollout and what caused it and what it caused
- ``monitor``: ``rlbus monitor``, a run's metrics into TensorBoard or W&B
- ``model``: ``rlbus model``, build a local model, export a run's policy
- ``nats``: ``rlbus nats``, a NATS server or loopback cluster, and cluster config files
- ``common``: shared plumbing (the run id's grammar, finding the run's server, ``fail``)
- ``progress``: a long command's progress (a bar on a terminal, plain lines otherwise)
"""

from __future__ import annotations

import typer

from roles.cli import algorithm, core, model, nats, role
from roles.cli.common import accept_positional_run
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
    # Help as written, by click: rich markup would take `[cpus]` (a config section) for a
    # style and drop it, markdown `<run>` for HTML. Up to 120 columns where the terminal
    # has them (click's default stops at 80 and cuts the command list's summaries).
    rich_markup_mode=None,
    context_settings={"max_content_width": 120},
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
    """Logs go to stderr (stdout is for command output), as plain lines: a command's reader
    is a person. Role processes re-configure with their ids (JSON into their log files);
    ``up`` and ``algorithm attach`` give JSON lines with ``--json``."""
    from bus.log import configure

    configure(level="WARNING", json=False)


app.add_typer(role.app, name="role")
app.add_typer(model.app, name="model")
app.add_typer(algorithm.app, name="algorithm")
app.add_typer(nats.app, name="nats")
accept_positional_run(app)

# The commands that load a config (``-c``) and take dotted overrides.
CONFIG_COMMANDS = ("up", "eval", "rollout")


def prime_rl_argv(argv: list[str]) -> list[str]:
    """``argv`` (after the program name) with prime-rl's config spellings in rlbus's, for
    the commands that take a config and overrides (``CONFIG_COMMANDS``):
    ``@ file.toml`` and ``@file.toml`` are ``-c file.toml``; ``--trainer.lr 1e-4`` and
    ``--trainer.lr=1e-4`` are the override ``trainer.lr=1e-4`` (a dash in a key is an
    underscore: no rlbus key has a dash). No rlbus option has a dot in its name, so a
    dotted ``--key`` is always a config key. A dotted key without a value, or two config
    files, is refused in one line (``ValueError``) with the rlbus spelling. Runs before
    click, which would refuse these as unknown options or extra arguments."""
    if not argv or argv[0] not in CONFIG_COMMANDS:
        return argv
    out, configs, i = [argv[0]], [], 1
    while i < len(argv):
        a = argv[i]
        if a == "--":
            out += argv[i:]
            break
        if a == "@" or (a.startswith("@") and len(a) > 1):
            if a == "@" and i + 1 == len(argv):
                raise ValueError(
                    "@ needs a config file after it: @ config.toml (or -c config.toml)"
                )
            configs.append(argv[i + 1] if a == "@" else a[1:])
            out += ["-c", configs[-1]]
            i += 2 if a == "@" else 1
            continue
        if a in ("-c", "--config") or a.startswith("--config="):
            configs.append(a)
        if a.startswith("--") and "." in a.split("=", 1)[0]:
            key, eq, value = a[2:].partition("=")
            if not eq:
                if i + 1 == len(argv) or argv[i + 1].startswith("--"):
                    raise ValueError(f"{a} needs a value: rlbus spells it {key}=VALUE")
                value, i = argv[i + 1], i + 1
            out.append(f"{key.replace('-', '_')}={value}")
            i += 1
            continue
        out.append(a)
        i += 1
    if len(configs) > 1:
        raise ValueError(
            "one config at a time: -c PRESET or -c FILE.toml (or @ FILE.toml); "
            "change keys of it with overrides, key=value"
        )
    return out


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
    import sys

    prepare_imports()
    try:
        argv = prime_rl_argv(sys.argv[1:])
    except ValueError as e:
        print(f"rlbus {sys.argv[1]}: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    # Not a terminal (a pipe, an agent): help as wide as a terminal's, not click's 80.
    width = {} if sys.stdout.isatty() else {"terminal_width": 120}
    app(args=argv, prog_name="rlbus", **width)
