"""Keeps a run's role processes alive and watches the run through its stream.

Started by ``rlbus up`` (``roles/up/launcher.py``). It reads metrics, weights and stop
events (and only the headers of completed traces and evals, to count rollouts) with
ordered consumers (``RunFollower``), restarts a role process that dies and shows the last
error of its log (``RoleKeeper``), restarts the embedded nats-server it started when that
dies, on the same port and store (``ServerKeeper``), says when a running role stops
beating (``roles.up.silence.SilenceWatch``), reads the heartbeats for which roles are
still starting and for the orchestrator's rollout counts and stalls, a stall said once
on the console (``BeatWatch``), resizes the elastic env and inference pools
(``roles.up.pools.PoolKeeper``), prints the orchestrator's reason in one line when the
run stops (``run stopped: <reason>: <detail>``), and on ``run.stopped`` stops every
role with SIGTERM, in order, so each drains its in-flight work (``stop_in_order``), the
view showing which role is draining. Ctrl-C, SIGTERM or SIGHUP (the terminal closed)
pause the run instead: nothing is waited for that would not be trained before it
resumes (``INTERRUPT_ORDER``), a second one kills the roles, and the report and
``summary.json`` say how to go on (``rlbus up --run R --resume``). Each launch of a run
is a segment of its summary (``begin_segment``; ``roles.up.monitor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from bus.errors import ServerStartError
from bus.log import get_logger
from bus.reader import LogReader, last_seq, stored_event
from bus.runtime import Bus
from bus.sandbox import unavailable_reason
from bus.server import EmbeddedServer
from bus.subjects import Topic, topic_of_subject
from configs import RunConfig
from configs.paths import RunPaths, resolve_data_dir
from roles.runtime.context import bus_settings
from roles.up.monitor import RunMonitor, earlier_segments
from roles.up.pools import Pool, PoolKeeper
from roles.up.processes import RoleProcess, write_summary
from roles.up.role_errors import exit_text, last_error
from roles.up.silence import SilenceWatch, live_beats, silence_limit_s
from schemas import MetricsReported, RunStarted, RunStopped, WeightsPublished

if TYPE_CHECKING:
    from roles.up.view import LiveView

TYPES = (MetricsReported, RunStarted, RunStopped, WeightsPublished)
MAX_RESTARTS = 5
# The embedded server may die this many times within the window and be restarted; once
# more and the run stops: something kills it, and restarting it again would only hide that.
MAX_SERVER_RESTARTS, SERVER_RESTART_WINDOW_S = 3, 60.0
# Each stops the run like Ctrl-C: the roles drain and stop (SIGHUP: the terminal closed).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class RunFollower:
    """Folds the run's stream into a ``RunMonitor`` with two ordered consumers: start,
    stop, weights and metrics events in full; completed traces and evals by their headers
    alone (their bodies are large, and the monitor only counts them)."""

    EVENTS = (Topic.RUN_STARTED, Topic.RUN_STOPPED, Topic.WEIGHTS_PUBLISHED, Topic.METRICS_REPORTED)
    COUNTED = (Topic.TRACE_COMPLETED, Topic.EVAL_COMPLETED)

    def __init__(self, bus: Bus, monitor: RunMonitor, idle_timeout_s: float = 1.0) -> None:
        self.bus, self.monitor = bus, monitor
        self.stop = asyncio.Event()
        self.events = LogReader(
            bus, topics=[(t, None) for t in self.EVENTS], follow=True,
            idle_timeout_s=idle_timeout_s, stop=self.stop,
        )  # fmt: skip
        self.counts = LogReader(
            bus, topics=[(t, None) for t in self.COUNTED], follow=True,
            idle_timeout_s=idle_timeout_s, headers_only=True, stop=self.stop,
        )  # fmt: skip
        self.tasks: list[asyncio.Task[None]] = []
        self.run_stopped = asyncio.Event()  # folded a run.stopped: the launcher acts at once

    def start(self) -> None:
        self.tasks = [asyncio.create_task(self._fold()), asyncio.create_task(self._count())]

    def check(self) -> None:
        """Raise what a reader failed with."""
        for task in self.tasks:
            if task.done():
                task.result()

    async def finish(self, timeout_s: float = 10.0) -> None:
        """Read on up to what the stream holds now (what the roles published while they
        drained), then stop reading. Idempotent."""
        if not self.stop.is_set():
            try:
                await asyncio.wait_for(self._catch_up(), timeout_s)
            except Exception as e:  # no server, or too slow: stop where the readers are
                self.bus.log.warning("follower.catch_up_incomplete", error=repr(e))
            self.stop.set()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _catch_up(self) -> None:
        readers = [(self.events, self.EVENTS), (self.counts, self.COUNTED)]
        for (reader, topics), task in zip(readers, self.tasks, strict=True):
            newest = max([await last_seq(self.bus, t) for t in topics])
            while reader.last_seq < newest and not task.done():
                await asyncio.sleep(0.05)

    async def _fold(self) -> None:
        async with contextlib.aclosing(self.events.messages()) as messages:
            async for msg in messages:
                try:
                    event = await stored_event(self.bus, msg)
                except Exception as e:  # noqa: BLE001 - no message may stop the launcher
                    # Not only DecodeError/BodyError: a forged body reference can fail in
                    # nats-py (an invalid bucket name). Its owner dead-letters it.
                    self.monitor.unreadable(msg.metadata.sequence.stream, msg.subject, e)
                    continue
                self.monitor.passed(msg.metadata.sequence.stream)
                if isinstance(event, TYPES):
                    self.monitor.apply(event)
                    if self.monitor.stopped is not None:
                        self.run_stopped.set()

    async def _count(self) -> None:
        async for msg in self.counts.messages():
            if topic_of_subject(self.bus.run, msg.subject) is Topic.EVAL_COMPLETED:
                self.monitor.eval_completed()
            else:
                meta = msg.metadata
                stored_ns = int(meta.timestamp.timestamp() * 1e9) if meta.timestamp else None
                self.monitor.trace_completed(seq=meta.sequence.stream, ts_ns=stored_ns)

    @property
    def folded_seq(self) -> int:
        """The newest stream sequence either reader has read."""
        return max(self.events.last_seq, self.counts.last_seq)

    async def newest_seq(self) -> int:
        """The newest stream sequence of what the follower reads, on the server now."""
        return max([await last_seq(self.bus, t) for t in (*self.EVENTS, *self.COUNTED)])


@dataclass
class RoleKeeper:
    """Starts the role processes and restarts one that dies, up to ``MAX_RESTARTS`` times,
    telling the view why it died: the last error in its log since it was started."""

    roles: list[RoleProcess]
    view: LiveView
    log: Any
    log_offsets: dict[str, int] = field(default_factory=dict)  # log size at the last start

    def start(self, r: RoleProcess) -> None:
        self.log_offsets[r.name] = r.log_path.stat().st_size if r.log_path.exists() else 0
        r.start()
        pid = r.proc.pid if r.proc else None
        self.log.info("role.started", name=r.name, pid=pid, log=str(r.log_path))

    def death(self, r: RoleProcess) -> str:
        """Why ``r`` died, in one line: its last error and its exit."""
        code = exit_text(r.proc.returncode if r.proc else None)
        error = last_error(r.log_path, self.log_offsets.get(r.name, 0))
        return f"{error} ({code})" if error else f"{code}; no error in its log"

    def check(self) -> str | None:
        """Restart every role that died; the failure once one died too often."""
        for r in self.roles:
            if r.alive or r.proc is None or r.retiring_since is not None:
                continue  # a retired pool replica's exit is its pool's (roles.up.pools)
            code = r.proc.returncode
            r.exit_codes.append(code)
            why = self.death(r)
            if r.restarts >= MAX_RESTARTS:
                return f"{r.name} died {r.restarts + 1} times; last: {why}; log {r.log_path}"
            r.restarts += 1
            self.log.warning(
                "role.restarted", name=r.name, exit_code=code, restarts=r.restarts, error=why
            )
            self.view.note(f"{r.name} died: {why}; restarted (#{r.restarts})")
            self.start(r)
        return None


@dataclass
class ServerKeeper:
    """Restarts an embedded nats-server the launcher started (one, or each node of a
    cluster) when it dies, on the same port, store and name (``EmbeddedServer.restart``):
    the roles' clients reconnect to the URLs they hold, and find the stream, consumers and
    KV where they were (a cluster's node catches up from its peers). Bounded:
    ``MAX_SERVER_RESTARTS`` within ``SERVER_RESTART_WINDOW_S``, then the run stops."""

    servers: list[EmbeddedServer]  # empty: a server the launcher did not start
    view: LiveView
    log: Any
    deaths: list[float] = field(default_factory=list)  # monotonic times, in the window

    async def check(self) -> str | None:
        """Restart any server that died; the failure once they died too often."""
        for server in self.servers:
            if not server.alive and (failed := await self._restart(server)):
                return failed
        return None

    async def _restart(self, server: EmbeddedServer) -> str | None:
        code = exit_text(server.exit_code)
        what = "nats-server" if len(self.servers) == 1 else f"nats-server {server.name}"
        now = time.monotonic()
        self.deaths = [t for t in self.deaths if now - t < SERVER_RESTART_WINDOW_S] + [now]
        if len(self.deaths) > MAX_SERVER_RESTARTS:
            return (
                f"{what} died {len(self.deaths)} times in {SERVER_RESTART_WINDOW_S:.0f}s "
                f"(last: {code}); not restarting it again; log {server.log_path}"
            )
        self.log.warning("nats_server.died", exit=code, url=server.url, node=server.name)
        self.view.note(f"{what} died ({code}); restarting on {server.url}")
        started = time.monotonic()
        try:
            await server.restart()
        except ServerStartError as e:
            return f"{what} died ({code}) and could not restart on {server.url}: {e}"
        took = time.monotonic() - started
        pid = server.proc.pid if server.proc else None
        self.log.warning(
            "nats_server.restarted",
            url=server.url,
            node=server.name,
            pid=pid,
            took_s=round(took, 2),
        )
        self.view.note(f"{what} is back on {server.url} (pid {pid}, {took:.1f}s)")
        return None


@dataclass
class BeatWatch:
    """Reads the run's heartbeats every interval: tells the view which role processes
    beat (a live one that has not is still starting), gives the monitor the
    orchestrator's rollout counts and stall, and says once per stall, on the console,
    that the run is stalled and what it waits for (the orchestrator's ``run.stalled``
    otherwise reaches only its own log)."""

    bus: Bus
    monitor: RunMonitor
    view: LiveView
    log: Any
    roles: list[RoleProcess]
    stalled: bool = False  # the current stall was told
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def check(self) -> None:
        beats = await live_beats(self.bus)
        if beats is None:
            return
        names = {r.proc.pid: r.name for r in self.roles if r.proc is not None}
        self.view.beating = {names[hb.pid] for hb in beats if hb.pid in names}
        orchestrators = [hb for hb in beats if hb.role == "orchestrator"]
        if not orchestrators:
            return
        newest = max(orchestrators, key=lambda hb: hb.last_seen_ns)
        self.monitor.orchestrator_beat(newest.info)
        if self.monitor.stall and not self.stalled:
            self.log.warning("run.stalled", stall=self.monitor.stall)
            self.view.note(f"run stalled: {self.monitor.stall}")
        self.stalled = bool(self.monitor.stall)

    async def run(self, every_s: float) -> None:
        """Until ``stop`` is set, then once more (the orchestrator's last counts)."""
        while not self.stop.is_set():
            await self.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), every_s)
        await self.check()


