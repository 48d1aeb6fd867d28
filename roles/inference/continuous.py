"""Continuous batching for the torch engine: requests join and leave a running decode loop.

``ContinuousBatcher`` is what ``TorchBackend(continuous=True)``
(``inference.continuous_batching``) puts in front of its ``TorchEngine`` instead of the
static ``Batcher``. Requests never wait for
a whole batch: a new one joins the running batch between two decode iterations as soon
as a row is free, and a finished row is answered at once.

How it runs. ``submit_many`` queues requests (generate and score in two FIFO queues)
and awaits their futures. The first request to reach an idle loop opens a window of
``batch_window_ms`` (as the static batcher does); then the decode loop runs in a worker
thread (``asyncio.to_thread``) under ``lock`` for as long as it has work, and between
two decode iterations it

1. answers the queued score requests with one forward of their own (``run_batch``);
2. admits queued generate requests into free rows (at most ``max_batch_size`` live
   rows) in groups: once ``admit_rows`` of them (default ``max_batch_size // 8``) can
   be placed, or the oldest has waited ``batch_window_ms``, or at once when no row is
   live. Refusals (``admit_generate``) are answered at once; the rest are prefilled as
   their own left-padded batch and merged into the running KV cache
   (``kv_cache.Running.merge``). Grouping, because a prefill is one forward whatever
   its rows: one per freed row costs the tiny CPU model about as much as the decode
   steps it saves (``benchmarks/batching_bench.py``);
3. samples one token per live row (``TorchEngine.sample_rows``: the request's own
   generator, stop tokens and strings, budget);
4. answers each finished row at once (its future is resolved from the worker thread
   with ``loop.call_soon_threadsafe``), drops its row and trims the cache columns that
   are padding for every row left (``Running.trim``);
5. runs one decode step for the rows left.

A row's tokens depend only on its request and seed: its noise comes from its own
generator, its position ids count its own tokens, and the padding columns it sits
beside are masked out (tested: alone == static batch == admitted mid-decode).

Weight swaps (``exclusive``, taken by ``TorchBackend.load_weights``): admissions stop,
the live rows finish, the loop returns and releases ``lock``, the swap runs, admissions
resume. So every completion comes from one version. Queued requests wait meanwhile
(nothing is lost); the wait is bounded only by the longest live row's remaining budget.

Counters (``BatchStats``): ``batches`` counts admission rounds (one prefill of newly
admitted requests, or one score forward), ``items`` the requests taken in them,
``queue_s`` their summed waits from submit to admission, ``largest_batch`` the most
rows decoded together, ``busy_s`` the time the worker thread ran the loop (it returns
as soon as it has no work, so that time is all computing), counted each iteration.

    batcher = ContinuousBatcher(engine, max_batch_size=32, batch_window_ms=5)
    (result,) = await batcher.submit_many([GenerateRequest(...)])
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from roles.inference import kv_cache, sampling
from roles.inference.batcher import BatcherClosed, BatchStats
from schemas import GenerateRequest, GenerateResult, InferenceFailed, ScoreRequest, ScoreResult

if TYPE_CHECKING:
    from roles.inference.torch_backend import TorchEngine, _Row

Request = GenerateRequest | ScoreRequest
Reply = GenerateResult | ScoreResult | InferenceFailed


@dataclass
class _Pending:
    item: Request
    enqueued: float
    future: asyncio.Future[Reply]
    admitted: float = 0.0


# Resolve a request's future with its reply or error (from the worker thread).
Answer = Callable[[_Pending, Reply | BaseException], None]


@dataclass
class _Live:
    """The rows the decode loop runs, in the order of its tensors' batch dim."""

    params: sampling.RowParams  # each row's sampling parameters
    rows: list[_Row] = field(default_factory=list)
    slots: list[_Pending] = field(default_factory=list)  # slots[b] asked for rows[b]
    run: kv_cache.Running | None = None  # cache, mask, next positions
    logits: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # next-token
    mergeable: bool = True  # whether new rows may join a running batch (kv_cache)


