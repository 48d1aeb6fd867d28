"""Child processes that do not outlive their parent.

``rlbus up`` starts the nats-server and every role in their own sessions (so a Ctrl-C in
the terminal reaches the launcher alone, which then stops the roles in order). A process
in its own session survives its parent, so a launcher killed with SIGKILL, or a CLI
command killed while it holds a temporary server, would leave orphans behind. Linux
solves this with the parent-death signal (``prctl(PR_SET_PDEATHSIG)``), set in the child
between fork and exec; it survives the exec of ``nats-server`` and of Python.

One sharp edge: the kernel sends the signal when the *thread* that forked the child
exits, not the process. Start these children from a long-lived thread (the main thread,
or the event loop's): never from ``asyncio.to_thread``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    fn: Callable[..., int] = libc.prctl
    return fn


_PRCTL = _prctl()  # looked up once, in the parent: the child only calls it


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets ``sig`` when this process
    dies, however it dies. None where the platform has no parent-death signal (macOS):
    there, only a clean shutdown of the parent stops its children."""
    if _PRCTL is None:
        return None
    prctl, parent = _PRCTL, os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), sig)

    return preexec