def stopped_line(stopped: RunStopped) -> str:
    """``run stopped: <reason>: <detail>``, the orchestrator's word on why, in one line."""
    detail = " ".join(stopped.detail.split())
    return f"run stopped: {stopped.reason}" + (f": {detail}" if detail else "")


# The run stopped (run.stopped): producers stop before the roles they depend on. The
# orchestrator stops dispatching, env servers drain their rollouts while inference still
# answers, inference goes last. The monitor goes last: it writes the metrics the others
# report as they stop. (Roles no prefix names, the lake and the gateway, go after it.)
STOP_ORDER: tuple[str | tuple[str, ...], ...] = (
    "orchestrator", "env-", "algorithm-", "trainer", "teacher-", "inference-", "monitor",
)  # fmt: skip
# Interrupted (Ctrl-C, SIGTERM, SIGHUP): the run pauses, to resume (``rlbus up --resume``),
# so nothing waits for work that would not be trained before then. At once: the
# orchestrator stops dispatching, the trainer finishes its current step and checkpoints,
# and the env servers and algorithms hand back what they hold (``HAND_BACK``: SIGINT,
# ``roles.runtime.role``), each input naked, so the resumed run's roles get it again
# from their durable consumers. Then what they called (the teacher, inference), then the
# rest. Once more, and every role still running is killed (the log makes that safe too).
INTERRUPT_ORDER: tuple[str | tuple[str, ...], ...] = (
    ("orchestrator", "trainer", "env-", "algorithm-"), ("teacher-", "inference-"), "monitor",
)  # fmt: skip
HAND_BACK = ("env-", "algorithm-")


