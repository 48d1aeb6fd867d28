"""A role process started as ``rlbus up`` starts it cannot read the launcher's
credentials, the server's configuration (every password), another run's credentials or
the launcher's memory, and still reads and writes everything else it needs, its whole
run directory included (``bus.sandbox``)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from bus.auth import RunAuth, creds_path, hidden_from
from bus.natsconf import write_conf
from bus.sandbox import unavailable_reason
from bus.server import EmbeddedServer
from configs.paths import RunPaths
from roles.up.processes import RoleProcess

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
    if "launcher" in path:  # what a role could do to the launcher's file instead
        for what, act in [
            ("write", lambda: open(path, "ab").close()),
            ("remove", lambda: os.unlink(path)),
            ("make beside", lambda: open(os.path.join(os.path.dirname(path), "x"), "w").close()),
            ("replace", lambda: os.rename(os.environ["MINE"], path)),
        ]:
            try:
                act()
                out[what] = "done"
            except OSError as e:
                out[what] = "denied" if e.errno in (1, 13, 18) else f"errno {e.errno}"
with tempfile.NamedTemporaryFile("w+", delete=False) as f:
    f.write("mine")
out["temp round trip"] = open(f.name).read()
out["temp dir"] = tempfile.gettempdir()
print("PROBE " + json.dumps(out), flush=True)
"""


def probe(
    paths: RunPaths, name: str, files: list[Path], env: dict[str, str] | None = None
) -> dict[str, str]:
    r = RoleProcess(
        name,
        [sys.executable, "-c", PROBE, *map(str, files)],
        paths.log(name),
        env=env or {},
        hidden=lambda: hidden_from(paths.auth),
        temp_dir=paths.dir / "tmp",
    )
    r.start()
    r.wait(60)
    assert r.proc is not None and r.proc.returncode == 0, r.tail()
    line = next(x for x in r.tail().splitlines() if x.startswith("PROBE "))
    result: dict[str, str] = json.loads(line.removeprefix("PROBE "))
    return result


def a_run(data: Path, run: str) -> RunPaths:
    """A run's directory as ``rlbus up`` lays it out before its roles start: identities,
    a config, the server's configuration (written by ``EmbeddedServer`` itself)."""
    paths = RunPaths(data, run)
    auth = RunAuth.ensure(paths.auth, run)
    paths.logs.mkdir(parents=True)
    paths.config.write_text("max_steps = 1\n")
    server = EmbeddedServer(paths.nats, users=auth.users())
    write_conf(server.conf_path, {"authorization": {"users": auth.users()}})
    return paths


def test_a_role_process_cannot_read_the_launchers_credentials_nor_its_memory(
    tmp_path: Path,
) -> None:
    paths = a_run(tmp_path / "runs", "r1")
    other = a_run(tmp_path / "runs", "r2")
    launcher = creds_path(paths.auth, "launcher")
    conf = EmbeddedServer(paths.nats, users=[]).conf_path
    assert conf.parent == launcher.parent  # beside the launcher's credentials, not the store
    readable = [creds_path(paths.auth, "env"), paths.config, Path(json.__file__)]
    secret = [
        launcher, conf,  # every password of this run
        creds_path(other.auth, "launcher"), creds_path(other.auth, "env"),  # another run's
    ]  # fmt: skip
    memory = Path(f"/proc/{os.getpid()}/environ")  # the launcher's: ptrace-guarded like its memory
    mine = paths.dir / "mine.creds"  # a file of its own run, to move over the launcher's
    mine.write_text("{}")
    seen = probe(paths, "env-0", [*readable, *secret, memory], env={"MINE": str(mine)})
    assert {str(p): seen[str(p)] for p in readable} == {str(p): "read" for p in readable}
    assert {str(p): seen[str(p)] for p in secret} == {str(p): "denied" for p in secret}
    assert seen[str(memory)] == "denied"
    assert {k: seen[k] for k in ("write", "remove", "make beside", "replace")} == dict.fromkeys(
        ("write", "remove", "make beside", "replace"), "denied"
    )
    assert json.loads(launcher.read_text())["kind"] == "launcher" and mine.exists()
    # the run lives under the system's temporary directory here: the role's is the run's
    assert seen["temp round trip"] == "mine"
    assert Path(seen["temp dir"]) == paths.dir / "tmp"
    # the launcher (this process) still reads its own
    assert json.loads(launcher.read_text())["kind"] == "launcher"


def test_the_run_directory_stays_whole_and_a_later_run_is_hidden(tmp_path: Path) -> None:
    """What a role makes in its run directory after it started, it reads back (its run
    directory is allowed whole); a run started after it is hidden from it (an entry that
    appears later beside the secrets' ancestors), and readable after its restart."""
    paths = a_run(tmp_path / "runs", "r1")
    later = tmp_path / "runs" / "r3" / "notes.txt"
    script = (
        "import sys, time\n"
        "mine = sys.argv[1] + '/made-later.txt'\n"
        "open(mine, 'w').write('x'); print('PROBE own', open(mine).read(), flush=True)\n"
        "p = sys.argv[2]\n"
        "while True:\n"
        "    try:\n"
        "        open(p).read(); print('PROBE read', flush=True); break\n"
        "    except FileNotFoundError: time.sleep(0.02)\n"
        "    except PermissionError: print('PROBE denied', flush=True); break\n"
    )
    r = RoleProcess(
        "late", [sys.executable, "-c", script, str(paths.dir), str(later)], paths.log("late"),
        hidden=lambda: hidden_from(paths.auth), temp_dir=paths.dir / "tmp",
    )  # fmt: skip
    r.start()
    time.sleep(0.3)
    later.parent.mkdir()
    later.write_text("x")
    r.wait(30)
    assert "PROBE own x" in r.tail() and "PROBE denied" in r.tail(), r.tail()
    r.start()
    r.wait(30)
    assert r.tail().splitlines()[-1] == "PROBE read"


def test_a_run_without_credentials_runs_its_roles_unconfined(tmp_path: Path) -> None:
    paths = RunPaths(tmp_path / "runs", "open")
    assert hidden_from(paths.auth) == []
