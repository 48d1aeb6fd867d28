"""`rlbus up` on a terminal: a person reads plain lines, never JSON (issue 31, item 8), and
`rlbus status` then says how the run ended (item 11)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN = "tty1"


def read_all(fd: int) -> bytes:
    """Everything written to the pseudo-terminal until its last writer closes it."""
    out = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the other side is closed
            return out
        if not chunk:
            return out
        out += chunk


def json_lines(text: str) -> list[str]:
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                json.loads(line)
            except ValueError:
                continue
            found.append(line)
    return found


def test_up_on_a_terminal_prints_no_json_and_status_says_it_finished(
    tmp_path: Path,
) -> None:
    """--no-view on a terminal printed JSON log lines (``role.started``) before; they are
    plain lines now, the JSON in ``logs/launcher.log``. Then ``rlbus status R`` (the
    positional spelling) says the run finished, and why."""
    main, terminal = os.openpty()
    cmd = [
        sys.executable, "-m", "roles.cli", "up", "-c", "smoke", "--no-view", "--run", RUN,
        f"bus.data_dir={tmp_path}", "max_steps=1",
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
    os.close(terminal)
    try:
        out = read_all(main).decode(errors="replace")
        proc.wait(600)
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-4000:]
    assert json_lines(out) == [], out[-4000:]
    assert "role.started" in out and "[rlbus] phase:" in out  # plain lines, still there
    logged = [json.loads(x) for x in (tmp_path / RUN / "logs" / "launcher.log").read_text().splitlines()]  # fmt: skip
    assert "role.started" in {r["event"] for r in logged}

    env = {**os.environ, "RLBUS_DATA_DIR": str(tmp_path)}
    status = subprocess.run(
        [sys.executable, "-m", "roles.cli", "status", RUN],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert status.returncode == 0, status.stderr
    first = status.stdout.splitlines()[0]
    assert first.startswith(f"run {RUN} finished (max_steps") and "at step 1/1" in first, first
    assert json_lines(status.stderr) == []
