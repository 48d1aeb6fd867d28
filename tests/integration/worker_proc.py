"""A minimal role process for crash/redelivery tests: one metric per task request.

    python -m tests.integration.worker_proc --url nats://... --run R [--crash-on N]

Each metric carries how many objects the process froze (``serve_role`` freezes the heap
after setup). With ``--crash-on N`` it publishes the outputs of its N-th message and then dies
(``os._exit``) before acking: the worst moment to crash.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os

from bus.consumer import Delivery, Subscription
from bus.log import configure
from bus.runtime import Bus, BusSettings
from bus.subjects import Topic
from roles.runtime.role import Role, serve_role
from schemas import Event, MetricsReported, TaskRequested, derive_id


class Worker(Role):
    role = "worker"

    def __init__(self, bus: Bus, crash_on: int | None):
        super().__init__(bus, instance=f"worker-{os.getpid()}", heartbeat_interval_s=0.5)
        self.crash_on = crash_on
        self.seen = 0

    def subscriptions(self) -> list[Subscription]:
        return [Subscription("worker", [(Topic.TASK_REQUESTED, None)], self.on_task, batch=1)]

    async def on_task(self, ev: TaskRequested, d: Delivery) -> list[Event]:
        self.seen += 1
        out: list[Event] = [
            MetricsReported(run=self.run, event_id=derive_id(ev.event_id, "metric"), causation_id=ev.event_id,
                            role="worker", step=ev.step, values={"task": float(ev.task.index),
                                                        "frozen": float(gc.get_freeze_count())})
        ]  # fmt: skip
        if self.crash_on == self.seen:
            await self.bus.publish_many(out)
            os._exit(17)  # crash after the effect, before the ack
        return out


async def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--crash-on", type=int)
    a = p.parse_args()
    configure(json=True, run=a.run, role="worker")
    bus = await Bus.connect(
        a.url, run=a.run, producer="worker", settings=BusSettings(ack_wait_s=1.5, max_deliver=5)
    )
    await serve_role(Worker(bus, a.crash_on))


if __name__ == "__main__":
    asyncio.run(main())
