"""Role processes that cannot read another identity's secrets.

Every process of one OS user can read every file of that user, so file modes alone
cannot keep the launcher's credentials and the server's configuration (which holds every
password; both in ``bus.auth.admin_directory``) from a role process on the same machine.
Linux's Landlock can: a process restricts itself and its future children, unprivileged,
for root too, and nothing it does afterwards lifts it.

``Sandbox(hidden)`` is built in the launcher: a Landlock ruleset that handles what a
process may do to files (read, write, truncate, remove, make, rename into, execute; not
list a directory) and allows it everywhere but beneath the ``hidden`` paths. Landlock only allows,
so "everywhere but" is spelled as every entry beside each hidden path and beside each
of its ancestors, as they are when the ruleset is built (a role's restart builds a new
one). A file that appears later directly in one of those directories is hidden too,
which is why the secrets sit outside every run directory (``<data>/.admin``): a run's
own directory is an entry beside them, allowed whole, new files included. A role's
temporary directory is kept out of the hidden paths' ancestors (``temp_dir_for``).

``preexec`` (run in the child between fork and exec) applies it: the child drops the
capabilities that reach past it from its bounding set and every ambient one (root keeps
only ``_KEPT_CAPABILITIES`` after exec: no ``CAP_SYS_PTRACE``, so Landlock also refuses
it the launcher's memory and environment through ``/proc``; no ``CAP_MKNOD``,
``CAP_SYS_ADMIN``, ``CAP_DAC_READ_SEARCH``), sets no-new-privileges, and restricts
itself. Raw block devices are hidden as well (they hold every file's bytes). What
appears later beside an ancestor of a hidden path can be neither read nor made: a new
entry directly in one of those directories is refused to the child.

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
# Landlock's filesystem rights by the ABI version that brought them. Every one is handled
# (so what lies beneath a hidden path can be neither read nor written, removed, renamed
# or replaced) but listing a directory (READ_DIR, bit 3): names are no secret, and
# Python's imports list the directories on their path, the hidden paths' ancestors too.
_FS_RIGHTS = {1: (1 << 13) - 1 - (1 << 3), 2: 1 << 13, 3: 1 << 14, 5: 1 << 15}
# What a rule on a file (not a directory) may grant: execute, write, read, truncate, ioctl.
_FILE_RIGHTS = (1 << 0) | (1 << 1) | (1 << 2) | (1 << 14) | (1 << 15)
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 24, 38
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
# Capabilities a sandboxed root keeps: none of them reaches past Landlock, and dropping
# them would break what roles do (files of other owners, pinned memory for RDMA, limits
# and priorities). Every other one goes, CAP_SYS_PTRACE (Landlock lets it reach the
# launcher's /proc), CAP_MKNOD (a device node of the disk) and CAP_SYS_ADMIN among them.
_KEPT_CAPABILITIES = frozenset({0, 1, 3, 10, 14, 23, 24})  # CHOWN DAC_OVERRIDE FOWNER
#   NET_BIND_SERVICE IPC_LOCK SYS_NICE SYS_RESOURCE


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


_LIBC = _libc()
# Looked up here, once: a child between fork and exec only calls them (bus.children).
_SYSCALL: Callable[..., int] | None = None if _LIBC is None else _LIBC.syscall
_PRCTL: Callable[..., int] | None = None if _LIBC is None else _LIBC.prctl


def _abi() -> tuple[int, str]:
    """Landlock's ABI version here (0: none) and, without one, why."""
    if _SYSCALL is None:
        return 0, f"Landlock is Linux's; this is {sys.platform}"
    abi = _SYSCALL(_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION)
    if abi < 1:
        return 0, f"this kernel has no Landlock ({os.strerror(ctypes.get_errno())})"
    return abi, ""


_ABI, _WHY_NOT = _abi()  # asked once: the kernel's answer does not change
_HANDLED = sum(bits for version, bits in _FS_RIGHTS.items() if version <= _ABI)


def unavailable_reason() -> str | None:
    """Why role processes cannot be sandboxed here; None when they can."""
    return _WHY_NOT or None


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
    rules: int  # entries allowed (beside the hidden paths and their ancestors)

    @classmethod
    def build(cls, hidden: Iterable[str | Path]) -> Sandbox | None:
        """The ruleset hiding ``hidden`` (and raw block devices); None where Landlock is
        unavailable (``unavailable_reason``)."""
        if unavailable_reason() is not None:
            return None
        assert _SYSCALL is not None
        hide = {Path(os.path.realpath(p)) for p in hidden} | set(_block_devices())
        above = {a for h in hide for a in h.parents}
        handled = _HANDLED
        attr = struct.pack("=Q", handled)
        fd = _check(_SYSCALL(_CREATE_RULESET, attr, len(attr), 0), "landlock_create_ruleset")
        os.set_inheritable(fd, False)
        rules = 0
        try:
            for directory in sorted(above):
                try:
                    with os.scandir(directory) as entries:
                        beside = [Path(e.path) for e in entries]
                except OSError:
                    continue  # not made yet, or not ours to list: nothing beside it allowed
                for path in beside:
                    if path in hide or path in above:
                        continue
                    rules += _allow(fd, path, handled)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, rules)

    def preexec(self) -> None:
        """In the child, between fork and exec: drop the capabilities that reach past the
        sandbox from the bounding set (where this process may: root) and every ambient
        one, forbid gaining privileges, restrict."""
        assert _PRCTL is not None and _SYSCALL is not None
        for cap in _DROPPED:
            _PRCTL(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EPERM without CAP_SETPCAP: none held
        _PRCTL(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        _check(_PRCTL(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        _check(_SYSCALL(_RESTRICT_SELF, self.ruleset_fd, 0), "landlock_restrict_self")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.ruleset_fd)


def _allow(ruleset_fd: int, path: Path, handled: int) -> int:
    """Allow everything ``handled`` beneath ``path`` (a directory, or one file: its file
    rights); 0 when it vanished meanwhile or cannot be opened (then it stays hidden)."""
    assert _SYSCALL is not None
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return 0
    try:
        rights = handled if stat.S_ISDIR(os.fstat(fd).st_mode) else handled & _FILE_RIGHTS
        attr = struct.pack("=Qi", rights, fd)
        if _SYSCALL(_ADD_RULE, ruleset_fd, _RULE_PATH_BENEATH, attr, 0) < 0:
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


# Computed here: the child between fork and exec reads nothing.
_DROPPED = tuple(c for c in range(_last_capability() + 1) if c not in _KEPT_CAPABILITIES)


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
