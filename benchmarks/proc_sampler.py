"""What every process of a launcher's tree costs, read from /proc (no psutil).

A ``Sampler`` thread looks at the process tree under one root pid every ``interval_s``
(0.1 s) and records, per process: its role name, CPU time (user + sys, from
/proc/<pid>/stat), thread count and the CPUs it may run on (/proc/<pid>/status), and
when it was seen. Per interval it also sums its threads' /proc/<pid>/task/*/schedstat:
time on a CPU (in ns: stat's 10 ms ticks are too coarse for 0.1 s intervals) and time
runnable but waiting for a CPU (run-queue wait: contention on a small machine).
``roles()`` folds the processes into one row per role (restarts and a role's own
children add up); ``series()`` is each role's CPU utilisation and run-queue wait per
sampling interval, for a timeline.

    with Sampler(proc.pid) as sampler:   # proc: the `rlbus up` Popen
        proc.wait()
    sampler.roles(), sampler.series()

A role's name comes from where its stdout goes (``rlbus up`` sends each role to
``runs/<run>/logs/<name>.log``, and children inherit it), else from its command line
(``nats-server``, ``launcher`` for ``roles.cli up``, ``role <kind>``), read again at
every sample (a forked child takes its name when it execs).
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TICK = os.sysconf("SC_CLK_TCK")


def read(path: str) -> str:
    """A small /proc file (os.open: a third of ``Path.read_text``'s cost, which adds up
    over every process of the machine ten times a second)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 65536).decode(errors="replace")
    finally:
        os.close(fd)


def read_stat(pid: int) -> tuple[int, float, float]:
    """(parent pid, CPU seconds user + sys, start time in seconds since boot)."""
    text = read(f"/proc/{pid}/stat")
    fields = text[text.rindex(")") + 2 :].split()  # the command name may hold spaces and ")"
    # fields[0] is field 3 (state): ppid = 4, utime = 14, stime = 15, starttime = 22
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / TICK, int(fields[19]) / TICK


def read_status(pid: int) -> dict[str, str]:
    """The ``Threads`` and ``Cpus_allowed_list`` lines of /proc/<pid>/status."""
    out = {}
    for line in read(f"/proc/{pid}/status").splitlines():
        key, _, value = line.partition(":")
        if key in ("Threads", "Cpus_allowed_list"):
            out[key] = value.strip()
    return out


