"""The torch backend: the async ``Backend`` over a ``TorchEngine``, one decode loop.

``TorchBackend`` answers the inference role's requests with a ``TorchEngine``
(``roles.inference.engine``: KV slots, the fixed decode step) driven by a ``DecodeLoop``:
requests never wait for a whole batch; they join the running decode loop between two
steps as soon as a slot is free, and each finished row is answered at once.

How the loop runs. ``submit_many`` queues requests (generate and score in two FIFO
queues) and awaits their futures. The first request to reach an idle loop opens a window
of ``batch_window_ms``, so that concurrent requests (a GRPO group) start together; then
the loop runs in a worker thread (``asyncio.to_thread``) under ``lock`` for as long as it
has work, and between two decode steps it

1. answers the queued score requests with one forward of their own (``TorchEngine.score``);
2. admits queued generate requests into free slots (``TorchEngine.add``) in groups: once
   ``admit_rows`` of them (default a quarter of the slots) can be placed, or the oldest
   has waited ``batch_window_ms``, or at once when no row is live. Refusals are answered
   at once; the rest are prefilled together (shared prefixes copied) before the next
   step. Grouping, because a prefill pass has a fixed cost whatever its rows;
3. runs one decode step (``TorchEngine.step``) and answers the rows it finished (their
   futures are resolved together, one ``loop.call_soon_threadsafe`` per iteration: one
   wake-up of the event loop per step); rows whose caller has gone are dropped.

A row's tokens depend only on its request and seed (the engine's guarantee), so the
schedule never changes what a request gets, only when.

Weight swaps (``inference.swap``). "in_flight" (the default, ``between_steps``): the
new weights are verified off the loop, then copied into the model by the worker thread
between two decode steps while the live rows carry on (``TorchEngine.swap_in_flight``
records from which token each samples under the new version); the generation pauses
for that copy only. "drain" (``exclusive``): admissions stop, the live rows finish, the
loop returns and releases ``lock``, the swap runs, admissions resume, so every
completion comes from one version; queued requests wait meanwhile (nothing is lost),
bounded by the longest live row's remaining budget.

Counters (``BatchStats``): ``batches`` counts admission rounds (one prefill of newly
admitted requests, or one score forward), ``items`` the requests taken in them,
``queue_s`` their summed waits from submit to admission, ``largest_batch`` the most rows
decoded together, ``busy_s`` the time the worker thread ran the loop (it returns as soon
as it has no work, so that time is all computing), counted each iteration.

    backend = TorchBackend.from_path("runs/x/model/initial", max_batch_size=64)
    (result,) = await backend.generate([GenerateRequest(request_id="r", prompt_ids=...)])
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from roles.inference.engine import Row, TorchEngine
from schemas import (
    GenerateRequest,
    GenerateResult,
    InferenceFailed,
    ObjectRef,
    ScoreRequest,
    ScoreResult,
)

Request = GenerateRequest | ScoreRequest
Reply = GenerateResult | ScoreResult | InferenceFailed


class BatcherClosed(RuntimeError):
    """The backend was closed before this request ran."""


@dataclass
class BatchStats:
    """Cumulative counters of the decode loop (read by metrics; written by the loop)."""

    batches: int = 0
    items: int = 0
    largest_batch: int = 0
    busy_s: float = 0.0  # time spent running the loop
    queue_s: float = 0.0  # summed waiting time of all items
    sizes: list[int] = field(default_factory=list)  # last few round sizes, for debugging

    def round(self, size: int, queue_s: float) -> None:
        self.batches, self.items, self.queue_s = (
            self.batches + 1,
            self.items + size,
            self.queue_s + queue_s,
        )
        self.sizes = [*self.sizes[-31:], size]


@dataclass
class _Pending:
    item: Request
    enqueued: float
    future: asyncio.Future[Reply]


# Resolve a request's future with its reply or error (from the worker thread).
Answer = Callable[[_Pending, Reply | BaseException], None]


def _settle(future: asyncio.Future[Any], value: object) -> None:
    """Resolve ``future`` (on the event loop) unless its caller has gone."""
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


def _settle_all(answers: list[tuple[asyncio.Future[Reply], Reply | BaseException]]) -> None:
    for future, value in answers:
        _settle(future, value)


class DecodeLoop:
    """Queues requests and runs the engine's decode loop (module docstring)."""

    def __init__(
        self, engine: TorchEngine, *, batch_window_ms: float = 5.0, admit_rows: int | None = None
    ) -> None:
        self.engine = engine
        self.window_s = max(0.0, batch_window_ms) / 1000.0
        group = max(1, engine.max_rows // 4) if admit_rows is None else admit_rows
        self.admit_rows = min(max(1, group), engine.max_rows)
        self.lock = asyncio.Lock()  # held while the loop runs; a weights swap takes it
        self.stats = BatchStats()
        self._gen: deque[_Pending] = deque()  # appended by the event loop, popped by the
        self._scores: deque[_Pending] = deque()  # worker (deque ops are thread-safe)
        self._draining = 0  # > 0: a swap waits, admit nothing new
        self._stop = False  # close() ran out of time: give up live rows
        self._arrived = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        # Calls for the worker thread between two steps (``between_steps``).
        self._calls: deque[tuple[Callable[[], None], asyncio.Future[float]]] = deque()

    # -- the event-loop side ------------------------------------------------------------

    async def submit_many(self, items: Sequence[Request]) -> list[Reply]:
        """Queue ``items`` and await their results (in order)."""
        if self._closed:
            raise BatcherClosed("the backend is closed")
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        pending = [_Pending(item, now, loop.create_future()) for item in items]
        for p in pending:
            (self._scores if isinstance(p.item, ScoreRequest) else self._gen).append(p)
        self._idle.clear()
        self._arrived.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="decode-loop")
        return list(await asyncio.gather(*(p.future for p in pending)))

    async def between_steps(self, call: Callable[[], None]) -> float:
        """Run ``call()`` in the worker thread between two decode steps, live rows kept
        (an in-flight weights swap); the seconds it held the loop."""
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self._calls.append((call, future))
        self._arrived.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="decode-loop")
        return await future

    def _run_calls(self, loop: asyncio.AbstractEventLoop) -> None:
        """(worker thread) The calls queued by ``between_steps``, each answered."""
        while self._calls:
            call, future = self._calls.popleft()
            start = time.perf_counter()
            try:
                call()
            except Exception as e:  # noqa: BLE001 - the caller gets it
                loop.call_soon_threadsafe(_settle, future, e)
            else:
                loop.call_soon_threadsafe(_settle, future, time.perf_counter() - start)

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the engine between two decode steps with no row live (a weights swap)."""
        self._draining += 1
        try:
            async with self.lock:
                yield
        finally:
            self._draining -= 1

    async def _run(self) -> None:
        while True:
            while not (self._gen or self._scores or self._calls):
                self._idle.set()
                self._arrived.clear()
                await self._arrived.wait()
            queued = [p.enqueued for p in (*self._gen, *self._scores)]
            deadline = min(queued, default=time.perf_counter()) + self.window_s
            while queued and len(self._gen) + len(self._scores) < self.engine.max_rows:
                if (remaining := deadline - time.perf_counter()) <= 0:
                    break
                self._arrived.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._arrived.wait()
            async with self.lock:
                await asyncio.to_thread(self._drive, asyncio.get_running_loop())

    async def close(self, timeout_s: float = 30.0) -> None:
        """Refuse new requests, finish the queued ones (up to ``timeout_s``), then stop."""
        self._closed = True
        if self._task is not None and not self._task.done():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self._idle.wait()
            self._stop = True  # a loop still running gives its live rows up and returns
            async with self.lock:
                self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for queue in (self._gen, self._scores):
            while queue:
                _settle(queue.popleft().future, BatcherClosed("closed before the request ran"))

    # -- the worker-thread side ---------------------------------------------------------

    def _drive(self, loop: asyncio.AbstractEventLoop) -> None:
        """Decode until no row is live and nothing can be admitted (module docstring)."""
        eng, mark, score_s = self.engine, time.perf_counter(), 0.0
        live: list[Row] = []
        # Answers wait for the end of the iteration, then go to the event loop together:
        # one wake-up per step, not one per finished row.
        answers: list[tuple[asyncio.Future[Reply], Reply | BaseException]] = []

        def answer(p: _Pending, value: Reply | BaseException) -> None:
            answers.append((p.future, value))

        def send() -> None:
            if answers:
                loop.call_soon_threadsafe(_settle_all, answers.copy())
                answers.clear()

        try:
            while not self._stop:
                send()
                mark = self._account(mark, score_s)  # the last iteration, as it ended
                self._run_calls(loop)
                score_s = self._answer_scores(answer)
                if not self._draining:
                    live += self._admit(len(live), answer)
                if not live:
                    eng.flush()  # (pipelined: the step after the last answer computed nothing)
                    if self._draining or not self._gen:
                        return
                    continue
                self.stats.largest_batch = max(self.stats.largest_batch, len(live))
                for row, result in eng.step():
                    answer(row.tag, result)
                live = [r for r in live if eng.rows[r.slot] is r]
                for row in [r for r in live if r.tag.future.done()]:
                    eng.drop(row)  # its caller has gone
                    live.remove(row)
            for row in live:
                eng.drop(row)
                answer(row.tag, BatcherClosed("closed before the request finished"))
        except Exception as e:  # noqa: BLE001 - every request it holds gets the error
            for row in live:
                answer(row.tag, e)
            for queue in (self._gen, self._scores):  # (a loop that fails at once
                while queue:  # would otherwise be restarted for them forever)
                    answer(queue.popleft(), e)
            self._reset_engine()
        finally:
            send()
            self._account(mark, score_s)

    def _reset_engine(self) -> None:
        """After a failure: free every slot, so the next loop starts clean."""
        eng = self.engine
        eng._pending = None
        for row in [r for r in eng.rows if r is not None]:
            with contextlib.suppress(Exception):
                eng.drop(row)

    def _account(self, mark: float, score_s: float) -> float:
        """Count the time since ``mark`` as busy; now. Counted every iteration, so metrics
        read a loop that never pauses under steady load as busy, not idle."""
        now = time.perf_counter()
        self.stats.busy_s += now - mark
        return now

    def _admit(self, n_live: int, answer: Answer) -> list[Row]:
        """Take queued generate requests into free slots: the rows that need decoding."""
        eng = self.engine
        free = eng.free
        if not self._gen or free <= 0:
            return []
        now = time.perf_counter()
        if (
            n_live
            and min(len(self._gen), free) < self.admit_rows
            and now - self._gen[0].enqueued < self.window_s
        ):
            return []  # one prefill for several rows: let a few more free up or arrive
        waits: list[float] = []
        out: list[Row] = []
        while self._gen and eng.free:
            p = self._gen.popleft()
            if p.future.done():
                continue
            waits.append(now - p.enqueued)
            row = eng.add(p.item, now)  # type: ignore[arg-type]
            if isinstance(row, Row):
                row.tag, row.queue_s = p, now - p.enqueued
                out.append(row)
            else:
                answer(p, row)
        if waits:
            self.stats.round(len(waits), sum(waits))
        return out

    def _answer_scores(self, answer: Answer) -> float:
        """Answer the queued score requests with one forward; the seconds it took."""
        taken: list[_Pending] = []
        while self._scores and len(taken) < self.engine.max_rows:
            if not (p := self._scores.popleft()).future.done():
                taken.append(p)
        if not taken:
            return 0.0
        start = time.perf_counter()
        try:
            replies = self.engine.score([p.item for p in taken])  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - each of these callers gets the error
            for p in taken:
                answer(p, e)
            return time.perf_counter() - start
        for p, reply in zip(taken, replies, strict=True):
            answer(p, reply)
        self.stats.round(len(taken), sum(start - p.enqueued for p in taken))
        return time.perf_counter() - start


class TorchBackend:
    """The async ``Backend`` over a ``TorchEngine`` (module docstring)."""

    name = "torch"

    def __init__(
        self,
        engine: TorchEngine,
        *,
        batch_window_ms: float = 5.0,
        admit_rows: int | None = None,
        swap: str = "in_flight",
    ) -> None:
        if swap not in ("in_flight", "drain"):
            raise ValueError(f"inference.swap must be 'in_flight' or 'drain', not {swap!r}")
        self.engine = engine
        self.swap = swap
        self.loop = DecodeLoop(engine, batch_window_ms=batch_window_ms, admit_rows=admit_rows)

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        *,
        batch_window_ms: float = 5.0,
        swap: str = "in_flight",
        **engine_kw: Any,
    ) -> TorchBackend:
        """Load the model (slow: call it in a thread from async code); ``engine_kw`` go to
        ``TorchEngine.from_path``."""
        engine = TorchEngine.from_path(path, **engine_kw)
        return cls(engine, batch_window_ms=batch_window_ms, swap=swap)

    def describe(self) -> dict[str, Any]:
        return self.engine.describe()

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def max_model_len(self) -> int:
        return self.engine.max_len

    async def generate(self, reqs: list[GenerateRequest]) -> list[GenerateResult | InferenceFailed]:
        return await self.loop.submit_many(reqs)  # type: ignore[arg-type,return-value]

    async def score(self, reqs: list[ScoreRequest]) -> list[ScoreResult | InferenceFailed]:
        return await self.loop.submit_many(reqs)  # type: ignore[arg-type,return-value]

    async def load_weights(self, data: bytes, digest: str, version: int) -> float:
        # Verify and shape-check outside the loop: decoding goes on meanwhile.
        state = await asyncio.to_thread(self.engine.check_state, data, digest)
        if self.swap == "in_flight":
            state = await asyncio.to_thread(self.engine.stage_state, state)  # on the device

            def load(model: torch.nn.Module) -> None:
                model.load_state_dict(state, strict=False)  # (shapes checked above)

            return await self._swap(load, version)
        async with self.loop.exclusive():  # between steps, once the live rows have finished
            start = time.perf_counter()
            await asyncio.to_thread(self.engine.load_state, data, digest, version)
            return time.perf_counter() - start

    async def load_shared(self, ref: ObjectRef, version: int) -> float:
        """Copy a version out of the trainer's shared ring (``trainer.weights_via =
        "ipc"``): verified off the loop, swapped in as ``inference.swap`` says."""
        await asyncio.to_thread(self.engine.stage_shared, ref)
        if self.swap == "in_flight":
            return await self._swap(self.engine.load_staged, version)
        async with self.loop.exclusive():
            start = time.perf_counter()
            await asyncio.to_thread(self.engine.swap_in_flight, self.engine.load_staged, version)
            return time.perf_counter() - start

    async def _swap(self, load: Callable[[torch.nn.Module], None], version: int) -> float:
        """``load`` the new weights between two decode steps, rows live; the pause (on
        CUDA it waits for the copy, so the figure is what the generation lost)."""

        def swap() -> None:
            self.engine.swap_in_flight(load, version)
            if self.engine.device.type == "cuda":
                torch.cuda.synchronize(self.engine.device)

        return await self.loop.between_steps(swap)

    def stats(self) -> dict[str, float]:
        b = self.loop.stats
        return {
            **dataclasses.asdict(self.engine.stats),  # requests, tokens, steps, compute_s
            "batches": b.batches,
            "batched_items": b.items,
            "largest_batch": b.largest_batch,
            "busy_s": b.busy_s,
            "queue_s": b.queue_s,
        }

    async def close(self) -> None:
        await self.loop.close()
