"""A dead role's last error, found in its log (``roles.up.role_errors.last_error``)."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from roles.up.role_errors import exit_text, last_error

TRACEBACK = """\
{"event": "role.starting", "level": "info"}
Traceback (most recent call last):
  File "/work/main/roles/inference/role.py", line 178, in setup
    self.backend = await make_backend(self.cfg, path, weights_dir)
                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "/work/main/roles/lib/model/loading.py", line 74, in resolve_source
    raise ModelNotFound(f"model path does not exist: {text}")
roles.lib.model.loading.ModelNotFound: model path does not exist: /nonexistent/model-x
"""

CHAINED = """\
Traceback (most recent call last):
  File "a.py", line 1, in <module>
KeyError: 'x'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "a.py", line 3, in <module>
    raise RuntimeError("while handling")
RuntimeError: while handling
  a note added to it
"""

GROUP = """\
  + Exception Group Traceback (most recent call last):
  |   File "x.py", line 3, in <module>
  |     async with asyncio.TaskGroup() as tg:
  | ExceptionGroup: unhandled errors in a TaskGroup (1 sub-exception)
  +-+---------------- 1 ----------------
    | Traceback (most recent call last):
    |   File "x.py", line 5, in work
    |     raise ValueError("boom")
    | ValueError: boom
    +------------------------------------
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "role.log"
    path.write_text(text)
    return path


def test_a_plain_traceback_gives_its_exception_line(tmp_path: Path) -> None:
    assert (
        last_error(write(tmp_path, TRACEBACK))
        == "ModelNotFound: model path does not exist: /nonexistent/model-x"
    )


def test_the_last_of_chained_tracebacks_counts(tmp_path: Path) -> None:
    assert last_error(write(tmp_path, CHAINED)) == "RuntimeError: while handling"


def test_an_exception_group_gives_its_sub_exception(tmp_path: Path) -> None:
    assert last_error(write(tmp_path, GROUP)) == "ValueError: boom"


def test_structlog_lines_give_their_exception_or_error(tmp_path: Path) -> None:
    exc = json.dumps({"event": "x.failed", "level": "error", "exception": TRACEBACK})
    assert last_error(write(tmp_path, exc + "\n")) == (
        "ModelNotFound: model path does not exist: /nonexistent/model-x"
    )
    err = json.dumps({"event": "role.task_failed", "level": "error", "error": "OSError(5)"})
    info = json.dumps({"event": "role.stopped", "level": "info"})
    assert last_error(write(tmp_path, f"{err}\n{info}\n")) == "role.task_failed: OSError(5)"


def test_only_the_log_since_the_last_start_counts(tmp_path: Path) -> None:
    """A restarted role appends to its log: an older crash is not the latest one's cause."""
    path = write(tmp_path, TRACEBACK)
    offset = path.stat().st_size
    with path.open("a") as f:
        f.write(json.dumps({"event": "role.started", "level": "info"}) + "\n")
    assert last_error(path, offset) is None
    assert last_error(tmp_path / "missing.log") is None


def test_a_one_line_message_and_a_long_one(tmp_path: Path) -> None:
    info = json.dumps({"event": "role.started", "level": "info"})
    assert last_error(write(tmp_path, f"{info}\ntrainer: lost the server\n")) == (
        "trainer: lost the server"
    )
    long = last_error(write(tmp_path, "ValueError: " + "x" * 500 + "\n"), width=80)
    assert long is not None and len(long) == 80 and long.endswith("…")


def test_exit_codes_in_words() -> None:
    assert exit_text(1) == "exit 1"
    assert exit_text(-signal.SIGKILL) == "killed by SIGKILL"
    assert exit_text(None) == "still running"
