"""The shared role lifecycle: connect, declare consumers, heartbeat, drain on SIGTERM.

A role declares what it consumes next to the handler that consumes it: durable
work-queue ``Subscription``s (``bus.consumer``), ordered ``Follow``ers of the log
(``bus.follower``) and the requests it answers (``Serve``, ``bus.rpc``: inference's and
the teacher's generate requests). The runtime starts them once ``setup`` is done
(``ready`` is set when all are live) and stops answering requests first when the role
drains. Its handlers return the events they cause (or ``Effects``: events
plus an after-publish hook); the runtime publishes them, then acks the input. Tests of
a role's logic need no broker, and replay runs the roles' pure cores over the log.

Two ways to stop. SIGTERM (``request_stop()``) drains: consumers finish the work they
hold, so a retired replica or a finished run loses nothing. SIGINT, or a second SIGTERM
(``request_stop(now=True)``), stops now: consumers hand back what they hold instead
(each input naked, so it is redelivered, to this role's next process or another replica),
which is what ``rlbus up`` asks of the env servers and algorithms on Ctrl-C, when their
work would not be trained before the run resumes. A consumer that takes one message at a
time finishes that one either way (the trainer's current step).

Every role is built the same way, ``SomeRole(bus, ...)``: the bus first, then what the
role needs. Periodic work (metrics every few seconds) uses ``report_every`` and
``sleep``, which end when the role stops; work in ``setup`` that outlasts a heartbeat
interval runs under ``beating``.

    class Echo(Role):
        role = "echo"
        def subscriptions(self):
            return [Subscription("echo", [(Topic.RUN_STARTED, None)], self.on_started)]
        async def on_started(self, event, delivery):
            return [RunStopped(run=self.run, reason="echo", causation_id=event.event_id,
                               event_id=derive_id(event.event_id, "echo"))]

    asyncio.run(serve_role(Echo(bus, instance="echo-0")))
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from bus.consumer import Consumer, Subscription
from bus.follower import Follow, Follower
from bus.rpc import Serve
from bus.runtime import Bus, Served
from schemas import MetricsReported


class Role:
    role: str = "role"

    def __init__(self, bus: Bus, instance: str, heartbeat_interval_s: float = 2.0):
        self.bus = bus
        self.run = bus.run
        self.instance = instance
        self.heartbeat_interval_s = heartbeat_interval_s
        self.log = bus.log.bind(role=self.role, instance=instance)
        self.stop_event = asyncio.Event()
        self.stop_now = asyncio.Event()  # stop without finishing in-flight work (see above)
        self.consumers: list[Consumer] = []
        self.followers: list[Follower] = []
        self.answering: list[Served] = []
        self.ready = asyncio.Event()  # set once every declared input is live

    # -- what a role overrides ----------------------------------------------------------

    def subscriptions(self) -> Sequence[Subscription | Follow | Serve]:
        """What the role consumes and answers; called after ``setup``."""
        return []

    async def setup(self) -> None:
        """Load models, open stores... before consuming."""

    def background(self) -> list[Awaitable[Any]]:
        """Long-running tasks beside the consumers (e.g. serving inference requests)."""
        return []

    async def teardown(self) -> None:
        """Release what ``setup`` took; runs after consumers drained."""

    async def status(self) -> dict[str, object]:
        """Fields for the heartbeat: policy_version, pending, info."""
        pending = 0
        for c in self.consumers:
            with contextlib.suppress(Exception):
                pending += await c.pending()
        return {"pending": pending} if self.consumers else {}

    # -- lifecycle ----------------------------------------------------------------------

    def request_stop(self, now: bool = False) -> None:
        """Stop, draining in-flight work; ``now`` (or a second request while draining):
        hand it back instead."""
        if now or self.stop_event.is_set():
            self.stop_now.set()
        self.stop_event.set()

    async def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True (at once) when the role is stopping."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self.stop_event.wait()
        return self.stop_event.is_set()

    async def report_every(
        self, interval_s: float, metrics: Callable[[bool], MetricsReported | None]
    ) -> None:
        """Publish ``metrics(stopping)`` every ``interval_s`` until the role stops (a last
        time as it stops). ``None`` publishes nothing; metrics are best effort: a failed
        publish is logged and the role goes on."""
        while True:
            stopping = await self.sleep(interval_s)
            event = metrics(stopping)
            if event is not None:
                try:
                    await self.bus.publish(event)
                except Exception as e:  # noqa: BLE001 - metrics are best effort
                    self.log.warning("metrics.publish_failed", error=repr(e))
            if stopping:
                return

    async def beating(self, work: Awaitable[None], consumer: str | None = None) -> None:
        """Run ``work`` (long setup: a catch-up, a model load) with the role's heartbeat
        going, so the registry does not show it stale meanwhile (``serve_role``'s own
        heartbeat starts after ``setup``)."""
        hb = self.bus.heartbeat(self.role, self.instance, self.heartbeat_interval_s,
                                consumer=consumer, probe=self.status)  # fmt: skip
        hb.start()
        try:
            await work
        finally:
            await hb.stop(mark_stopped=False)


def freeze_heap() -> None:
    """Move every object alive now (the imports, a model, captured graphs) out of the
    collector's reach (``gc.freeze``). A role's heap after its setup is mostly torch's
    and transformers' objects (~430k with a tiny model): a full collection walks them
    all, 0.24 s on this CPU, stalling the role's loop each time the oldest generation
    fills. On one H200 the ``gpu`` preset's inference replica took ~0.3 s instead of
    ~25 ms for every 6th or 7th weights swap (load time all of it); frozen, the slowest
    of 40 swaps took 0.10-0.14 s in four runs. What a role allocates later is collected
    as before."""
    gc.collect()
    gc.freeze()


async def serve_role(role: Role, *, install_signals: bool = True) -> None:
    """Run ``role`` until SIGTERM/SIGINT (or ``role.request_stop()``), then drain (SIGTERM)
    or hand back in-flight work (SIGINT, a second signal) and exit."""
    loop = asyncio.get_running_loop()
    if install_signals:
        loop.add_signal_handler(signal.SIGTERM, role.request_stop)
        loop.add_signal_handler(signal.SIGINT, role.request_stop, True)
    try:
        await role.bus.ensure_stream()
        await role.setup()
    except BaseException:
        await role.bus.close()  # a role that cannot start must not leak its connection
        raise
    if install_signals:
        freeze_heap()
    declared = role.subscriptions()
    role.consumers = [
        Consumer(role.bus, s, role.role) for s in declared if isinstance(s, Subscription)
    ]
    role.followers = [Follower(role.bus, f, role.role) for f in declared if isinstance(f, Follow)]
    serves = [s for s in declared if isinstance(s, Serve)]
    role.answering = [await role.bus.serve(s) for s in serves]
    if role.answering:
        await role.bus.flush()  # the server knows the subscriptions before we say ready
    heartbeat = role.bus.heartbeat(
        role.role, role.instance, role.heartbeat_interval_s,
        consumer=",".join(c.sub.durable for c in role.consumers) or None, probe=role.status,
    )  # fmt: skip
    heartbeat.start()
    role.ready.set()
    role.log.info("role.started")
    tasks = [
        asyncio.create_task(c.run(role.stop_event, hand_back=role.stop_now)) for c in role.consumers
    ]
    tasks += [asyncio.create_task(f.run(role.stop_event)) for f in role.followers]
    background = [asyncio.ensure_future(a) for a in role.background()]
    tasks += background
    stopper = asyncio.create_task(role.stop_event.wait())
    # A role whose server is gone for longer than bus.server_lost_s exits (ServerLost)
    # instead of reconnecting for as long as it lives.
    watchdog = asyncio.create_task(role.bus.watch_server())
    try:
        waiting: set[asyncio.Future[Any]] = {*tasks, stopper, watchdog}
        while not stopper.done():
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stopper and (exc := t.exception()) is not None:
                    if t is not watchdog:  # failed as the server went? the watchdog decides
                        await role.bus.outage_over()
                    if role.bus.lost is not None:  # the lost connection failed the task
                        raise role.bus.lost from exc
                    role.log.error("role.task_failed", error=repr(exc))
                    raise exc
    finally:
        role.log.info("role.draining")
        for served in role.answering:  # no new requests; those in progress are answered
            await served.stop()
        role.stop_event.set()
        # Consumers drain on their own; background loops get a moment to notice the stop
        # event, then are cancelled so a loop that does not watch it cannot hang the exit.
        await asyncio.wait([*background], timeout=2.0) if background else None
        for t in background:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        stopper.cancel()
        try:
            await role.teardown()
        finally:
            watchdog.cancel()
            await asyncio.gather(watchdog, return_exceptions=True)
            await heartbeat.stop()
            await role.bus.close()
        if install_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        role.log.info("role.stopped")
        if install_signals:
            # The process exits next. Its final collections would walk every object the
            # role made (torch's among them: seconds on a busy machine, while ``rlbus up``
            # waits for this exit to stop the next role); frozen, they are skipped.
            gc.freeze()
