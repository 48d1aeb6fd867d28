"""nats-server configuration files, written as JSON (a format the server reads).

One function builds the configuration of one server: where it listens, its name and
JetStream store, and optionally the users it accepts (``bus.auth``), the cluster it
routes to, TLS, and a monitoring port (off unless asked for, and then on loopback).
The embedded server (``bus.server``), the loopback cluster (``bus.cluster``) and the
files written for a real multi-machine cluster (``rlbus nats config``) all use it.

The file holds passwords: it is written with mode 0600.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Tls:
    """Certificate and key of a server (and the CA its peers and clients are checked
    against). Clients verify the server with the same CA (``bus.runtime``)."""

    cert: str
    key: str
    ca: str | None = None

    def block(self, verify: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"cert_file": self.cert, "key_file": self.key}
        if self.ca:
            out["ca_file"] = self.ca
        if verify:  # routes: each node proves itself to the others with the same CA
            out["verify"] = True
        return out


@dataclass(frozen=True)
class Routes:
    """The cluster block of one node: the cluster's name, where this node listens for
    routes, and the route URLs of the nodes (its own is ignored by the server)."""

    name: str
    host: str
    port: int
    peers: tuple[str, ...] = field(default_factory=tuple)


def server_conf(
    *,
    name: str,
    host: str,
    port: int,
    store_dir: str | Path,
    users: list[dict[str, Any]] | None = None,
    routes: Routes | None = None,
    tls: Tls | None = None,
    monitor_port: int | None = None,
) -> dict[str, Any]:
    """One server's configuration. ``port`` -1: any free port. ``users``: the
    ``authorization`` users (None: anonymous clients are accepted, as in tests)."""
    conf: dict[str, Any] = {
        "server_name": name,
        "host": host,
        "port": port,
        "jetstream": {"store_dir": str(store_dir)},
    }
    if users is not None:
        conf["authorization"] = {"users": users}
    if tls is not None:
        conf["tls"] = tls.block()
    if monitor_port is not None:
        conf["http"] = f"127.0.0.1:{monitor_port}"
    if routes is not None:
        cluster: dict[str, Any] = {
            "name": routes.name,
            "host": routes.host,
            "port": routes.port,
            "routes": list(routes.peers),
        }
        if tls is not None:
            cluster["tls"] = tls.block(verify=bool(tls.ca))
        conf["cluster"] = cluster
    return conf


def write_conf(path: str | Path, conf: dict[str, Any]) -> Path:
    """Write ``conf`` to ``path`` (mode 0600: it may hold passwords)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(conf, f, indent=2)
        f.write("\n")
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
    return path
