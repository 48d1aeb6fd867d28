"""Weights sent over torch.distributed (``trainer.weights_via = "broadcast"``): trainer and
replicas on different GPUs or hosts.

The trainer hosts a rendezvous (a ``TCPStore`` on ``trainer.broadcast_host``, port chosen
by the system) and announces it with every version (``WeightsPublished.device``, kind
"broadcast": address, session, the version's device digest). A replica that meets a
session it has not joined registers in the store (``joined``: its member number) and
the two make a process group of their own, two ranks (gloo on the CPU, NCCL on CUDA: the
same code, so CPU tests run it). From then on the trainer sends it each version (a
one-element header with the version, then the flat serving-dtype buffer of
``roles.lib.model.shared_weights``), newest first: a member that lags gets the newest,
never a queue. One thread per member, so a slow or dead replica holds neither the others
nor the trainer: a send that fails (the replica died) drops the member and closes its
group; a restarted replica joins again under a new number. A replica that joins late, or
whose trainer restarted (a new session), serves the newest stored version until its first
version arrives, as with every other way. What a replica received is checked like the
ring's copy (the device digest, every value finite) before it is served.

Pairs, not one group of every rank: a group of N ranks would have to be rebuilt by every
member whenever one joins or dies; a pair fails alone. NCCL's broadcast tree would beat N
sends for many replicas; with the few replicas of a run the trainer's sends overlap its
next step. The store is not authenticated: anyone who reaches the port can read the
weights (keep it on a private network); what is served is still only what the digest
announced on the authenticated bus allows.

    hub = BroadcastHub(ring, host="10.0.0.5")      # trainer
    ref = hub.announce(version, ring.write(version, state))
    receiver = BroadcastReceiver(layout, device)   # replica
    staged = receiver.receive(ref, into=staging, timeout_s=10)
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from roles.lib.model.shared_weights import Layout, Location, WeightsRing, device_digest
from roles.lib.model.weights import WeightsDigestMismatch
from schemas import BROADCAST_KIND, ObjectRef

GROUP_TIMEOUT = datetime.timedelta(seconds=30)  # a pair's rendezvous and each send/recv
JOIN_TIMEOUT = datetime.timedelta(seconds=5)  # reaching a trainer's store (a dead one: fail)


class Rendezvous(msgspec.Struct, frozen=True):
    """What ``ObjectRef.location`` says for ``kind == "broadcast"`` (JSON)."""

    host: str
    port: int
    session: str  # one per trainer process: a restarted trainer is a new session
    version: int  # the version announced (what the replica waits for)
    numel: int
    dtype: str
    layout: str  # Layout.fingerprint()


def _pair(store: dist.Store, member: int, rank: int, device: torch.device) -> Any:
    """The two-rank group of ``member`` (rank 0: the trainer); blocks until both are in."""
    prefixed = dist.PrefixStore(f"pair/{member}", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = GROUP_TIMEOUT
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    return dist.ProcessGroupGloo(prefixed, rank, 2, GROUP_TIMEOUT)


def _use_device(device: torch.device) -> None:
    """(a new thread) Make ``device`` current: NCCL binds a group to the current GPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


