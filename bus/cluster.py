"""A JetStream cluster: several nats-server nodes routed to each other.

    rlbus nats --cluster 3                 # three nodes on loopback, in the foreground
    rlbus up --cluster 3                   # a whole run on such a cluster (bus.replicas 3)
    rlbus nats config --host a --host b --host c --run R --out deploy/
                                           # the files to start it on three machines

On loopback (``EmbeddedCluster``) each node is an ``EmbeddedServer`` with its own store
(``<root>/n<i>``), client port, route port and name (``n<i>``), all in one cluster; the
ports are picked once and kept in ``<root>/cluster.json``, so a node that died restarts
where its peers and clients look for it, and a resumed run finds the same cluster.
``start`` returns once JetStream has a meta leader (read from every node's log).

Clients take every node's URL (``url`` joins them with commas; ``bus.runtime`` splits
them) and nats-py fails over between them. Streams, object stores and KV buckets are
replicated ``bus.replicas`` times: with 3 replicas a run survives the loss of any one
node, and a node that comes back catches up from its peers.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from bus.errors import ServerStartError
from bus.natsconf import Routes, Tls, server_conf
from bus.server import SERVER_FILE, EmbeddedServer

CLUSTER_FILE = "cluster.json"  # under the cluster's root: its name and ports, kept
CLUSTER_NAME = "rlbus"
_LEADER = ("JetStream cluster new metadata leader", "Self is new JetStream cluster metadata leader")  # fmt: skip


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def is_cluster_store(root: str | Path) -> bool:
    """Whether ``root`` (a run's ``nats/`` directory) holds a cluster's nodes."""
    return (Path(root) / CLUSTER_FILE).exists()


class EmbeddedCluster:
    """``size`` nodes on loopback, owned by this object (see the module docstring)."""

    def __init__(
        self,
        root: str | Path,
        size: int = 3,
        *,
        users: list[dict[str, Any]] | None = None,
        tls: Tls | None = None,
    ):
        self.root = Path(root).absolute()
        layout = self._layout(size)
        self.size = len(layout["client_ports"])
        routes = [f"nats-route://127.0.0.1:{p}" for p in layout["route_ports"]]
        self.nodes = [
            EmbeddedServer(
                self.root / f"n{i}",
                port=layout["client_ports"][i],
                name=f"n{i}",
                users=users,
                routes=Routes(CLUSTER_NAME, "127.0.0.1", layout["route_ports"][i], tuple(routes)),
                tls=tls,
            )  # fmt: skip
            for i in range(self.size)
        ]

    def _layout(self, size: int) -> dict[str, list[int]]:
        """The ports of the last start under ``root`` if there was one, else new ones."""
        path = self.root / CLUSTER_FILE
        try:
            layout = json.loads(path.read_text())
            if len(layout["client_ports"]) == len(layout["route_ports"]) >= 1:
                return {k: [int(p) for p in layout[k]] for k in ("client_ports", "route_ports")}
        except (OSError, ValueError, KeyError, TypeError):
            pass
        layout = {
            "client_ports": [free_port() for _ in range(size)],
            "route_ports": [free_port() for _ in range(size)],
        }
        self.root.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(layout))
        return layout

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated: what clients are given."""
        return ",".join(self.urls)

    @property
    def alive(self) -> bool:
        return all(n.alive for n in self.nodes)

    def node_named(self, name: str) -> EmbeddedServer:
        """The node a stream info names (``info.cluster.leader``)."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r} (nodes: {[n.name for n in self.nodes]})")

    def start(self, timeout: float = 30.0) -> EmbeddedCluster:
        """Start every node; return once each has seen a JetStream meta leader."""
        for n in self.nodes:
            n.spawn(fresh_log=True)
        deadline = time.monotonic() + timeout
        try:
            while not all(n.ready() for n in self.nodes):
                self._wait(deadline, "every node ready")
            while not all(self._has_leader(n) for n in self.nodes):
                self._wait(deadline, "a JetStream meta leader")
        except ServerStartError:
            self.stop()
            raise
        info = {"url": self.url, "pid": self.nodes[0].proc.pid if self.nodes[0].proc else 0}
        (self.root / SERVER_FILE).write_text(json.dumps(info))
        return self

    def _wait(self, deadline: float, what: str) -> None:
        if time.monotonic() > deadline:
            raise ServerStartError(f"cluster under {self.root} has no {what} yet; logs: n*/")
        time.sleep(0.05)

    @staticmethod
    def _has_leader(node: EmbeddedServer) -> bool:
        with node.log_path.open("rb") as f:
            text = f.read().decode(errors="replace")
        return any(line in text for line in _LEADER)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        (self.root / SERVER_FILE).unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def host_confs(
    hosts: list[str],
    *,
    store_dir: str,
    client_port: int = 4222,
    route_port: int = 6222,
    users: list[dict[str, Any]] | None = None,
    tls: Tls | None = None,
) -> dict[str, dict[str, Any]]:
    """The configuration of each node of a cluster on ``hosts`` (one node per host,
    named after its host), for the stock ``nats-server -c <file>`` on each machine.
    Clients connect to ``nats://<host>:<client_port>`` (``tls://`` with TLS)."""
    if len(set(hosts)) != len(hosts) or not hosts:
        raise ValueError(f"hosts must be distinct and at least one: {hosts}")
    routes = tuple(f"nats-route://{h}:{route_port}" for h in hosts)
    return {
        h: server_conf(
            name=h,
            host="0.0.0.0",
            port=client_port,
            store_dir=store_dir,
            users=users,
            routes=Routes(CLUSTER_NAME, "0.0.0.0", route_port, routes) if len(hosts) > 1 else None,
            tls=tls,
        )  # fmt: skip
        for h in hosts
    }
