"""Keeps a run's role processes alive and watches the run through its stream.

Started by ``rlbus up`` (``roles/up/launcher.py``). It reads metrics, weights and stop
events (and only the headers of completed traces, to count rollouts) with ordered
consumers, restarts a role process that dies, and on ``run.stopped`` or Ctrl-C stops
every role with SIGTERM so each drains its in-flight work.
"""

from __future__ import annotations

import asyncio
import signal
import time

from bus.log import get_logger
from bus.reader import LogReader
from bus.runtime import Bus
from bus.subjects import Topic
from configs import RunConfig
from configs.paths import RunPaths
from roles.up.monitor import RunMonitor
from roles.up.processes import RoleProcess, write_summary
from schemas import MetricsReported, RunStarted, RunStopped, WeightsPublished

TYPES = (MetricsReported, RunStarted, RunStopped, WeightsPublished)
MAX_RESTARTS = 5


async def follow_events(bus: Bus, monitor: RunMonitor, stop: asyncio.Event) -> None:
    """Fold the run's events into ``monitor`` until ``stop``; completed traces are counted
    from their headers alone (their bodies are large and the view needs only a count)."""
    topics = [(t, None) for t in (Topic.RUN_STARTED, Topic.RUN_STOPPED, Topic.WEIGHTS_PUBLISHED, Topic.METRICS_REPORTED)]  # fmt: skip
    events = LogReader(bus, topics=topics, follow=True, idle_timeout_s=1.0, stop=stop)
    traces = LogReader(
        bus, topics=[(Topic.TRACE_COMPLETED, None)], follow=True, idle_timeout_s=1.0,
        headers_only=True, stop=stop,
    )  # fmt: skip

    async def count_traces() -> None:
        async for _ in traces.messages():
            monitor.trace_completed()

    counter = asyncio.create_task(count_traces())
    try:
        async for event in events.events(TYPES):
            monitor.apply(event)
    finally:
        counter.cancel()
        await asyncio.gather(counter, return_exceptions=True)


# Producers stop before the roles they depend on: the orchestrator stops dispatching, env
# servers drain their rollouts while inference still answers, inference goes last.
STOP_ORDER = ("orchestrator", "env-", "algorithm-", "trainer", "teacher-", "inference-")


async def stop_in_order(roles: list[RoleProcess], timeout_s: float = 30.0) -> None:
    """SIGTERM each group of roles in ``STOP_ORDER`` and wait for it to drain."""
    rank = {
        r.name: next((i for i, p in enumerate(STOP_ORDER) if r.name.startswith(p)), len(STOP_ORDER))
        for r in roles
    }
    for level in sorted(set(rank.values())):
        group = [r for r in roles if rank[r.name] == level]
        for r in group:
            r.terminate()
        deadline = time.monotonic() + timeout_s
        for r in group:
            await asyncio.to_thread(r.wait, max(1.0, deadline - time.monotonic()))


async def supervise(
    cfg: RunConfig, paths: RunPaths, url: str, roles: list[RoleProcess], live_view: bool
) -> int:
    run = paths.run
    log = get_logger(run=run, role="launcher")
    monitor = RunMonitor(run=run, max_steps=cfg.max_steps)
    interrupted = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted.set)
    bus = await Bus.connect(url, run=run, producer="launcher")
    await bus.ensure_stream()
    for r in roles:
        r.start()
        log.info(
            "role.started", name=r.name, pid=r.proc.pid if r.proc else None, log=str(r.log_path)
        )
    stop_reading = asyncio.Event()
    reader = asyncio.create_task(follow_events(bus, monitor, stop_reading))
    from roles.up.view import LiveView

    view = LiveView(monitor, roles, enabled=live_view)
    failed: str | None = None
    try:
        with view:
            while not interrupted.is_set() and monitor.stopped is None:
                for r in roles:
                    if not r.alive and r.proc is not None:
                        code = r.proc.returncode
                        r.exit_codes.append(code)
                        if r.restarts >= MAX_RESTARTS:
                            failed = f"{r.name} died {r.restarts + 1} times (last exit {code}); see {r.log_path}"
                            break
                        r.restarts += 1
                        log.warning(
                            "role.restarted", name=r.name, exit_code=code, restarts=r.restarts
                        )
                        view.note(f"{r.name} exited ({code}); restarted (#{r.restarts})")
                        r.start()
                if failed:
                    break
                if reader.done():
                    reader.result()
                view.refresh()
                await asyncio.sleep(0.5)
    finally:
        await stop_in_order(roles)
        stop_reading.set()
        await asyncio.gather(reader, return_exceptions=True)
        await bus.close()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    summary = monitor.summary()
    summary["restarts"] = {r.name: r.restarts for r in roles if r.restarts}
    if failed:
        summary["failed"] = failed
    path = write_summary(paths, summary)
    from roles.up.plots import plot_curves

    curves = plot_curves(monitor, paths.curves)
    print(view.final_report(summary, path, curves))
    if failed:
        log.error("run.failed", reason=failed)
        return 1
    if interrupted.is_set():
        return 130
    return 0 if monitor.stopped is not None and monitor.stopped.reason == "max_steps" else 3