class _Member:
    """One replica: a thread that sends it the newest version it has not had."""

    def __init__(self, hub: BroadcastHub, number: int) -> None:
        self.hub, self.number = hub, number
        self.sent = -1
        self.alive = True
        self.thread = threading.Thread(target=self._run, name=f"weights-send-{number}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        hub = self.hub
        try:
            _use_device(hub.device)
            group = _pair(hub.store, self.number, 0, hub.device)
        except Exception as e:  # noqa: BLE001 - the replica never came: forget it
            hub.on_event("weights.member_lost", {"member": self.number, "error": repr(e)[:200]})
            self.alive = False
            return
        hub.on_event("weights.member_joined", {"member": self.number})
        try:
            while not hub.closed:
                with hub.changed:
                    hub.changed.wait_for(lambda: hub.closed or hub.newest[0] > self.sent, 1.0)
                    version, slot = hub.newest
                if hub.closed or version <= self.sent:
                    continue
                header = torch.tensor([version], dtype=torch.int64, device=hub.device)
                group.send([header], 1, 0).wait()
                group.send([hub.ring.slot(slot)], 1, 1).wait()
                self.sent = version
        except Exception as e:  # noqa: BLE001 - it died or hung: drop it, it rejoins
            hub.on_event("weights.member_lost", {"member": self.number, "error": repr(e)[:200]})
        finally:
            self.alive = False


class BroadcastHub:
    """The trainer's side: the rendezvous, and a sender per joined replica."""

    def __init__(
        self,
        ring: WeightsRing,
        host: str,
        on_event: Callable[[str, dict[str, Any]], None] = lambda event, fields: None,
    ) -> None:
        self.ring, self.host, self.on_event = ring, host, on_event
        self.device = ring.buffer.device
        self.store = dist.TCPStore(host, 0, None, True, GROUP_TIMEOUT, wait_for_workers=False)
        self.session = uuid.uuid4().hex[:12]
        self.newest: tuple[int, int] = (-1, 0)  # (version, ring slot)
        self.changed = threading.Condition()
        self.closed = False
        self.members: list[_Member] = []
        self._accepting = threading.Thread(target=self._accept, name="weights-accept", daemon=True)
        self._accepting.start()

    def _accept(self) -> None:
        """Start a sender for every replica that registers (``joined`` counts them)."""
        known = 0
        while not self.closed:
            joined = self.store.add("joined", 0)
            while known < joined:
                known += 1
                self.members.append(_Member(self, known))
            self.members = [m for m in self.members if m.alive]
            time.sleep(0.05)

    def announce(self, version: int, shared: ObjectRef) -> ObjectRef:
        """Send ``version`` (already in the ring: ``shared`` is its ring reference) to
        every member; its broadcast reference, with the ring's digest."""
        loc = msgspec.json.decode(shared.location, type=Location)
        with self.changed:
            self.newest = (version, loc.slot)
            self.changed.notify_all()
        rendezvous = Rendezvous(host=self.host, port=self.store.port, session=self.session,
                                version=version, numel=loc.numel, dtype=loc.dtype,
                                layout=loc.layout)  # fmt: skip
        return ObjectRef(
            kind=BROADCAST_KIND,
            location=msgspec.json.encode(rendezvous).decode(),
            size=shared.size,
            digest=shared.digest,
        )

    @property
    def live_members(self) -> int:
        return sum(m.alive for m in self.members)

    def close(self) -> None:
        self.closed = True
        with self.changed:
            self.changed.notify_all()


class BroadcastReceiver:
    """A replica's side: joins a trainer's session and receives every version it sends
    (a thread that always waits for the next). The two newest received stay (``KEPT``),
    so the announcement a replica is loading may be overtaken by one more version on the
    wire; ``receive`` hands out the one an announcement names, checked."""

    KEPT = 2  # received versions held besides the one being received

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.layout, self.device = layout, device
        self.session = ""
        self.error: str | None = None
        self._got = threading.Condition()
        self._have: dict[int, int] = {}  # version -> buffer, the newest KEPT received
        self._buffers: list[torch.Tensor] = []
        self._locks = [threading.Lock() for _ in range(self.KEPT + 1)]
        self._thread: threading.Thread | None = None
        self._store: Any = None
        self._gone: set[str] = set()  # sessions that broke or never answered: not again

    def _join(self, rv: Rendezvous) -> None:
        """Register in the trainer's store and start receiving (a new session: again)."""
        if rv.layout != self.layout.fingerprint() or rv.numel != self.layout.numel:
            raise ValueError(
                f"broadcast weights of another model: layout {rv.layout}, this model's is "
                f"{self.layout.fingerprint()}"
            )
        dtype = getattr(torch, rv.dtype)
        try:
            store = dist.TCPStore(rv.host, rv.port, None, False, JOIN_TIMEOUT)
            member = store.add("joined", 1)
        except Exception:  # a trainer that is gone: its older announcements fail at once
            self._gone.add(rv.session)
            raise
        with self._got:
            self._buffers = [
                torch.empty(rv.numel, dtype=dtype, device=self.device) for _ in self._locks
            ]
            self._have, self.error = {}, None
        self.session, self._store = rv.session, store
        self._thread = threading.Thread(
            target=self._run, args=(store, member, rv.session), name="weights-recv", daemon=True
        )
        self._thread.start()

    def _run(self, store: Any, member: int, session: str) -> None:
        try:
            _use_device(self.device)
            group = _pair(store, member, 1, self.device)
            header = torch.zeros(1, dtype=torch.int64, device=self.device)
            while session == self.session:
                group.recv([header], 0, 0).wait()
                with self._got:  # the oldest kept makes room (a reader holds its lock)
                    while len(self._have) >= self.KEPT:
                        del self._have[min(self._have)]
                    free = next(i for i in range(len(self._locks)) if i not in self._have.values())
                with self._locks[free]:
                    group.recv([self._buffers[free]], 0, 1).wait()
                with self._got:
                    self._have[int(header.item())] = free
                    self._got.notify_all()
        except Exception as e:  # noqa: BLE001 - the trainer went: a new session rejoins
            with self._got:
                self._gone.add(session)
                if session == self.session:
                    self.error = repr(e)[:300]
                    self.session = ""  # the next announcement joins again
                self._got.notify_all()

    def receive(self, ref: ObjectRef, into: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """The version ``ref`` announces, copied into ``into`` and checked against its
        digest; waits for it at most ``timeout_s`` (joining the session first if new).
        Raises ``TimeoutError``, ``Superseded`` (newer versions came and it is no longer
        kept: they will be loaded) or ``WeightsDigestMismatch``."""
        rv = msgspec.json.decode(ref.location, type=Rendezvous)
        if rv.session in self._gone:
            raise ConnectionError(f"the trainer's broadcast session {rv.session} is gone")
        if rv.session != self.session:
            self._join(rv)
        version = rv.version

        def arrived() -> bool:
            return max(self._have, default=-1) >= version or self.error is not None

        with self._got:
            if not self._got.wait_for(arrived, timeout_s):
                raise TimeoutError(f"weights version {version} did not arrive in {timeout_s:g} s")
            buffer = self._have.get(version)
            if buffer is None and max(self._have, default=-1) < version:
                raise ConnectionError(f"the trainer's broadcast broke: {self.error}")
            if buffer is None:
                raise Superseded(f"versions {sorted(self._have)} arrived, {version} is gone")
            lock = self._locks[buffer]
            lock.acquire()  # (before the receiving thread can evict it)
        try:
            into.copy_(self._buffers[buffer])
        finally:
            lock.release()
        actual = device_digest(into)
        if actual != ref.digest:
            raise WeightsDigestMismatch(ref.digest, actual)
        return into


class Superseded(Exception):
    """A newer version arrived before the one asked for (its announcement follows)."""
