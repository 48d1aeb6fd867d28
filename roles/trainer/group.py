"""A trainer on ``trainer.world_size`` ranks that is still one role on the bus.

Rank 0 is the trainer role's own process: it alone talks to NATS (one durable consumer
position, one ``weights.published`` and one ``metrics.reported.trainer`` per step, after
the step is complete on every rank). It starts ranks ``1..N-1`` as child processes
(``python -m roles.trainer.rank``) and drives them over their stdin with length-framed
msgpack commands: ``Train(batch)`` (also a batch rank 0 refused, after refusing it:
the other ranks step over it the same way), ``Gather`` (the full weights, for publishing),
``Save(folder)``/``Load(folder)`` (a sharded checkpoint), ``Reconfigure(config)`` (a
replay's fork). Each command is sent just before rank 0 runs the same call, so every
rank enters the same collectives in the same order (``roles.trainer.sharded``).

Failure is all-or-nothing, and never a wait without end:

- a rank that exits is seen by rank 0 at its next command, or by ``Ranks.check``
  (the role polls it between steps), and a rank that dies mid-step fails the
  collective rank 0 is in (gloo sees the closed socket; a hung rank is cut off by
  ``trainer.collective_timeout_s``). Either way rank 0 raises ``GroupBroken``; the role
  exits, the supervisor restarts it, and the new group resumes from its checkpoint and
  the log like a single-process trainer;
- ranks ``1..N-1`` get SIGKILL when rank 0 dies (``bus.children.die_with_parent``) and
  exit on end of input when it closes their stdin.

    ranks = Ranks.start(cfg, model_dir, "cpu")     # in a long-lived thread (see below)
    core = make_trainer(cfg, model_dir, ranks)    # TrainerCore's interface, on N ranks
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar

import msgspec

from bus.children import die_with_parent
from configs import RunConfig
from roles.lib.model.loading import resolve_device
from roles.trainer.core import TrainerCore
from roles.trainer.sharded import ShardedCore
from schemas import BatchAssembled

T = TypeVar("T")


class GroupBroken(Exception):
    """A rank died, failed or hung: the group cannot go on (the role restarts it)."""


class Init(msgspec.Struct, tag="init"):
    config: dict[str, Any]  # RunConfig, JSON mode
    model_dir: str
    device: str
    run: str


class Train(msgspec.Struct, tag="train"):
    batch: BatchAssembled


class Gather(msgspec.Struct, tag="gather"):
    pass


class Save(msgspec.Struct, tag="save"):
    folder: str


class Load(msgspec.Struct, tag="load"):
    folder: str


class Reconfigure(msgspec.Struct, tag="reconfigure"):
    config: dict[str, Any]


Command = Init | Train | Gather | Save | Load | Reconfigure
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Command)


def write_command(fd: int, command: Command, timeout_s: float) -> None:
    """Send ``command`` down a non-blocking pipe within ``timeout_s``: a rank that is alive
    but stuck (not reading) must not block rank 0 for ever once the pipe is full."""
    data = _encoder.encode(command)
    view = memoryview(len(data).to_bytes(4, "big") + data)
    deadline = time.monotonic() + timeout_s
    while view:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [fd], [], left)[1]:
            raise TimeoutError(f"the rank read no command for {timeout_s:.0f} s")
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            continue


def read_command(src: IO[bytes]) -> Command | None:
    """The next command, or None at end of input (rank 0 is gone or done)."""
    header = src.read(4)
    if len(header) < 4:
        return None
    size = int.from_bytes(header, "big")
    data = src.read(size)
    if len(data) < size:
        return None
    return _decoder.decode(data)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Ranks:
    """Ranks ``1..N-1`` as child processes of rank 0, fed commands on their stdin.

    ``start`` must run in a thread that lives as long as the ranks (the main thread or
    the event loop's): the parent-death signal fires when the *thread* that started a
    child exits (``bus.children``).
    """

    def __init__(self, procs: list[subprocess.Popen[bytes]], master: str, timeout_s: float):
        self.procs = procs
        self.master = master
        self.timeout_s = timeout_s  # trainer.collective_timeout_s: for commands too
        for proc in procs:
            assert proc.stdin is not None
            os.set_blocking(proc.stdin.fileno(), False)

    @property
    def world_size(self) -> int:
        return len(self.procs) + 1

    @classmethod
    def start(cls, cfg: RunConfig, model_dir: str | Path, device: str) -> Ranks:
        ws = cfg.trainer.world_size
        master = f"127.0.0.1:{_free_port()}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "roles.trainer.rank", str(rank), str(ws), master],
                stdin=subprocess.PIPE,
                preexec_fn=die_with_parent(signal.SIGKILL),
            )
            for rank in range(1, ws)
        ]
        ranks = cls(procs, master, cfg.trainer.collective_timeout_s)
        ranks.tell(Init(cfg.model_dump(mode="json"), str(model_dir), device, cfg.run or ""))
        return ranks

    def exits(self, wait_s: float = 0.0) -> str:
        """Which ranks have exited, and how ("" if none). ``wait_s``: after a collective
        failed, wait up to that long for a rank's exit to show (a killed rank's sockets
        close before its exit status is there to read)."""
        deadline = time.monotonic() + wait_s
        while True:
            gone = [f"rank {r} exited with code {p.returncode}" for r, p in self._numbered() if p.poll() is not None]  # fmt: skip
            if gone or time.monotonic() >= deadline:
                return ", ".join(gone)
            time.sleep(0.02)

    def check(self) -> None:
        """Raise ``GroupBroken`` if a rank has exited."""
        if gone := self.exits():
            raise GroupBroken(f"trainer {gone}")

    def tell(self, command: Command) -> None:
        self.check()
        for rank, proc in self._numbered():
            assert proc.stdin is not None
            try:
                write_command(proc.stdin.fileno(), command, self.timeout_s)
            except (OSError, ValueError) as e:  # a closed pipe or stdin, a rank not reading
                raise GroupBroken(f"trainer rank {rank} takes no more commands: {e!r}") from e

    def close(self, timeout_s: float = 30.0) -> None:
        """End of input for every rank (they leave the group and exit), then wait for all
        of them together up to ``timeout_s`` (0: kill them at once) and kill the rest."""
        for _, proc in self._numbered():
            if proc.stdin is not None and not proc.stdin.closed:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        deadline = time.monotonic() + timeout_s
        for _, proc in self._numbered():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _numbered(self) -> list[tuple[int, subprocess.Popen[bytes]]]:
        return list(enumerate(self.procs, start=1))


class GroupLeader(ShardedCore):
    """Rank 0: ``TrainerCore``'s interface for the role and replay; each call that runs
    collectives is sent to the other ranks first, and any failure is ``GroupBroken``."""

    def __init__(self, cfg: RunConfig, model_dir: str | Path, ranks: Ranks, device: str):
        self.ranks = ranks
        try:
            super().__init__(
                cfg, model_dir, rank=0, world_size=ranks.world_size, master=ranks.master,
                device=device,
            )  # fmt: skip
        except Exception as e:
            ranks.close(timeout_s=5.0)
            raise GroupBroken(
                f"the trainer group did not form: {e!r} {ranks.exits(wait_s=2.0)}"
            ) from e

    def _together(self, command: Command, call: Callable[..., T], *args: Any) -> T:
        self.ranks.tell(command)
        try:
            return call(*args)
        except Exception as e:
            raise GroupBroken(
                f"{type(e).__name__}: {e} {self.ranks.exits(wait_s=2.0)}".strip()
            ) from e

    def train_step(self, batch: BatchAssembled) -> dict[str, float]:
        # A gap or a malformed batch is the batch's fault, not the group's: it raises here,
        # before any rank sees it, as on one rank (a gap is retried, then dead-lettered; a
        # refused batch raises Rejected, and the role steps over it with refuse_step).
        self.check_next(batch)
        self.check_trainable(batch)
        start = time.perf_counter()
        mbs, denominators = self.micro_batches(batch)
        return self._together(Train(batch), self.train_packed, batch, mbs, denominators, start)

    def refuse_step(self, batch: BatchAssembled) -> dict[str, float]:
        # Checked and stepped over here first; then the other ranks step over it too
        # (ShardedCore.train_step), so every rank's fold is at the same step.
        metrics = super().refuse_step(batch)
        self.ranks.tell(Train(batch))
        return metrics

    def weights_bytes(self) -> bytes:
        return self._together(Gather(), super().weights_bytes)

    def write_snapshot(self, folder: Path) -> dict[str, Any]:
        return self._together(Save(str(folder)), super().write_snapshot, folder)

    def read_snapshot(self, folder: Path, state: dict[str, Any]) -> None:
        self._together(Load(str(folder)), super().read_snapshot, folder, state)

    def reconfigure(self, cfg: RunConfig) -> None:
        super().reconfigure(cfg)  # first: a refused config must not reach the other ranks
        self.ranks.tell(Reconfigure(cfg.model_dump(mode="json")))

    def close(self, broken: bool = False) -> None:
        """Stop the other ranks (at once when ``broken``: they may sit in a collective)
        and leave the group."""
        self.ranks.close(0.0 if broken else 30.0)
        super().close()


def start_ranks(cfg: RunConfig, model_dir: str | Path, device: str | None = None) -> Ranks | None:
    """Ranks ``1..N-1`` of ``cfg``'s trainer (None for one rank); see ``Ranks.start``."""
    if cfg.trainer.world_size == 1:
        return None
    return Ranks.start(cfg, model_dir, resolve_device(device or cfg.trainer.device))


def make_trainer(
    cfg: RunConfig, model_dir: str | Path, ranks: Ranks | None, device: str | None = None
) -> TrainerCore:
    """The trainer core of ``cfg``: one process, or rank 0 of ``ranks``' group."""
    if ranks is None:
        return TrainerCore(cfg, model_dir, device=device)
    return GroupLeader(cfg, model_dir, ranks, resolve_device(device or cfg.trainer.device))
