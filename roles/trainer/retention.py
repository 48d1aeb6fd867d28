"""Which published weights stay in a run's object store: a pure rule, no I/O.

Every stored version is an object (``weights.v<N>`` in ``RLOBJ_<run>``) or, past
``OBJECT_STORE_MAX_BYTES``, a file (``<run_dir>/weights/v<N>.safetensors``), named by its
``weights.published`` (or, with ``trainer.weights_via`` "ipc" / "broadcast", where only
some versions are stored, by its ``weights.stored``). Left alone they fill the disk (a
default run publishes 500 versions), yet almost nothing reads one back:

- inference loads only the newest announcement (at start, then the newest of those that
  piled up while it loaded); a version it picked may be superseded while it loads, which
  is what the margin of ``trainer.keep_weights`` newest versions is for;
- the orchestrator, the lake, ``rlbus trace`` and replay read announcements (versions and
  digests), never the bytes: replay recomputes every step from the initial weights;
- checkpoints hold their own ``model.safetensors``; teacher and reference models load
  from a path (``orchestrator.models``), never from the object store, except a policy
  snapshot (``policy_version``), whose version is kept for the whole run
  (``RunConfig.pinned_versions``);
- the initial weights (``weights.v0``, stored by the orchestrator) are where replay and
  import restore the initial model from when its directory is gone, so they are kept.

The trainer applies the rule after each announcement is stored (and to what a previous
process left behind at start); a fork (``rlbus replay --fork``) stores only what it keeps.
Every ``REWRITE_INITIAL_EVERY`` collected versions the trainer also writes ``weights.v0``
again (same bytes), so the disk space of what it deleted is freed at once.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from configs import RunConfig

INITIAL_VERSION = 0  # the run's initial weights: never collected
OBJECT_PREFIX = "weights.v"
# Collected versions between two rewrites of the initial weights object. It is the oldest
# live object of the bucket, and the file store frees blocks from the stream's head; while
# it stays at the head, blocks emptied behind it are only freed by the server's periodic
# compaction (``BodyStore.rewrite``). Every 16 versions: one extra write of the initial
# weights per 16 versions deleted, and at most ~16 deleted versions still on disk.
REWRITE_INITIAL_EVERY = 16

_OBJECT_NAME = re.compile(r"^weights\.v(\d+)$")
_FILE_NAME = re.compile(r"^v(\d+)\.safetensors$")


def object_name(version: int) -> str:
    """The object-store name of a weights version."""
    return f"{OBJECT_PREFIX}{version}"


def file_name(version: int) -> str:
    """The file name of a weights version too large for the object store."""
    return f"v{version}.safetensors"


def version_of_object(name: str) -> int | None:
    """The version an object name holds, or None for anything else (bodies)."""
    m = _OBJECT_NAME.match(name)
    return int(m.group(1)) if m else None


def version_of_file(name: str) -> int | None:
    """The version a weights file name holds, or None for anything else."""
    m = _FILE_NAME.match(name)
    return int(m.group(1)) if m else None


def collectable(versions: Iterable[int], newest: int, keep: int) -> list[int]:
    """Which of the stored ``versions`` no reader needs once ``newest`` is announced,
    oldest first.

    The newest ``keep`` stored versions up to ``newest`` stay (``keep <= 0``: every
    version stays): stored versions, not steps, since with ``trainer.weights_via = "ipc"``
    or ``"broadcast"`` only every ``trainer.store_weights_every``-th is. The initial
    weights always stay, and so does anything newer than ``newest`` (stored, not yet
    announced).
    """
    if keep <= 0:
        return []
    announced = sorted(v for v in set(versions) if INITIAL_VERSION < v <= newest)
    return announced[:-keep]


def collectable_in(cfg: RunConfig, versions: Iterable[int], newest: int) -> list[int]:
    """``collectable`` with ``trainer.keep_weights``, a policy snapshot's versions
    (``RunConfig.pinned_versions``) neither collected nor counted among those kept."""
    pinned = cfg.pinned_versions()
    return collectable([v for v in versions if v not in pinned], newest, cfg.trainer.keep_weights)