class StopWatcher(Protocol):
    """Told each role's state while the roles stop (the live view)."""

    def role_state(self, name: str, state: str) -> None: ...

    def refresh(self) -> None: ...


def stop_groups(
    roles: list[RoleProcess], order: tuple[str | tuple[str, ...], ...] = STOP_ORDER
) -> list[list[RoleProcess]]:
    """The roles grouped by ``order`` (each entry a name prefix, or several stopped
    together), first to stop first."""
    rank = {
        r.name: next((i for i, p in enumerate(order) if r.name.startswith(p)), len(order))
        for r in roles
    }
    return [[r for r in roles if rank[r.name] == level] for level in sorted(set(rank.values()))]


async def stop_in_order(
    roles: list[RoleProcess],
    timeout_s: float = 30.0,
    watcher: StopWatcher | None = None,
    interrupted: bool = False,
) -> None:
    """Signal each group of roles in ``STOP_ORDER`` (``interrupted``: ``INTERRUPT_ORDER``,
    ``HAND_BACK`` roles told to hand back their work) and wait for it to stop (a role
    that does not within ``timeout_s`` is killed), telling ``watcher`` as each role goes
    from draining to stopped and refreshing it meanwhile."""
    order, hand_back = (INTERRUPT_ORDER, HAND_BACK) if interrupted else (STOP_ORDER, ())
    for group in stop_groups(roles, order):
        await stop_group(group, timeout_s, watcher, hand_back)


