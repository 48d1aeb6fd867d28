"""One live launcher per run id, and a run id that is never reused by accident.

``rlbus up --run X`` takes an exclusive ``flock`` on ``runs/X/launcher.lock`` for as long
as it lives. The kernel releases the lock when the launcher exits, however it exits, so
a crashed launcher never leaves a stale lock behind. A second launcher for a live X is
refused before it touches anything of X.

A run id that already has data (a run directory with a config, or a stream on a given
server) is refused too, unless the user says what to do with it:

    rlbus up --run X --resume                 # continue an interrupted X, with X's own config
    rlbus up --run X --resume max_steps=600   # ... changing keys a run may change mid-way
    rlbus up --run X --fresh                  # delete X (its store, logs, checkpoints), start over

``--resume`` may change only ``RESUMABLE`` keys (``resume_override_problem``): those no
step already trained or decided depends on. The orchestrator records the changed config
as a ``run.started`` with ``resumed=True`` that opens the run's next segment, so a
replay switches config where the run did (``replay.trainer``). A finished X (its
summary records why it stopped) resumes only to train on: it stopped at ``max_steps``
and the new ``max_steps`` is above the steps it trained; anything else has nothing left
to do (the orchestrator would stop again at once). An interrupted X is refused a
``max_steps`` below the steps it trained.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from dataclasses import dataclass
from typing import IO, Literal

from configs.paths import CHECKPOINT_PREFIX, RunPaths

Mode = Literal["new", "resume", "fresh"]
LOCK_FILE = "launcher.lock"

# Keys ``--resume`` may change, each because no step trained or decided so far depends on
# it: how far the run trains, which later versions are evaluated, when a stall stops the
# run, and how checkpoints are written and kept. The list is short on purpose: a key not
# here (the learning rate, the batch size, the envs) would make the log say one thing
# and the run do another.
RESUMABLE = (
    "max_steps",
    "orchestrator.eval.interval",
    "orchestrator.stall_stop_s",
    "trainer.checkpoint_interval",
    "trainer.keep_checkpoints",
    "trainer.checkpoint_keep_every",
)
# Where the run lives, not a change to it (``bus.data_dir`` finds the run directory).
_LOCATING = ("bus.data_dir",)


def resume_override_problem(overrides: list[str]) -> str | None:
    """Why ``rlbus up --resume`` refuses ``overrides`` (dotted ``key=value``), or None."""
    for override in overrides:
        key = override.partition("=")[0].strip()
        if key not in RESUMABLE and key not in _LOCATING:
            return (
                f"--resume cannot change {key}: a run resumes with its own config, and may "
                f"change only {', '.join(RESUMABLE)}"
            )
    return None


class RunRefused(Exception):
    """``rlbus up`` will not start this run; the message says why and what to do."""


@dataclass(frozen=True)
class PreviousRun:
    """What a run directory says about an earlier launch of the same id."""

    stopped: str | None  # the stop reason of a finished run; None: interrupted
    steps: int | None  # steps the last launcher saw, if it wrote a summary

    def describe(self) -> str:
        at = "" if self.steps is None else f" at step {self.steps}"
        return f"finished ({self.stopped}{at})" if self.stopped else f"interrupted{at}"


def previous_run(paths: RunPaths) -> PreviousRun | None:
    """The earlier launch of ``paths.run`` in this data directory, if there was one (a
    launch writes the run's config before any role starts; a store alone may belong to
    a server someone runs for a ``--nats-url`` run)."""
    if not paths.config.exists():
        return None
    try:
        summary = json.loads(paths.summary.read_text())
    except (OSError, ValueError):
        return PreviousRun(stopped=None, steps=None)  # no summary: the launcher was killed
    stopped = summary.get("stopped") or {}
    return PreviousRun(stopped=stopped.get("reason"), steps=summary.get("steps"))


def steps_done(paths: RunPaths, previous: PreviousRun) -> int | None:
    """Steps the run has trained, as far as its directory tells: what its last summary
    saw, else its newest checkpoint's step (a launcher that was killed wrote no summary);
    None when neither is there."""
    if previous.steps is not None:
        return previous.steps
    steps = [
        int(suffix)
        for p in paths.checkpoints.glob(f"{CHECKPOINT_PREFIX}*")
        if (suffix := p.name.removeprefix(CHECKPOINT_PREFIX)).isdigit()
        and (p / "state.json").exists()
    ]
    return max(steps, default=None)


class RunLock:
    """The exclusive launcher lock of one run (see the module docstring)."""

    def __init__(self, paths: RunPaths):
        self.paths = paths
        self.path = paths.dir / LOCK_FILE
        self._file: IO[str] | None = None

    def __enter__(self) -> RunLock:
        self.paths.dir.mkdir(parents=True, exist_ok=True)
        f = self.path.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "?"
            f.close()
            raise RunRefused(
                f"run {self.paths.run!r} is live: launcher pid {holder} holds {self.path}; "
                "pick another --run, or stop that launcher first"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f
        return self

    def __exit__(self, *exc: object) -> None:
        if self._file is not None:
            self._file.close()  # releases the flock; the file stays (unlinking races)
            self._file = None


def check_previous(
    paths: RunPaths, mode: Mode, previous: PreviousRun | None, max_steps: int | None = None
) -> None:
    """Raise ``RunRefused`` unless ``mode`` says what to do with an earlier launch;
    ``max_steps``: the resumed config's (None: a finished run is never resumed)."""
    run = paths.run
    if mode == "resume":
        if previous is None:
            raise RunRefused(f"nothing to resume: run {run!r} has no data under {paths.dir}")
        done = steps_done(paths, previous)
        extends = max_steps is not None and done is not None and max_steps > done
        if previous.stopped and not (previous.stopped == "max_steps" and extends):
            more = (
                f"raise max_steps above {done} to train on (--resume max_steps=N), or "
                if previous.stopped == "max_steps" and done is not None
                else ""
            )
            raise RunRefused(
                f"run {run!r} is {previous.describe()}: nothing to resume; "
                f"{more}--fresh deletes it and starts over"
            )
        if max_steps is not None and done is not None and max_steps < done:
            raise RunRefused(
                f"run {run!r} has trained {done} steps: max_steps = {max_steps} is below them; "
                f"resume with max_steps >= {done}"
            )
    elif mode == "new" and previous is not None:
        raise RunRefused(
            f"run {run!r} already exists: {previous.describe()}, in {paths.dir}; "
            "--resume continues an interrupted run, --fresh deletes it and starts over, "
            "or pick another --run"
        )


def start_over(paths: RunPaths) -> None:
    """Delete everything of the run directory but the lock (``--fresh``). Refuses while a
    nats-server still runs on the run's store: deleting a live store corrupts it."""
    from bus.server import running_server_url

    if url := running_server_url(paths.nats):
        raise RunRefused(
            f"a nats-server is still running on run {paths.run!r}'s store ({url}); "
            "stop it before --fresh"
        )
    shutil.rmtree(paths.shm_weights, ignore_errors=True)  # trainer.weights_via = "shm"
    for child in paths.dir.iterdir():
        if child.name == LOCK_FILE:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


async def stream_exists(url: str, run: str) -> bool:
    """Whether the server at ``url`` holds the run's stream (a run on a given server has
    no local directory to tell)."""
    from bus.runtime import Bus

    bus = await Bus.connect(url, run=run, producer="launcher")
    try:
        return await bus.has_stream()
    finally:
        await bus.close()


async def delete_stream(url: str, run: str) -> None:
    """Delete the run's stream, object store and role registry on the server at ``url``
    (``--fresh``)."""
    from bus.runtime import Bus

    bus = await Bus.connect(url, run=run, producer="launcher")
    try:
        await bus.delete_run()
    finally:
        await bus.close()
