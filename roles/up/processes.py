"""Role processes of ``rlbus up``: the ``rlbus role ...`` command line, start, stop, logs.

Each role runs as its own process in its own session (a Ctrl-C in the terminal reaches
the launcher only, which then stops the roles in order), logging to
``runs/<run>/logs/<name>.log``, and dies with the launcher (``bus.children``). A pool
replica the launcher retires (``roles.up.pools``) is ``retiring``: it drains on SIGTERM
and its exit is no crash.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from bus.auth import hidden_from
from bus.children import die_with_parent
from bus.sandbox import Sandbox, temp_dir_for, with_sandbox
from configs.paths import RunPaths


@dataclass
class RoleProcess:
    name: str  # unique: "env-reverse-text", "inference-policy-0", ...
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    log_file: IO[bytes] | None = None
    exit_codes: list[int] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's environment
    # What it must not touch (``bus.sandbox``: the launcher's credentials, server configs,
    # other runs'), asked at each start; None: unconfined.
    hidden: Callable[[], list[Path]] | None = None
    temp_dir: Path | None = None  # its TMPDIR when the system's lies above a hidden path
    # time.monotonic() when its pool retired it (SIGTERM: it drains, then exits); None: serving
    retiring_since: float | None = None

    def start(self) -> None:
        """Start (or restart) the process, appending to its log."""
        if self.log_file is not None:
            self.log_file.close()  # the previous process's handle, on a restart
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_file = self.log_path.open("ab")
        env = os.environ | self.env
        hidden = self.hidden() if self.hidden is not None else []
        if hidden and self.temp_dir is not None and (tmp := temp_dir_for(hidden, self.temp_dir)):
            tmp.mkdir(parents=True, exist_ok=True)
            env["TMPDIR"] = str(tmp)
        # Built afresh at each start: it allows what is beside the hidden paths right now.
        sandbox = Sandbox.build(hidden) if hidden else None
        try:
            # A launcher that dies without stopping its roles (SIGKILL) takes them along:
            # the run is resumable from its log (``rlbus up --run R --resume``), orphans
            # are not.
            self.proc = subprocess.Popen(
                self.argv, stdout=self.log_file, stderr=subprocess.STDOUT,
                start_new_session=True, env=env,
                preexec_fn=with_sandbox(die_with_parent(signal.SIGKILL), sandbox),
            )  # fmt: skip
        finally:
            if sandbox is not None:
                sandbox.close()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, lines: int = 20) -> str:
        """The end of the role's log, for error messages."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def terminate(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """SIGTERM: drain and stop; SIGINT: hand back in-flight work and stop
        (``roles.runtime.role``)."""
        if self.alive and self.proc is not None:
            self.proc.send_signal(sig)

    def retire(self) -> None:
        """Retired from its pool: SIGTERM, so it stops fetching and finishes what it holds;
        its exit is expected from now on (the role keeper does not restart it)."""
        self.retiring_since = time.monotonic()
        self.terminate()

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.log_file:
            self.log_file.close()


def role_argv(
    args: list[str], paths: RunPaths, url: str, config_path: Path | None = None
) -> list[str]:
    """The ``rlbus role ...`` command line of one role process of the run at ``paths``
    (``config_path``: default the run's ``config.toml``). The data directory is passed
    on, so the role resolves it to the same place as its launcher."""
    common = ["--run", paths.run, "--nats-url", url, "--config", str(config_path or paths.config)]
    common += ["--data-dir", str(paths.data_dir)]
    return [*PYTHON, "-m", "roles.cli", "role", *args, *common]


# How role processes start Python: ``-P`` keeps the working directory off the front of the
# import path, where a user's ``configs/`` folder (prime-rl's layout) or one named
# ``schemas``, ``bus``, ``roles`` or ``replay`` would hide rlbus's package of that name
# (an editable install's finder is only asked after the working directory). User code
# is still found there, last (``roles.lib.plugins.user_import_path``).
PYTHON = [sys.executable, "-P"]


def import_path_env() -> dict[str, str]:
    """What a role process needs to import rlbus without the working directory: when
    rlbus runs from a source tree (its root holds ``pyproject.toml``), that root first on
    ``PYTHONPATH``; an installed rlbus needs nothing."""
    import roles

    root = Path(roles.__file__).resolve().parent.parent
    if not (root / "pyproject.toml").is_file():
        return {}
    have = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {"PYTHONPATH": os.pathsep.join(dict.fromkeys([str(root), *have]))}


def role_process(
    name: str, args: list[str], paths: RunPaths, url: str, config_path: Path | None = None,
    *, sandbox: bool = True,
) -> RoleProcess:  # fmt: skip
    """One role process of the run at ``paths``, logging to ``logs/<name>.log``, with its
    role kind's credentials (``args[0]``, e.g. ``env``) when the run has them (its
    server requires them: ``bus.auth``), given through the environment, never argv;
    sandboxed so that it cannot read the launcher's (``hidden_from``; ``sandbox``: the
    config's ``bus.sandbox``)."""
    return RoleProcess(
        name,
        role_argv(args, paths, url, config_path),
        paths.log(name),
        env=import_path_env() | role_env(paths, args[0]),
        hidden=functools.partial(hidden_from, paths.auth) if sandbox else None,
        temp_dir=paths.dir / "tmp",
    )


def role_env(paths: RunPaths, kind: str) -> dict[str, str]:
    """The environment that gives a process of role ``kind`` its identity on the run's
    server: ``$RLBUS_NATS_CREDS`` (empty when the run has no credentials)."""
    from bus.auth import CREDS_ENV, creds_path

    creds = creds_path(paths.auth, kind)
    return {CREDS_ENV: str(creds.absolute())} if creds.exists() else {}


def write_summary(paths: RunPaths, summary: dict[str, object]) -> Path:
    path = paths.summary
    path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return path