def read_schedstat(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one), summed over the live
    threads of ``pid`` (/proc/<pid>/task/*/schedstat, in ns: finer than stat's ticks)."""
    run = delay = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = read(f"/proc/{pid}/task/{tid}/schedstat").split()
        except OSError:  # the thread ended since listdir
            continue
        run, delay = run + int(fields[0]), delay + int(fields[1])
    return run / 1e9, delay / 1e9


def boot_clock() -> float:
    """Seconds since boot: the clock /proc/<pid>/stat start times are on."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def role_name(argv: list[str], stdout_target: str) -> str:
    """The role a process belongs to (see the module docstring)."""
    if m := re.search(r"/logs/([^/]+)\.log$", stdout_target):
        return m.group(1)
    if argv and Path(argv[0]).name == "nats-server":
        return "nats-server"
    if "roles.cli" in argv:
        rest = argv[argv.index("roles.cli") + 1 :]
        if rest[:1] == ["up"]:
            return "launcher"
        if rest[:1] == ["role"] and len(rest) > 1:
            return rest[1]
    return Path(argv[0]).name if argv else "?"


def describe(pid: int) -> str:
    """The role name of a live process (its command line and stdout)."""
    argv = read(f"/proc/{pid}/cmdline").split("\0")
    try:
        target = os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        target = ""
    return role_name([a for a in argv if a], target)


@dataclass
class Proc:
    pid: int
    name: str
    started: float  # boot clock
    cpu_s: float = 0.0  # user + sys of every thread, ended ones included (stat)
    run_s: float = 0.0  # on a CPU, live threads (schedstat): for deltas
    delay_s: float = 0.0  # runnable, waiting for a CPU, live threads (schedstat)
    runq_s: float = 0.0  # the delay's increments summed: time waiting for a CPU
    last_seen: float = 0.0  # boot clock
    cpus_allowed: str = ""
    threads: dict[int, int] = field(default_factory=dict)  # sample index -> threads


@dataclass
class Sampler:
    root: int
    interval_s: float = 0.1
    procs: dict[int, Proc] = field(default_factory=dict)  # the tree's live processes
    ended: list[Proc] = field(default_factory=list)  # the tree's processes that exited
    times: list[float] = field(default_factory=list)  # wall clock (time.time()) per sample
    # role -> (seconds on a CPU, seconds waiting for one) over the interval to each sample
    cpu: list[dict[str, tuple[float, float]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> Sampler:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def _in_tree(self, pid: int, parents: dict[int, int]) -> bool:
        """Whether ``pid`` is the root or descends from it (or from a process of the
        tree already known: a child outlives its parent's exit for a moment)."""
        for _ in range(64):  # deeper than any tree of ours
            if pid == self.root or pid in self.procs:
                return True
            pid = parents.get(pid, 0)
            if pid <= 1:
                return False
        return False

    def sample(self) -> None:
        """One look at the tree: new processes found, every live one measured. Every
        other process's parent is read afresh each time (~1 ms for 100 processes): no
        verdict about a pid is kept, so a reused pid cannot be misjudged."""
        pids = {int(p) for p in os.listdir("/proc") if p.isdigit()}
        for pid in [p for p in self.procs if p not in pids]:
            self.ended.append(self.procs.pop(pid))
        parents = {}
        for pid in pids - self.procs.keys():
            try:
                parents[pid] = read_stat(pid)[0]
            except (OSError, ValueError, IndexError):  # gone since listdir
                continue
        now, index, spent = boot_clock(), len(self.times), {}
        for pid in sorted(pids):
            known = self.procs.get(pid)
            if known is None and not (pid in parents and self._in_tree(pid, parents)):
                continue
            try:
                _, cpu_s, started = read_stat(pid)
                status = read_status(pid)
                run_s, delay_s = read_schedstat(pid)
                # Read again while young: a forked child takes its name when it execs.
                young = known is None or known.started != started or now - started < 5.0
                name = describe(pid) if young else known.name
            except (OSError, ValueError, IndexError):  # exited while we looked
                continue
            if known is not None and known.started != started:  # exited, pid reused at once
                self.ended.append(known)
                known = None
            if known is None:
                if name == "?":  # a zombie already: nothing left to measure
                    continue
                known = self.procs[pid] = Proc(pid, name, started)
            elif name != "?":  # a zombie's command line is empty: it keeps its name
                known.name = name
            # A thread that ended takes its counts along: a negative delta is clipped.
            run, wait = max(run_s - known.run_s, 0.0), max(delay_s - known.delay_s, 0.0)
            before = spent.get(known.name, (0.0, 0.0))
            spent[known.name] = (before[0] + run, before[1] + wait)
            known.runq_s += wait
            known.cpu_s, known.run_s, known.delay_s, known.last_seen = cpu_s, run_s, delay_s, now
            known.cpus_allowed = status.get("Cpus_allowed_list", known.cpus_allowed)
            known.threads[index] = int(status.get("Threads", 0))
        self.times.append(time.time())
        self.cpu.append(spent)

    def series(self) -> dict[str, Any]:
        """``t`` (wall clock per sample), each role's CPU utilisation (``util``: cores
        busy) and run-queue wait (``runq``: its threads runnable but waiting for a CPU,
        in cores) over the interval that ends at that sample (the first has none)."""
        roles = sorted({name for c in self.cpu for name in c})
        util: dict[str, list[float]] = {r: [] for r in roles}
        runq: dict[str, list[float]] = {r: [] for r in roles}
        for i in range(1, len(self.times)):
            dt = max(self.times[i] - self.times[i - 1], 1e-9)
            for r in roles:
                run, wait = self.cpu[i].get(r, (0.0, 0.0))
                util[r].append(round(run / dt, 3))
                runq[r].append(round(wait / dt, 3))
        return {"t": self.times[1:], "util": util, "runq": runq}

    def roles(self) -> dict[str, dict[str, Any]]:
        """One row per role: its processes' CPU and wall time, utilisation, threads
        (summed over its processes alive at once), the CPUs its processes may use."""
        rows: dict[str, dict[str, Any]] = {}
        seen = [*self.ended, *self.procs.values()]
        for name in sorted({p.name for p in seen}):
            procs = [p for p in seen if p.name == name]
            cpu_s = sum(p.cpu_s for p in procs)
            wall_s = sum(max(p.last_seen - p.started, 0.0) for p in procs)
            per_sample: dict[int, int] = {}
            for p in procs:
                for i, n in p.threads.items():
                    per_sample[i] = per_sample.get(i, 0) + n
            threads = list(per_sample.values())
            rows[name] = {
                "processes": len(procs),
                "cpu_s": round(cpu_s, 2),
                "wall_s": round(wall_s, 2),
                "cpu_util": round(cpu_s / wall_s, 3) if wall_s > 0 else None,
                "runq_wait_s": round(sum(p.runq_s for p in procs), 2),
                "threads_max": max(threads, default=None),
                "threads_mean": round(sum(threads) / len(threads), 1) if threads else None,
                "cpus_allowed": sorted({p.cpus_allowed for p in procs if p.cpus_allowed}),
            }
        return rows
