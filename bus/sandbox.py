"""Role processes that cannot read another identity's secrets.

Every process of one OS user can read every file of that user, so file modes alone
cannot keep the launcher's credentials and the server's configuration (which holds every
password; both in ``bus.auth.admin_directory``) from a role process on the same machine.
Linux's Landlock can: a process restricts itself and its future children, unprivileged,
for root too, and nothing it does afterwards lifts it.

``Sandbox(hidden)`` is built in the launcher: a Landlock ruleset that handles reading
files and allows it everywhere but beneath the ``hidden`` paths. Landlock only allows,
so "everywhere but" is spelled as every entry beside each hidden path and beside each
of its ancestors, as they are when the ruleset is built (a role's restart builds a new
one). A file that appears later directly in one of those directories is hidden too,
which is why the secrets sit outside every run directory (``<data>/.admin``): a run's
own directory is an entry beside them, allowed whole, new files included. A role's
temporary directory is kept out of the hidden paths' ancestors (``temp_dir_for``).

``preexec`` (run in the child between fork and exec) applies it: the child drops every
capability from its bounding set (root keeps none after exec: no ``CAP_SYS_PTRACE``, so
Landlock also refuses it the launcher's memory and environment through ``/proc``; no
``CAP_DAC_READ_SEARCH`` to open by handle), sets no-new-privileges, and restricts
itself. Raw block devices are hidden as well (they hold every file's bytes).

Where the kernel has no Landlock (Linux before 5.13, or not enabled; macOS), ``Sandbox``
is None and ``unavailable_reason`` says why: roles run unconfined, as every process of
one user does.

    sandbox = Sandbox.build([data / ".admin"])
    subprocess.Popen(argv, preexec_fn=sandbox.preexec)   # or with_sandbox(other, sandbox)
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import stat
import struct
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

# Linux's syscall numbers for Landlock (the same on every architecture) and its constants
_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_ACCESS_FS_READ_FILE = 1 << 2
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 24, 38


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


_LIBC = _libc()


def unavailable_reason() -> str | None:
    """Why role processes cannot be sandboxed here; None when they can."""
    if _LIBC is None:
        return f"Landlock is Linux's; this is {sys.platform}"
    abi = _LIBC.syscall(_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION)
    if abi < 1:
        return f"this kernel has no Landlock ({os.strerror(ctypes.get_errno())})"
    return None


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def _block_devices() -> list[Path]:
    """Raw disks under /dev: reading one reads every file on it."""
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/dev"):
            with contextlib.suppress(OSError):
                if stat.S_ISBLK(entry.stat(follow_symlinks=False).st_mode):
                    found.append(Path(entry.path))
    return found


@dataclass
class Sandbox:
    """A Landlock ruleset (an open file descriptor in this process) that lets a child read
    every file but those beneath ``hidden``; ``preexec`` applies it in the child."""

    ruleset_fd: int
    hidden: tuple[Path, ...]
    rules: int  # entries allowed (beside the hidden paths and their ancestors)

    @classmethod
    def build(cls, hidden: Iterable[str | Path]) -> Sandbox | None:
        """The ruleset hiding ``hidden`` (and raw block devices); None where Landlock is
        unavailable (``unavailable_reason``)."""
        if unavailable_reason() is not None:
            return None
        assert _LIBC is not None
        hide = {Path(os.path.realpath(p)) for p in hidden} | set(_block_devices())
        above = {a for h in hide for a in h.parents}
        attr = struct.pack("=Q", _ACCESS_FS_READ_FILE)
        fd = _check(_LIBC.syscall(_CREATE_RULESET, attr, len(attr), 0), "landlock_create_ruleset")
        os.set_inheritable(fd, False)
        rules = 0
        try:
            for directory in sorted(above):
                try:
                    with os.scandir(directory) as entries:
                        beside = [Path(e.path) for e in entries]
                except (FileNotFoundError, NotADirectoryError):
                    continue  # a hidden path not made yet: nothing beside it to allow
                for path in beside:
                    if path in hide or path in above:
                        continue
                    rules += _allow_reading(fd, path)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, tuple(sorted(hide)), rules)

    def preexec(self) -> None:
        """In the child, between fork and exec: drop every capability from the bounding
        set (where this process may: root), forbid gaining privileges, restrict."""
        assert _LIBC is not None
        for cap in range(_LAST_CAPABILITY + 1):
            _LIBC.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EPERM without CAP_SETPCAP: none held
        _check(_LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        _check(_LIBC.syscall(_RESTRICT_SELF, self.ruleset_fd, 0), "landlock_restrict_self")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.ruleset_fd)


def _allow_reading(ruleset_fd: int, path: Path) -> int:
    """Allow reading files beneath ``path`` (a directory, or one file); 0 when it vanished
    meanwhile or cannot be opened (then it stays hidden)."""
    assert _LIBC is not None
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return 0
    try:
        attr = struct.pack("=Qi", _ACCESS_FS_READ_FILE, fd)
        if _LIBC.syscall(_ADD_RULE, ruleset_fd, _RULE_PATH_BENEATH, attr, 0) < 0:
            if ctypes.get_errno() in (errno.EINVAL, errno.EBADFD):  # e.g. a socket
                return 0
            _check(-1, f"landlock_add_rule {path}")
        return 1
    finally:
        os.close(fd)


def _last_capability() -> int:
    try:
        return int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    except (OSError, ValueError):
        return 63  # dropping a capability the kernel does not have is harmless (EINVAL)


_LAST_CAPABILITY = _last_capability()  # read here: the child between fork and exec reads nothing


def temp_dir_for(hidden: Iterable[str | Path], fallback: Path) -> Path | None:
    """The temporary directory a sandboxed child should use: ``fallback`` (which must
    exist before the sandbox is built) when the system's lies above a hidden path (its
    new entries would be hidden from the child, e.g. a run under /tmp), else None (the
    system's is fine)."""
    import tempfile

    system = Path(os.path.realpath(tempfile.gettempdir()))
    if any(system in Path(os.path.realpath(h)).parents for h in hidden):
        return fallback
    return None


def with_sandbox(
    first: Callable[[], None] | None, sandbox: Sandbox | None
) -> Callable[[], None] | None:
    """A ``preexec_fn`` that runs ``first`` (e.g. ``bus.children.die_with_parent``), then
    applies ``sandbox``."""
    if sandbox is None:
        return first

    def preexec() -> None:
        if first is not None:
            first()
        sandbox.preexec()

    return preexec