async def stop_group(
    group: list[RoleProcess],
    timeout_s: float,
    watcher: StopWatcher | None,
    hand_back: tuple[str, ...] = (),
) -> None:
    started = time.monotonic()
    draining = [r for r in group if r.alive]
    for r in draining:
        now = r.name.startswith(hand_back)
        r.terminate(signal.SIGINT if now else signal.SIGTERM)
        if watcher:
            watcher.role_state(r.name, "draining (handing back its work)" if now else "draining")
    while draining and time.monotonic() - started < timeout_s:
        for r in [r for r in draining if not r.alive]:
            draining.remove(r)
            if watcher:
                watcher.role_state(r.name, stopped_text(r, started))
        if watcher:
            watcher.refresh()
        await asyncio.sleep(0.05)  # polling a few processes costs nothing; each group waits on it
    for r in group:
        await asyncio.to_thread(r.wait, 0.1)  # kills one still running; closes its log
        if r in draining and watcher:
            killed = r.proc is not None and r.proc.returncode == -signal.SIGKILL
            late = f"killed (did not drain in {timeout_s:.0f}s)"
            watcher.role_state(r.name, late if killed else stopped_text(r, started))


def stopped_text(r: RoleProcess, since: float) -> str:
    code = exit_text(r.proc.returncode if r.proc else None)
    return f"stopped ({code}, {time.monotonic() - since:.1f}s)"


