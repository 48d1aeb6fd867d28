"""``rlbus nats``: a NATS JetStream server or loopback cluster in the foreground, and the
configuration files of a real multi-machine cluster.

    rlbus nats                                   # one server on :4222, store runs/nats
    rlbus nats --cluster 3                       # three nodes on loopback; prints their URLs
    rlbus nats --cluster 3 --run R               # ... accepting only run R's identities
    rlbus nats config --host a --host b --host c --run R --out deploy/
                                                 # deploy/<host>.conf + deploy/auth/*.creds

Without ``--run`` the server accepts anonymous clients on loopback (a scratch server
for ``--nats-url``); ``rlbus up`` always starts its own with the run's identities.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import typer

app = typer.Typer(help="Run a NATS server or cluster; write a cluster's config files.")

RUNS = typer.Option(None, "--run", "-r", help="Accept only these runs' identities (repeatable).")


@app.callback(invoke_without_command=True)
def nats(
    ctx: typer.Context,
    data_dir: Path | None = typer.Option(
        None, "--data-dir", help="JetStream store directory (default: <data dir>/nats)."
    ),
    port: int = typer.Option(4222, "--port", "-p", help="Client port (-1: any free port)."),
    cluster: int = typer.Option(1, "--cluster", min=1, max=9, help="Nodes (on loopback)."),
    runs: list[str] = RUNS,
) -> None:
    """Run the embedded nats-server (JetStream, loopback) in the foreground until Ctrl-C."""
    if ctx.invoked_subcommand is not None:
        return
    from bus.cluster import EmbeddedCluster
    from bus.errors import BusError
    from bus.server import EmbeddedServer
    from configs.paths import resolve_data_dir

    data_dir = data_dir or resolve_data_dir() / "nats"
    users = _users(runs or [], resolve_data_dir())
    server: EmbeddedServer | EmbeddedCluster
    try:
        if cluster > 1:
            server = EmbeddedCluster(data_dir, cluster, users=users).start()
        else:
            server = EmbeddedServer(data_dir, port=port, users=users).start()
    except BusError as e:
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    what = f"{cluster}-node cluster" if cluster > 1 else "nats-server"
    typer.echo(f"{what} ready at {server.url} (store: {data_dir})")
    if runs:
        typer.echo(f"identities: {', '.join(str(resolve_data_dir() / r / 'auth') for r in runs)}")
    _serve(server)
    typer.echo(f"{what} stopped")


def _users(runs: list[str], root: Path) -> list[dict[str, object]] | None:
    """The users of ``runs`` (their identities, created if new); None: anonymous."""
    if not runs:
        return None
    from bus.auth import RunAuth

    return [u for r in runs for u in RunAuth.ensure(root / r / "auth", r).users()]


def _serve(server: object) -> None:
    """Until Ctrl-C, SIGTERM, or a node exits."""
    stop = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    nodes = getattr(server, "nodes", [server])
    try:
        while not stop and all(n.alive for n in nodes):
            time.sleep(0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()  # type: ignore[attr-defined]


@app.command("config")
def config(
    hosts: list[str] = typer.Option(..., "--host", help="A node's host name or address (repeat: one per node)."),
    runs: list[str] = typer.Option(..., "--run", "-r", help="Run whose identities the cluster accepts (repeatable)."),
    out: Path = typer.Option(Path("nats-cluster"), "--out", "-o", help="Directory to write into."),
    store_dir: str = typer.Option("/var/lib/rlbus/nats", "--store-dir", help="JetStream store on each host."),
    client_port: int = typer.Option(4222, "--client-port"),
    route_port: int = typer.Option(6222, "--route-port"),
    tls_cert: str | None = typer.Option(None, "--tls-cert", help="Server certificate (path on the hosts)."),
    tls_key: str | None = typer.Option(None, "--tls-key", help="Its key (path on the hosts)."),
    tls_ca: str | None = typer.Option(None, "--tls-ca", help="CA of the servers' and peers' certificates."),
    run_config: str | None = typer.Option(None, "--config", "-c", help="The runs' config (preset or TOML): each kind's durable consumers are the ones it names (default: any name)."),
) -> None:  # fmt: skip
    """Write one nats-server config per host (start each with ``nats-server -c``) and the
    runs' credentials files (``<out>/<run>/<kind>.creds``, the launcher's in
    ``<out>/<run>-admin``) for the hosts that run roles."""
    from bus.auth import RunAuth
    from bus.cluster import host_confs
    from bus.natsconf import Tls, write_conf
    from roles.cli.common import fail

    if (tls_cert or tls_key or tls_ca) and not (tls_cert and tls_key and tls_ca):
        fail("--tls-cert, --tls-key and --tls-ca go together")
    tls = Tls(tls_cert, tls_key, tls_ca) if tls_cert and tls_key else None
    auths = [RunAuth.ensure(out / r, r) for r in runs]
    if run_config is not None:
        from configs import ConfigError, load_config
        from roles.up.launcher import run_durables

        try:
            durables = run_durables(load_config(run_config))
        except ConfigError as e:
            fail(str(e))
        auths = [a.declare(durables) for a in auths]
    users = [u for a in auths for u in a.users()]
    try:
        confs = host_confs(
            hosts, store_dir=store_dir, client_port=client_port, route_port=route_port,
            users=users, tls=tls,
        )  # fmt: skip
    except ValueError as e:
        fail(str(e))
    for host, conf in confs.items():
        path = write_conf(out / f"{host}.conf", conf)
        typer.echo(f"{host}: nats-server -c {path.name}")
    scheme = "tls" if tls else "nats"
    urls = ",".join(f"{scheme}://{h}:{client_port}" for h in hosts)
    typer.echo(f"clients: --nats-url {urls}")
    typer.echo(
        f"credentials: {', '.join(str(out / r) for r in runs)} (one file per role kind; "
        f"the launcher's apart, in {', '.join(str(out / f'{r}-admin') for r in runs)})"
    )
