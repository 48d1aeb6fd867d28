"""A role process started as ``rlbus up`` starts it cannot read another identity's
secrets (the launcher's credentials, other kinds', the server's configuration) nor the
launcher's memory, and still reads and writes everything else it needs (``bus.sandbox``)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from bus.auth import RunAuth, creds_path
from bus.sandbox import unavailable_reason
from configs.paths import RunPaths
from roles.up.processes import RoleProcess, hidden_from

pytestmark = pytest.mark.skipif(
    unavailable_reason() is not None, reason=f"no sandbox here: {unavailable_reason()}"
)

PROBE = r"""
import json, os, sys, tempfile
out = {}
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as f:
            f.read(1)
        out[path] = "read"
    except OSError as e:
        out[path] = "denied" if e.errno in (1, 13) else f"errno {e.errno}"
with tempfile.NamedTemporaryFile("w+", delete=False) as f:
    f.write("mine")
out["temp round trip"] = open(f.name).read()
out["temp dir"] = tempfile.gettempdir()
print("PROBE " + json.dumps(out), flush=True)
"""


def probe(paths: RunPaths, kind: str, files: list[Path]) -> dict[str, str]:
    r = RoleProcess(
        f"probe-{kind}",
        [sys.executable, "-c", PROBE, *map(str, files)],
        paths.log(f"probe-{kind}"),
        hidden=hidden_from(paths, kind),
        temp_dir=paths.dir / "tmp",
    )
    r.start()
    r.wait(60)
    assert r.proc is not None and r.proc.returncode == 0, r.tail()
    line = next(x for x in r.tail().splitlines() if x.startswith("PROBE "))
    result: dict[str, str] = json.loads(line.removeprefix("PROBE "))
    return result


def test_a_role_process_reads_its_own_credentials_and_no_other_identity_s(
    tmp_path: Path,
) -> None:
    paths = RunPaths(tmp_path / "runs", "r1")
    RunAuth.ensure(paths.auth, "r1")
    paths.nats.mkdir(parents=True)
    conf = paths.nats / "nats.conf"
    conf.write_text('{"authorization": {"users": []}}')
    paths.config.write_text("max_steps = 1\n")
    paths.logs.mkdir()
    launcher = creds_path(paths.auth, "launcher")
    readable = [creds_path(paths.auth, "env"), paths.config, Path(json.__file__), Path(os.__file__)]
    secret = [
        launcher,
        creds_path(paths.auth, "trainer"),
        creds_path(paths.auth, "inference"),
        conf,
    ]
    memory = Path(f"/proc/{os.getpid()}/environ")  # the launcher's: ptrace-guarded like its memory
    seen = probe(paths, "env", [*readable, *secret, memory])
    assert {str(p): seen[str(p)] for p in readable} == {str(p): "read" for p in readable}
    assert {str(p): seen[str(p)] for p in secret} == {str(p): "denied" for p in secret}
    assert seen[str(memory)] == "denied"
    # the run lives under the system's temporary directory here: the role's is the run's
    assert seen["temp round trip"] == "mine"
    assert Path(seen["temp dir"]) == paths.dir / "tmp"
    # the launcher (this process) still reads its own, and so does the trainer its own
    assert json.loads(launcher.read_text())["kind"] == "launcher"
    assert probe(paths, "trainer", [creds_path(paths.auth, "trainer")]) == {
        str(creds_path(paths.auth, "trainer")): "read",
        "temp round trip": "mine",
        "temp dir": str(paths.dir / "tmp"),
    }


def test_a_file_made_after_the_start_beside_a_secret_is_hidden_until_a_restart(
    tmp_path: Path,
) -> None:
    """The rule that keeps a run's directories made before its roles start: what appears
    later directly beside a secret (or one of its parents) is hidden from a role that is
    already running, and readable after its restart, when the sandbox is built again."""
    paths = RunPaths(tmp_path / "runs", "r1")
    RunAuth.ensure(paths.auth, "r1")
    paths.logs.mkdir()
    late = paths.dir / "late.txt"
    script = (
        "import sys, time\n"
        "p = sys.argv[1]\n"
        "while True:\n"
        "    try:\n"
        "        open(p).read(); print('PROBE read', flush=True); break\n"
        "    except FileNotFoundError: time.sleep(0.02)\n"
        "    except PermissionError: print('PROBE denied', flush=True); break\n"
    )
    r = RoleProcess(
        "late", [sys.executable, "-c", script, str(late)], paths.log("late"),
        hidden=hidden_from(paths, "env"), temp_dir=paths.dir / "tmp",
    )  # fmt: skip
    r.start()
    time.sleep(0.3)
    late.write_text("x")
    r.wait(30)
    assert "PROBE denied" in r.tail()
    r.start()
    r.wait(30)
    assert r.tail().splitlines()[-1] == "PROBE read"


def test_a_run_without_credentials_runs_its_roles_unconfined(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "runs", "open")
    assert hidden_from(paths, "env") == []
