"""Says when a running role stops beating, and when it beats again (``SilenceWatch``).

Started by the supervisor (``roles/up/supervisor.py``) next to the role keeper: a role
whose process is alive but sends no heartbeat (SIGSTOP, a hang, a host asleep) would
otherwise go unnoticed while the run merely waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import Mapping, Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from bus.registry import RoleHeartbeat
from bus.runtime import Bus
from roles.up.processes import RoleProcess

if TYPE_CHECKING:
    from roles.up.view import LiveView


async def live_beats(bus: Bus) -> list[RoleHeartbeat] | None:
    """The run's heartbeats, or None while the server cannot say (down, restarting): a
    watch that polls them tries again at its next check."""
    try:
        return await bus.live_roles()
    except Exception:  # noqa: BLE001 - the server may be down; the next check sees
        return None


def silence_limit_s(heartbeat_interval_s: float) -> float:
    """How long a running role may go without a heartbeat before the launcher says so:
    a few intervals (one late beat is no news), and never under 10 s."""
    return max(10.0, 5 * heartbeat_interval_s)


def silences(
    last_seen: Mapping[str, float], now: float, limit_s: float, silent: Set[str]
) -> tuple[dict[str, float], set[str]]:
    """The news in heartbeat times (pure): the instances silent for ``limit_s`` or more
    that were not ``silent`` yet (with how long), and the ``silent`` ones that beat again.

    ``last_seen`` maps each running instance to its last heartbeat (seconds, same clock
    as ``now``); an instance missing from it is neither news nor back."""
    newly = {
        name: now - seen
        for name, seen in last_seen.items()
        if now - seen >= limit_s and name not in silent
    }
    back = {name for name in silent if name in last_seen and now - last_seen[name] < limit_s}
    return newly, back


@dataclass
class SilenceWatch:
    """Says once when a running role instance stops beating (SIGSTOP, a hang, a host
    asleep) and once when it beats again: nothing else would tell, since its process
    is alive and the run merely waits on it."""

    bus: Bus
    view: LiveView
    log: Any
    roles: list[RoleProcess]
    limit_s: float
    silent: dict[str, float] = field(default_factory=dict)  # instance -> its last beat (s)
    # Stopped by this event, not by cancelling: nats-py can swallow a cancellation that
    # lands inside a request (the registry read), and the loop would run on.
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def check(self) -> None:
        beats = await live_beats(self.bus)
        if beats is None:
            return
        last_seen: dict[str, float] = {}
        pids: dict[str, int] = {}
        for hb in beats:
            if hb.status == "stopped" or not process_alive(hb.host, hb.pid):
                self.silent.pop(hb.instance, None)  # ended: the role keeper speaks for it
                continue
            last_seen[hb.instance], pids[hb.instance] = hb.last_seen_ns / 1e9, hb.pid
        newly, back = silences(last_seen, time.time(), self.limit_s, set(self.silent))
        for instance, silent_s in newly.items():
            self.silent[instance] = last_seen[instance]
            name = self.role_of(pids[instance])
            self.log.warning("role.silent", instance=instance, role=name, silent_s=round(silent_s))
            self.view.silence(name or instance, last_seen[instance])
            self.view.note(
                f"{label(name, instance)}: no heartbeat for {silent_s:.0f}s (stopped or stuck?)"
            )
        for instance in back:
            silent_s = last_seen[instance] - self.silent.pop(instance)
            name = self.role_of(pids[instance])
            self.log.warning(
                "role.beats_again", instance=instance, role=name, silent_s=round(silent_s)
            )
            self.view.silence(name or instance, None)
            self.view.note(f"{label(name, instance)}: beats again after {silent_s:.0f}s of silence")

    def role_of(self, pid: int) -> str | None:
        """The name of the launcher's role process with ``pid`` (None: not one of ours)."""
        return next((r.name for r in self.roles if r.proc is not None and r.proc.pid == pid), None)

    async def run(self, every_s: float) -> None:
        while not self.stop.is_set():
            await self.check()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), every_s)


def label(name: str | None, instance: str) -> str:
    return f"{name} ({instance})" if name else instance


def process_alive(host: str, pid: int) -> bool:
    """Whether a role instance's process still exists; on another host: assume it does."""
    if host != socket.gethostname():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