def _settle(future: asyncio.Future[Reply], value: Reply | BaseException) -> None:
    """Resolve ``future`` (on the event loop) unless its caller has gone."""
    if future.done():
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)


def _cat_params(a: sampling.RowParams, b: sampling.RowParams) -> sampling.RowParams:
    return sampling.RowParams(
        torch.cat([a.temperature, b.temperature]),
        torch.cat([a.top_k, b.top_k]),
        torch.cat([a.top_p, b.top_p]),
    )


class ContinuousBatcher:
    """Queues requests and runs the continuous decode loop (module docstring)."""

    def __init__(
        self,
        engine: TorchEngine,
        *,
        max_batch_size: int = 64,
        batch_window_ms: float = 5.0,
        admit_rows: int | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.window_s = max(0.0, batch_window_ms) / 1000.0
        # A prefill has a fixed cost (a forward) whatever its rows: group admissions.
        group = max(1, max_batch_size // 8) if admit_rows is None else admit_rows
        self.admit_rows = min(max(1, group), max_batch_size)
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

    # -- the event-loop side ------------------------------------------------------------

    async def submit_many(self, items: Sequence[Request]) -> list[Reply]:
        """Queue ``items`` and await their results (in order)."""
        if self._closed:
            raise BatcherClosed("batcher is closed")
        loop = asyncio.get_running_loop()
        now = time.perf_counter()
        pending = [_Pending(item, now, loop.create_future()) for item in items]
        for p in pending:
            (self._scores if isinstance(p.item, ScoreRequest) else self._gen).append(p)
        self._idle.clear()
        self._arrived.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="continuous-batcher")
        return list(await asyncio.gather(*(p.future for p in pending)))

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Hold the engine between two decode iterations with no row live (a swap)."""
        self._draining += 1
        try:
            async with self.lock:
                yield
        finally:
            self._draining -= 1

    async def _run(self) -> None:
        while True:
            while not (self._gen or self._scores):
                self._idle.set()
                self._arrived.clear()
                await self._arrived.wait()
            deadline = min(p.enqueued for p in (*self._gen, *self._scores)) + self.window_s
            while len(self._gen) + len(self._scores) < self.max_batch_size:
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
        version = eng.policy_version  # swaps happen only while this loop is not running
        live = _Live(params=sampling.RowParams.of([]))

        def answer(p: _Pending, value: Reply | BaseException) -> None:
            loop.call_soon_threadsafe(_settle, p.future, value)

        try:
            with torch.inference_mode():
                while not self._stop:
                    mark = self._account(mark, score_s)  # the last iteration, as it ended
                    score_s = self._answer_scores(answer)
                    if not self._draining and (live.run is None or live.mergeable):
                        self._join(live, self._admit(len(live.rows), answer))
                    if live.run is None:
                        if self._draining or not self._gen:
                            return
                        continue
                    self.stats.largest_batch = max(self.stats.largest_batch, len(live.rows))
                    tok = eng.sample_rows(live.rows, live.logits, live.params)
                    tok = self._retire(live, tok, version, answer)
                    if live.run is not None:
                        live.logits = eng.step(live.run, tok)
                for p in live.slots:
                    answer(p, BatcherClosed("closed before the request finished"))
        except Exception as e:  # noqa: BLE001 - every request it holds gets the error
            for p in live.slots:
                answer(p, e)
            for queue in (self._gen, self._scores):  # (a loop that fails at once
                while queue:  # would otherwise be restarted for them forever)
                    answer(queue.popleft(), e)
        finally:
            self._account(mark, score_s)

    def _account(self, mark: float, score_s: float) -> float:
        """Count the time since ``mark`` as busy, and as compute less the scoring (which
        ``run_batch`` counts itself); now. Counted every iteration, so metrics read a
        loop that never pauses under steady load as busy, not idle."""
        now = time.perf_counter()
        self.stats.busy_s += now - mark
        self.engine.stats.compute_s += now - mark - score_s
        return now

    def _join(self, live: _Live, new: list[tuple[_Row, _Pending]]) -> None:
        """Prefill newly admitted rows as their own batch and merge them into ``live``."""
        if not new:
            return
        rows = [r for r, _ in new]
        live.slots += [p for _, p in new]
        logits, run = self.engine.prefill(rows)
        params = self.engine.row_params(rows)
        if live.run is None:
            live.run, live.logits, live.params = run, logits, params
            live.mergeable = kv_cache.mergeable(run.cache)
        else:
            live.run.merge(run)
            live.logits = torch.cat([live.logits, logits])
            live.params = _cat_params(live.params, params)
        live.rows += rows

    def _retire(self, live: _Live, tok: torch.Tensor, version: int, answer: Answer) -> torch.Tensor:
        """Answer the rows ``tok`` finished, drop them (and rows whose caller has gone)
        and the padding left; the tokens of the rows that go on."""
        now, keep = time.perf_counter(), []
        for b, (r, p) in enumerate(zip(live.rows, live.slots, strict=True)):
            if r.finish is not None:
                compute_s, queue_s = now - p.admitted, p.admitted - p.enqueued
                answer(p, self.engine.result(r, version, queue_s, compute_s))
            elif not p.future.done():
                keep.append(b)
        if len(keep) == len(live.rows):
            return tok
        live.rows, live.slots = [live.rows[b] for b in keep], [live.slots[b] for b in keep]
        if not keep or live.run is None:  # (never None while rows are live)
            live.run = None
            return tok
        sel = torch.tensor(keep, device=tok.device)
        live.run.select(sel)
        live.params = live.params.select(sel)
        if live.mergeable:
            live.run.trim()
        return tok[sel]

    def _answer_scores(self, answer: Answer) -> float:
        """Answer the queued score requests with one forward; the seconds it took."""
        taken: list[_Pending] = []
        while self._scores and len(taken) < self.max_batch_size:
            if not (p := self._scores.popleft()).future.done():
                taken.append(p)
        if not taken:
            return 0.0
        start = time.perf_counter()
        waits = [start - p.enqueued for p in taken]
        self._count_round(len(taken), sum(waits))
        replies = self.engine.run_batch([p.item for p in taken], waits)
        for p, reply in zip(taken, replies, strict=True):
            answer(p, reply)
        return time.perf_counter() - start

    def _admit(self, n_live: int, answer: Answer) -> list[tuple[_Row, _Pending]]:
        """Take queued generate requests into free rows: those that need decoding."""
        free = self.max_batch_size - n_live
        if not self._gen or free <= 0:
            return []
        now = time.perf_counter()
        fill = min(len(self._gen), free)
        if n_live and fill < self.admit_rows and now - self._gen[0].enqueued < self.window_s:
            return []  # one prefill for several rows: let a few more free up or arrive
        eng, waits = self.engine, []
        out: list[tuple[_Row, _Pending]] = []
        while self._gen and len(out) < free:
            p = self._gen.popleft()
            if p.future.done():
                continue
            p.admitted = now
            waits.append(now - p.enqueued)
            row = eng.admit_row(p.item)  # type: ignore[arg-type]
            if isinstance(row, InferenceFailed):
                eng.stats.failed_requests += 1
                answer(p, row)
            elif row.finish is not None:  # nothing to generate (budget 0)
                answer(p, eng.result(row, eng.policy_version, now - p.enqueued, 0.0))
            else:
                out.append((row, p))
        if waits:
            self._count_round(len(waits), sum(waits))
        return out

    def _count_round(self, size: int, queue_s: float) -> None:
        s = self.stats
        s.batches, s.items, s.queue_s = s.batches + 1, s.items + size, s.queue_s + queue_s
        s.sizes = [*s.sizes[-31:], size]