async def keep_running(
    keeper: RoleKeeper,
    follower: RunFollower,
    view: LiveView,
    stop: asyncio.Event,
    server: ServerKeeper | None = None,
) -> str | None:
    """Until the run stops or ``stop`` is set: restart the server and roles that die,
    refresh the view. Returns the failure when the server or a role kept dying."""
    while not stop.is_set() and follower.monitor.stopped is None:
        if server is not None and (failed := await server.check()):
            return failed
        if failed := keeper.check():
            return failed
        follower.check()
        view.refresh()
        # A signal or the run's stop ends the wait at once.
        waits = [asyncio.ensure_future(e.wait()) for e in (stop, follower.run_stopped)]
        await asyncio.wait(waits, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
        for w in waits:
            w.cancel()
    if follower.monitor.stopped is not None:
        view.note(stopped_line(follower.monitor.stopped))
    return None


def stop_reason(monitor: RunMonitor, failed: str | None, signals: list[str]) -> str:
    """Why the roles are stopped, in a few words (the notes and the report say more)."""
    if failed:
        return f"failed: {failed.split(';')[0]}"
    if signals:
        return f"interrupted by {signals[0]}"
    if monitor.stopped is not None:
        return monitor.stopped.reason
    return "the launcher failed"


def kill_roles(roles: list[RoleProcess], view: LiveView, sig: str) -> None:
    """SIGKILL every role still running (a second Ctrl-C while they stop): what they held
    is on the log, and the resumed run does it again."""
    alive = [r for r in roles if r.alive and r.proc is not None]
    for r in alive:
        r.proc.kill()  # type: ignore[union-attr]
    if alive:
        view.note(f"second {sig}: killed {', '.join(r.name for r in alive)}")


async def begin_segment(monitor: RunMonitor, follower: RunFollower, paths: RunPaths) -> None:
    """Tell ``monitor`` where this launch's segment of the run begins: after the newest
    sequence on the stream now, and after the segments the run's previous summary
    recorded (``roles.up.monitor``, segments)."""
    monitor.resume_seq = await follower.newest_seq()
    previous = None
    with contextlib.suppress(OSError, ValueError):
        previous = json.loads(paths.summary.read_text())
    monitor.earlier = earlier_segments(previous if isinstance(previous, dict) else None)
    ends = [s.get("end_seq") for s in monitor.earlier]
    if ends and all(isinstance(e, int) for e in ends):
        monitor.covered_seq = min(max(e for e in ends if isinstance(e, int)), monitor.resume_seq)
    elif ends:  # a summary without sequences (before rlbus kept segments) covers it all
        monitor.covered_seq = monitor.resume_seq


def resume_command(paths: RunPaths) -> str:
    """How to go on with an interrupted run: ``rlbus up --run R --resume``, naming its
    data directory when the command alone would not find it."""
    command = f"rlbus up --run {paths.run} --resume"
    if resolve_data_dir().resolve() != paths.data_dir.resolve():
        command += f" bus.data_dir={paths.data_dir}"
    return command


def detach_from_terminal(log: Path) -> None:
    """The terminal closed (SIGHUP): what the launcher still writes to it goes to ``log``
    instead, so the roles drain and the summary is written without a write error."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for target in (1, 2):
            if os.isatty(target):
                os.dup2(fd, target)
    finally:
        os.close(fd)


async def supervise(
    cfg: RunConfig,
    paths: RunPaths,
    url: str,
    roles: list[RoleProcess],
    live_view: bool,
    servers: list[EmbeddedServer] | None = None,
    pools: list[Pool] | None = None,
) -> int:
    """Run the roles until the run stops (``servers``: the embedded server, or cluster
    nodes, this launcher started, watched and restarted; none for a given server;
    ``pools``: the run's env and inference pools over ``roles``, shown and resized)."""
    from roles.up.view import LiveView

    run = paths.run
    log = get_logger(run=run, role="launcher")
    monitor = RunMonitor(
        run=run, max_steps=cfg.max_steps, warmup_steps=cfg.orchestrator.warmup.steps,
        eval_k=cfg.orchestrator.eval.k,
    )  # fmt: skip
    view = LiveView(monitor, roles, enabled=live_view)
    interrupted = asyncio.Event()
    signals: list[str] = []

    def on_signal(sig: signal.Signals) -> None:
        if sig == signal.SIGHUP and not signals:
            detach_from_terminal(paths.log("launcher"))
            view.detach()
        signals.append(sig.name)
        interrupted.set()
        if len(signals) == 2:  # a second Ctrl-C: no more waiting (``INTERRUPT_ORDER``)
            kill_roles(roles, view, sig.name)

    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    bus = await Bus.connect(url, run=run, producer="launcher", settings=bus_settings(cfg))
    await bus.ensure_run()
    follower = RunFollower(bus, monitor)
    await begin_segment(monitor, follower, paths)  # before any role publishes
    keeper = RoleKeeper(roles, view, log)
    if any(r.hidden is not None for r in roles) and (why := unavailable_reason()) is not None:
        log.warning("roles.unconfined", reason=why, reads="every credential of this run")
    for r in roles:
        keeper.start(r)
    follower.start()
    server_keeper = ServerKeeper(servers or [], view, log)
    interval = cfg.bus.heartbeat_interval_s
    watch = SilenceWatch(bus, view, log, roles, silence_limit_s(interval))
    watching = asyncio.create_task(watch.run(interval))
    beat_watch = BeatWatch(bus, monitor, view, log, roles)
    beating = asyncio.create_task(beat_watch.run(interval))
    e = cfg.env_server
    pool_keeper = PoolKeeper(
        pools or [], roles, keeper.start, bus, view, log, e.scale_check_s, e.scale_up_backlog,
        cfg.inference.scale_up_busy, busy=monitor.busy,
    )  # fmt: skip
    view.pools = pool_keeper
    pooling = asyncio.create_task(pool_keeper.run())
    failed: str | None = None
    try:
        with view:
            try:
                failed = await keep_running(keeper, follower, view, interrupted, server_keeper)
            finally:
                watch.stop.set()  # stopping roles go quiet on purpose
                pool_keeper.stop.set()  # no replica starts or retires while the roles stop
                await asyncio.wait([pooling], timeout=10.0)
                view.stopping(stop_reason(monitor, failed, signals))
                await stop_in_order(roles, watcher=view, interrupted=bool(signals) and not failed)
                await follower.finish()
    finally:
        watch.stop.set()
        pool_keeper.stop.set()
        beat_watch.stop.set()
        for task in (watching, pooling, beating):
            if (await asyncio.wait([task], timeout=10.0))[1]:
                task.cancel()  # a registry read that hangs past its own timeouts
        await follower.finish()  # after an error above
        await bus.close()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
    monitor.finish(stop_reason(monitor, failed, signals), follower.folded_seq)
    summary = monitor.summary()
    summary["restarts"] = {r.name: r.restarts for r in roles if r.restarts}
    summary["pools"] = pool_keeper.summary()
    if failed:
        summary["failed"] = failed
    if signals:
        summary["interrupted"] = signals[0]
        summary["resume"] = resume_command(paths)
    path = write_summary(paths, summary)
    from roles.up.plots import plot_curves

    # The report first, then the curves (matplotlib takes seconds on a busy machine): an
    # interrupted run says how to resume as soon as its roles stopped. The file it names
    # is written before the launcher exits (plot_curves draws when anything was reported).
    curves = paths.curves if monitor.train or monitor.trainer or monitor.eval else None
    with contextlib.suppress(OSError):  # a terminal gone without SIGHUP
        print(view.final_report(summary, path, curves, paths.logs), flush=True)
    plot_curves(monitor, paths.curves)
    # The launcher exits next: its final collections would walk every object torch and
    # matplotlib made (seconds on a busy machine); frozen, they are skipped.
    gc.freeze()
    if failed:
        log.error("run.failed", reason=failed)
        return 1
    if interrupted.is_set():
        return 130
    return 0 if monitor.stopped is not None and monitor.stopped.reason == "max_steps" else 3
