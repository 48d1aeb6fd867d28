"""A role process's torch intra-op thread count: ``$RLBUS_TORCH_THREADS`` (default 1).

``rlbus up``'s CPU plan sets it for every role it starts (``roles.up.cpu_plan``); the
inference engine and the trainer read it at start. The trainer's float sums depend on
how work is split across threads, so the trainer records the count in its metrics and
``rlbus replay`` trains with the recorded one (``replay.trainer``).
"""

from __future__ import annotations

import os

THREADS_ENV = "RLBUS_TORCH_THREADS"


def torch_threads() -> int:
    """The thread count this process was given (1 when unset)."""
    return int(os.environ.get(THREADS_ENV, "1"))
