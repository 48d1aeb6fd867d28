"""The transformers/torch inference backend: batched generation and scoring on CPU or a GPU.

``TorchEngine`` is synchronous and owns the model: it answers a batch of generate and
score requests (``run_batch``), offers the steps of decoding one at a time
(``admit_row``, ``prefill``, ``sample_rows``, ``step``) and swaps weights
(``load_state``). ``TorchBackend`` is the async ``Backend`` around it, in one of two modes:

- ``continuous=True`` (``inference.continuous_batching``): a ``ContinuousBatcher``
  (``roles.inference.continuous``) runs one decode loop that requests join between iterations and leave as they finish;
  a weights swap stops admissions and lands once the live rows have finished;
- ``continuous=False`` (the default): a static ``Batcher`` collects concurrent requests
  and runs each batch to completion in a worker thread; weight swaps take the batcher's lock, so they
  land between batches.

How a generate batch runs (``TorchEngine._generate``; the continuous loop takes the same steps):

- prompts are left-padded into one [B, L] tensor with an attention mask; position ids
  count real tokens only (``cumsum(mask) - 1``), so a padded row sees exactly the
  positions it would see alone (tested: batched greedy == unbatched greedy);
- one prefill pass with ``use_cache=True`` (transformers 5 returns a ``DynamicCache``),
  then one token per step fed with the cache, the mask grown by one column;
- each row stops on its own: a stop token (the request's ``stop_token_ids`` plus the
  renderer's ``<|end|>``/eos), a stop string of ``sampling.stop`` appearing in the
  decoded completion, or its ``max_completion_tokens`` clamped so prompt + completion
  fits ``max_model_len``. The token that stopped it is part of the completion. Finished
  rows leave the batch (``DynamicCache.batch_select_indices``), so a long straggler
  does not pay for the rows that are done;
- sampling and logprobs come from ``roles.inference.sampling`` with one generator per
  request seeded from its ``seed``.

    engine = TorchEngine.from_path("runs/x/model/initial")
    backend = TorchBackend(engine, max_batch_size=32, batch_window_ms=5)
    (result,) = await backend.generate([GenerateRequest(request_id="r", prompt_ids=...)])

On CUDA (``serving_dtype``, ``limit_gpu_memory``): weights are served in bfloat16 (or
``inference.dtype``) while the trainer keeps float32 masters; every logprob is computed
in float32 (``logits.float()`` before the log-softmax); the CUDA allocator is capped at
``inference.gpu_memory_fraction`` so a trainer fits beside it. On the CPU weights stay in
``model.dtype``. Measured on an H100: docs/deployment.md.

Torch threads: ``RLBUS_TORCH_THREADS`` (default 1), because several roles share a
small CPU and oversubscribed BLAS threads make every one of them slower.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from roles.inference import sampling
from roles.inference.backend import admit_generate, admit_score, check_finite, serving_dtype
from roles.inference.batcher import Batcher
from roles.inference.continuous import ContinuousBatcher
from roles.inference.kv_cache import Running
from roles.inference.torch_setup import configure_torch_threads, default_stop_ids, limit_gpu_memory
from roles.lib.model.loading import load_model, load_tokenizer, resolve_device
from roles.lib.model.weights import (
    WeightsDigestMismatch,
    bytes_to_state_dict,
    digest,
    load_state_bytes,
    tied_keys,
)
from schemas import GenerateRequest, GenerateResult, InferenceFailed, ScoreRequest, ScoreResult
from schemas.arrays import pack_f32, pack_i32

Request = GenerateRequest | ScoreRequest
Reply = GenerateResult | ScoreResult | InferenceFailed


@dataclasses.dataclass
class EngineStats:
    """Cumulative counters, written by the worker thread, read by metrics."""

    generate_requests: int = 0
    score_requests: int = 0
    failed_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    scored_tokens: int = 0
    compute_s: float = 0.0


@dataclasses.dataclass
class _Row:
    """One admitted generate request while its batch runs."""

    index: int  # position in the batch's request list
    req: GenerateRequest
    prompt: list[int]
    max_new: int
    stop: frozenset[int]
    generator: torch.Generator | None
    out_ids: list[int] = dataclasses.field(default_factory=list)
    out_lps: list[float] = dataclasses.field(default_factory=list)
    stop_strings: tuple[str, ...] = ()
    finish: str | None = None


class TorchEngine:
    """A causal LM plus the synchronous batch step (call from one thread at a time)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any | None = None,
        *,
        stop_token_ids: Sequence[int] | None = None,
        policy_version: int = 0,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.max_model_len = int(model.config.max_position_embeddings)
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        if pad is None:
            pad = getattr(model.config, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        if stop_token_ids is None:
            stop_token_ids = default_stop_ids(tokenizer) if tokenizer is not None else []
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self.policy_version = policy_version
        self.stats = EngineStats()
        # Most HF causal LMs accept logits_to_keep: project only the positions we read,
        # not [B, L, vocab] (which dominates memory for real vocabularies).
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        self._keep_last = {"logits_to_keep": 1} if self._keep_arg else {}

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        *,
        device: str = "auto",
        dtype: str = "float32",
        local_files_only: bool = True,
        stop_token_ids: Sequence[int] | None = None,
        gpu_memory_fraction: float | None = None,
        served_dtype: str = "auto",
    ) -> TorchEngine:
        """Load the model for serving: ``serving_dtype`` and the memory cap on CUDA."""
        configure_torch_threads()
        dev = resolve_device(device)
        limit_gpu_memory(dev, gpu_memory_fraction)  # before the first allocation
        model = load_model(
            path,
            dtype=serving_dtype(dtype, dev, served_dtype),
            device=dev,
            local_files_only=local_files_only,
        )
        tokenizer = load_tokenizer(path, local_files_only=local_files_only)
        return cls(model, tokenizer, stop_token_ids=stop_token_ids)

    # -- weights ------------------------------------------------------------------------

    def check_state(self, data: bytes, expected_digest: str) -> None:
        """Raise unless ``data`` has the announced digest, fits this model exactly and is
        finite everywhere (``WeightsNotFinite`` names the first tensor that is not).

        Run before taking the batch lock: a bad blob is refused without touching the
        model, so a half-copied or NaN state dict can never serve.
        """
        actual = digest(data)
        if actual != expected_digest:
            raise WeightsDigestMismatch(expected_digest, actual)
        state = bytes_to_state_dict(data)
        own = self.model.state_dict()
        expected = {k: tuple(v.shape) for k, v in own.items() if k not in tied_keys(own)}
        got = {k: tuple(v.shape) for k, v in state.items()}
        if got != expected:
            missing = sorted(set(expected) - set(got))
            unexpected = sorted(set(got) - set(expected))
            reshaped = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
            raise ValueError(
                f"weights do not fit the model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}, wrong shape {reshaped[:5]}"
            )
        check_finite(state.items())

    def load_state(self, data: bytes, expected_digest: str, version: int) -> None:
        """Copy the weights in and set the version (caller holds the batch lock).

        ``load_state_dict`` copies into the model's own parameters, which casts each
        tensor to their dtype and device: the trainer's float32 weights land in
        bfloat16 on CUDA (``serving_dtype``), with the same rounding as ``.to()``.
        """
        with torch.no_grad():
            load_state_bytes(self.model, data, expected_digest)
        self.policy_version = version

    # -- one batch ----------------------------------------------------------------------

    def run_batch(self, reqs: list[Request], queue_s: list[float]) -> list[Reply]:
        """Answer a mixed batch of generate and score requests, in order."""
        out: list[Reply | None] = [None] * len(reqs)
        gen = [i for i, r in enumerate(reqs) if isinstance(r, GenerateRequest)]
        scr = [i for i, r in enumerate(reqs) if isinstance(r, ScoreRequest)]
        with torch.inference_mode():
            if scr:
                for i, reply in zip(scr, self._score([reqs[i] for i in scr]), strict=True):  # type: ignore[misc]
                    out[i] = reply
            if gen:
                replies = self._generate([reqs[i] for i in gen], [queue_s[i] for i in gen])  # type: ignore[misc]
                for i, reply in zip(gen, replies, strict=True):
                    out[i] = reply
        self.stats.failed_requests += sum(isinstance(r, InferenceFailed) for r in out)
        return [r for r in out if r is not None]

    def _forward(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, **kw: Any) -> Any:
        return self.model(input_ids=ids, attention_mask=mask, position_ids=pos, **kw)

    # -- generate -----------------------------------------------------------------------

    def _generate(self, reqs: list[GenerateRequest], queue_s: list[float]) -> list[Reply]:
        start, version = time.perf_counter(), self.policy_version
        rows = [self.admit_row(req, i) for i, req in enumerate(reqs)]
        if active := [r for r in rows if isinstance(r, _Row) and r.finish is None]:
            self._decode(active)
        compute_s = time.perf_counter() - start
        self.stats.compute_s += compute_s
        return [
            self.result(r, version, queue_s[r.index], compute_s) if isinstance(r, _Row) else r
            for r in rows
        ]

    def admit_row(self, req: GenerateRequest, index: int = 0) -> _Row | InferenceFailed:
        """The row of a servable request (finished at once when its budget is 0), else why
        it cannot be served."""
        admitted = admit_generate(req, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        if isinstance(admitted, InferenceFailed):
            return admitted
        (prompt, budget), s = admitted, req.sampling
        row = _Row(
            index=index,
            req=req,
            prompt=prompt,
            max_new=budget,
            stop=self.stop_token_ids | frozenset(req.stop_token_ids),
            generator=sampling.make_generator(req.seed, self.device) if s.temperature > 0 else None,
            stop_strings=tuple(x for x in s.stop if x),
        )
        if row.stop_strings and self.tokenizer is None:
            return InferenceFailed(
                request_id=req.request_id,
                kind="bad_request",
                message="stop strings need a tokenizer; send stop_token_ids",
            )
        if budget == 0:
            row.finish = "length"
        return row

    def result(self, r: _Row, version: int, queue_s: float, compute_s: float) -> GenerateResult:
        """A finished row's answer (and its share of the counters)."""
        self.stats.generate_requests += 1
        self.stats.prompt_tokens += len(r.prompt)
        self.stats.completion_tokens += len(r.out_ids)
        return GenerateResult(
            request_id=r.req.request_id,
            completion_ids=pack_i32(r.out_ids),
            logprobs=pack_f32(r.out_lps),
            finish_reason=r.finish or "length",
            policy_version=version,
            prompt_tokens=len(r.prompt),
            queue_s=queue_s,
            compute_s=compute_s,
        )

    def _decode(self, rows: list[_Row]) -> None:
        """Prefill, then decode token by token until every row has finished."""
        params = self.row_params(rows)
        logits, run = self.prefill(rows)
        live = list(rows)  # the rows in the tensors, in order
        compact = hasattr(run.cache, "batch_select_indices")
        while True:
            tok = self.sample_rows(live, logits, params)
            keep_rows = [b for b, r in enumerate(live) if r.finish is None]
            if not keep_rows:
                return
            if compact and len(keep_rows) < len(live):
                # Finished rows leave the batch: their cache rows, mask and params go too.
                sel = torch.tensor(keep_rows, device=self.device)
                run.select(sel)
                live = [live[b] for b in keep_rows]
                tok, params = tok[sel], params.select(sel)
            logits = self.step(run, tok)

    def row_params(self, rows: Sequence[_Row]) -> sampling.RowParams:
        """The sampling parameters of ``rows``, one tensor entry per row."""
        s = [r.req.sampling for r in rows]
        return sampling.RowParams.of(
            [x.temperature for x in s], [x.top_k for x in s], [x.top_p for x in s], self.device
        )

    def prefill(self, rows: list[_Row]) -> tuple[torch.Tensor, Running]:
        """One forward over the left-padded prompts: each row's next-token logits [B, V]
        (float32) and the running batch (cache, mask, next positions)."""
        width = max(len(r.prompt) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[b, width - len(r.prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self._forward(ids, mask, pos, use_cache=True, **self._keep_last)
        # float32 before sampling's log-softmax (a no-op for a float32 model: the CPU path).
        return out.logits[:, -1, :].float(), Running(out.past_key_values, mask, pos[:, -1:] + 1)

    def step(self, run: Running, tok: torch.Tensor) -> torch.Tensor:
        """Feed each row its sampled token [B]; the next logits [B, V] (float32)."""
        run.grow()
        kw = {"past_key_values": run.cache, "use_cache": True, **self._keep_last}
        out = self._forward(tok[:, None], run.mask, run.next_pos, **kw)
        run.cache, run.next_pos = out.past_key_values, run.next_pos + 1
        return out.logits[:, -1, :].float()

    def sample_rows(
        self, live: list[_Row], logits: torch.Tensor, params: sampling.RowParams
    ) -> torch.Tensor:
        """Sample each row's next token [B], append it and its logprob, and mark the rows
        it finishes (a stop token or string, or the budget)."""
        tok, lps = sampling.sample(logits, params, [r.generator for r in live])
        for r, t, lp in zip(live, tok.tolist(), lps.tolist(), strict=True):
            if r.finish is not None:  # kept computing (no compaction): output ignored
                continue
            r.out_ids.append(t)
            r.out_lps.append(lp)
            if t in r.stop or self._hit_stop_string(r):
                r.finish = "stop"
            elif len(r.out_ids) >= r.max_new:
                r.finish = "length"
        return tok

    def _hit_stop_string(self, row: _Row) -> bool:
        """Whether the completion's text now contains one of the row's stop strings.

        Checked every step, so the first hit is caught on the token that completes it;
        only a tail of the completion is decoded (a token is at least one character
        for the tokenizers we serve, so ``len(stop) + 2`` tokens cover the string).
        """
        if not row.stop_strings or self.tokenizer is None:
            return False
        tail = max(len(x) for x in row.stop_strings) + 2
        text = self.tokenizer.decode(row.out_ids[-tail:], skip_special_tokens=False)
        return any(x in text for x in row.stop_strings)

    # -- score --------------------------------------------------------------------------

    def _score(self, reqs: list[ScoreRequest]) -> list[Reply]:
        version = self.policy_version
        replies: list[Reply | None] = [None] * len(reqs)
        todo: list[tuple[int, list[int]]] = []
        for i, req in enumerate(reqs):
            ids = admit_score(req, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
            if isinstance(ids, InferenceFailed):
                replies[i] = ids
            else:
                todo.append((i, ids))
        if todo:
            start = time.perf_counter()
            for (i, _), lps in zip(todo, self._score_logprobs(reqs, todo), strict=True):
                replies[i] = ScoreResult(
                    request_id=reqs[i].request_id, logprobs=pack_f32(lps), policy_version=version
                )
                self.stats.scored_tokens += len(lps)
            self.stats.score_requests += len(todo)
            self.stats.compute_s += time.perf_counter() - start
        return [r for r in replies if r is not None]

    def _score_logprobs(
        self, reqs: list[ScoreRequest], todo: list[tuple[int, list[int]]]
    ) -> list[np.ndarray]:
        dev = self.device
        width = max(len(ids) for _, ids in todo)
        ids_t = torch.full((len(todo), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(todo), width), dtype=torch.long)
        for b, (_, ids) in enumerate(todo):
            ids_t[b, width - len(ids) :] = torch.tensor(ids)
            mask[b, width - len(ids) :] = 1
        ids_t, mask = ids_t.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        # Rows end at the last column (left padding): the logits we need are the last
        # `span` columns, where span covers the longest scored tail plus its predictor.
        span = max(len(ids) - reqs[i].start for i, ids in todo) + 1
        keep = {"logits_to_keep": span} if self._keep_arg else {}
        logits = self._forward(ids_t, mask, pos, use_cache=False, **keep).logits[:, -span:, :]
        out = []
        for b, (i, ids) in enumerate(todo):
            n, s = len(ids) - reqs[i].start, reqs[i].start
            t = reqs[i].temperature if reqs[i].temperature > 0 else 1.0
            # logits column -span + k predicts the token at column width - span + k + 1.
            pred = logits[b, span - n - 1 : span - 1, :].float() / t
            target = torch.tensor(ids[s:], device=dev)
            lps = pred.log_softmax(-1).gather(-1, target[:, None]).squeeze(-1)
            out.append(lps.cpu().numpy().astype(np.float32))
        return out


class TorchBackend:
    """The async ``Backend`` over a ``TorchEngine``: batching, locking, counters."""

    name = "torch"

    def __init__(
        self,
        engine: TorchEngine,
        *,
        max_batch_size: int = 64,
        batch_window_ms: float = 5.0,
        continuous: bool = False,
    ) -> None:
        self.engine = engine
        size, window = max_batch_size, batch_window_ms
        self.batcher: Batcher[Request, Reply] | ContinuousBatcher = (
            ContinuousBatcher(engine, max_batch_size=size, batch_window_ms=window)
            if continuous
            else Batcher(engine.run_batch, max_batch_size=size, batch_window_ms=window)
        )

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        *,
        device: str = "auto",
        dtype: str = "float32",
        local_files_only: bool = True,
        max_batch_size: int = 64,
        batch_window_ms: float = 5.0,
        stop_token_ids: Sequence[int] | None = None,
        gpu_memory_fraction: float | None = None,
        served_dtype: str = "auto",
        continuous: bool = False,
    ) -> TorchBackend:
        """Load the model (slow: call it in a thread from async code)."""
        engine = TorchEngine.from_path(
            path,
            device=device,
            dtype=dtype,
            local_files_only=local_files_only,
            stop_token_ids=stop_token_ids,
            gpu_memory_fraction=gpu_memory_fraction,
            served_dtype=served_dtype,
        )
        return cls(
            engine,
            max_batch_size=max_batch_size,
            batch_window_ms=batch_window_ms,
            continuous=continuous,
        )

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def generate(self, reqs: list[GenerateRequest]) -> list[GenerateResult | InferenceFailed]:
        return await self.batcher.submit_many(reqs)  # type: ignore[arg-type,return-value]

    async def score(self, reqs: list[ScoreRequest]) -> list[ScoreResult | InferenceFailed]:
        return await self.batcher.submit_many(reqs)  # type: ignore[arg-type,return-value]

    async def load_weights(self, data: bytes, digest: str, version: int) -> None:
        # Verify and shape-check outside the lock: batches keep running meanwhile.
        await asyncio.to_thread(self.engine.check_state, data, digest)
        b = self.batcher  # between batches (continuous: once the live rows have finished)
        async with b.exclusive() if isinstance(b, ContinuousBatcher) else b.lock:
            await asyncio.to_thread(self.engine.load_state, data, digest, version)

    def stats(self) -> dict[str, float]:
        b = self.batcher.stats  # continuous: batches are admission rounds (continuous.py)
        return {
            **dataclasses.asdict(self.engine.stats),  # requests, tokens, compute_s
            "batches": b.batches,
            "batched_items": b.items,
            "largest_batch": b.largest_batch,
            "busy_s": b.busy_s,
            "queue_s": b.queue_s,
        }

    async def close(self) -> None:
        await self.batcher.close()
