"""The vLLM inference backend (``inference.backend = "vllm"``): same contract, GPU engine.

vLLM is an optional extra (``pip install 'rlbus[vllm]'``) and is imported only inside
``VllmBackend.__init__``, so importing this module (or ``rlbus --help``) never needs it.

How the ``Backend`` contract maps onto vLLM:

- batching: vLLM's async engine batches continuously on its own; ``generate`` submits
  every request to it at once and awaits each final output. There is no window and no
  batch lock here;
- sampling: ``SamplingParams(temperature, top_p, top_k, seed=request.seed, logprobs=0)``
  with the engine started with ``logprobs_mode="processed_logprobs"`` (vLLM >= 0.10.2),
  so the logprob of a sampled token is taken after temperature/top-k/top-p, like the
  torch backend's; greedy requests report the unscaled log-softmax;
- weights: the bytes are verified against the digest (a LoRA run's adapters merged
  into the base layers read from the model directory: ``weights.merged_with``), written as a safetensors file
  under ``weights_dir``, checked finite tensor by tensor from that file
  (``backend.check_finite``: a NaN or an inf refuses them before the engine is paused),
  and loaded by every vLLM worker through ``collective_rpc``
  into ``model_runner.model.load_weights`` (``WeightLoaderExtension`` below is mixed
  into vLLM's worker via ``worker_extension_cls``); the prefix cache is reset after,
  since cached KV from old weights is wrong. To keep "never mid-batch" for an engine
  without batches, admission pauses and in-flight requests drain before the swap, so
  every answer comes from one weights version;
- memory and dtype: ``gpu_memory_utilization`` (the share of the GPU the engine may
  take) is ``inference.gpu_memory_fraction``, so a trainer fits beside it; the dtype is
  ``backend.serving_dtype`` (bfloat16 unless ``model.dtype`` is float16);
- score: ``prompt_logprobs=0`` with one generated token. vLLM computes prompt logprobs
  from raw logits, so only temperature 1 (or 0, which means 1) is served here.

Not exercised on CPU machines: ``tests/gpu/test_vllm_backend.py`` compares it with the
torch backend where vLLM and CUDA exist.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from roles.inference.backend import admit_generate, admit_score, check_finite
from roles.lib.model.weights import (
    adapter_scale,
    merged_with,
    tensors_to_bytes,
    verified,
    write_atomic,
)
from schemas import (
    GenerateRequest,
    GenerateResult,
    InferenceFailed,
    ObjectRef,
    ScoreRequest,
    ScoreResult,
)
from schemas.arrays import pack_f32, pack_i32

VLLM_MISSING = (
    "inference.backend = 'vllm' needs vLLM, which is an optional extra: install it with "
    "`pip install 'rlbus[vllm]'` (and run on a CUDA GPU), or set inference.backend = 'torch'"
)


class WeightLoaderExtension:
    """Mixed into each vLLM GPU worker (``worker_extension_cls``); runs inside the worker."""

    model_runner: Any  # provided by the vLLM worker this class is mixed into

    def rlbus_load_weights(self, path: str) -> None:
        from safetensors.torch import load_file

        state = load_file(path, device="cpu")
        # vLLM's model classes map HF names (and skip a tied lm_head) in load_weights.
        self.model_runner.model.load_weights(weights=state.items())


class _SwapGate:
    """Many requests in flight, or one weights swap alone: a tiny reader/writer lock."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._active = 0
        self._swapping = False

    @contextlib.asynccontextmanager
    async def request(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            self._active += 1
        try:
            yield
        finally:
            async with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def swap(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._swapping)
            self._swapping = True  # new requests wait from here on
            await self._cond.wait_for(lambda: self._active == 0)
        try:
            yield
        finally:
            async with self._cond:
                self._swapping = False
                self._cond.notify_all()


class VllmBackend:
    """``Backend`` on vLLM's async engine (one GPU; tensor parallel via ``engine_kwargs``)."""

    name = "vllm"

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "auto",
        max_model_len: int | None = None,
        weights_dir: str | Path | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seed: int = 0,
        gpu_memory_utilization: float = 0.85,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        try:
            import vllm  # noqa: F401 - fail here, with the fix in the message
        except ImportError as e:
            raise ImportError(VLLM_MISSING) from e
        from vllm import AsyncEngineArgs, AsyncLLMEngine

        from roles.inference.torch_setup import default_stop_ids
        from roles.lib.model.loading import load_tokenizer

        tokenizer = load_tokenizer(model_path)
        self._stop = frozenset(
            int(t)
            for t in (stop_token_ids if stop_token_ids is not None else default_stop_ids(tokenizer))
        )
        self._vocab_size = len(tokenizer)
        args = AsyncEngineArgs(
            model=str(model_path),
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=f"{__name__}.WeightLoaderExtension",
            **(engine_kwargs or {}),
        )
        self._engine = AsyncLLMEngine.from_engine_args(args)
        self._max_model_len = int(self._engine.model_config.max_model_len)
        self._vocab_size = max(self._vocab_size, int(self._engine.model_config.get_vocab_size()))
        self._model_path = Path(model_path)  # the base a LoRA run's adapters merge into
        self._weights_dir = Path(weights_dir or tempfile.mkdtemp(prefix="rlbus-vllm-weights-"))
        self._weights_dir.mkdir(parents=True, exist_ok=True)
        self._gate = _SwapGate()
        self._version = 0
        self._stats = {"generate_requests": 0.0, "score_requests": 0.0, "failed_requests": 0.0,
                       "prompt_tokens": 0.0, "completion_tokens": 0.0, "scored_tokens": 0.0}  # fmt: skip

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    # -- generate -----------------------------------------------------------------------

    async def generate(self, reqs: list[GenerateRequest]) -> list[GenerateResult | InferenceFailed]:
        return list(await asyncio.gather(*(self._generate_one(r) for r in reqs)))

    async def _generate_one(self, req: GenerateRequest) -> GenerateResult | InferenceFailed:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        admitted = admit_generate(
            req, vocab_size=self._vocab_size, max_model_len=self._max_model_len
        )
        if isinstance(admitted, InferenceFailed):
            self._stats["failed_requests"] += 1
            return admitted
        prompt, budget = admitted
        loop = asyncio.get_running_loop()
        queued = loop.time()
        if budget == 0:
            return self._result(req, prompt, [], [], "length", self._version, 0.0, 0.0)
        s = req.sampling
        params = SamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1,
            max_tokens=budget,
            seed=req.seed if s.temperature > 0 else None,
            stop_token_ids=sorted(self._stop | frozenset(req.stop_token_ids)),
            stop=list(s.stop) or None,
            include_stop_str_in_output=True,
            logprobs=0,
            detokenize=bool(s.stop),  # stop strings are matched on text
            skip_special_tokens=False,
        )
        async with self._gate.request():
            version = self._version
            started = loop.time()
            final = None
            async for out in self._engine.generate(
                TokensPrompt(prompt_token_ids=prompt), params, request_id=self._rid(req.request_id)
            ):
                final = out
        if final is None:
            raise RuntimeError(f"vLLM returned no output for {req.request_id}")
        comp = final.outputs[0]
        ids = [int(t) for t in comp.token_ids]
        lps = [float(comp.logprobs[i][t].logprob) for i, t in enumerate(ids)]
        finish = "stop" if comp.finish_reason == "stop" else "length"
        return self._result(
            req, prompt, ids, lps, finish, version, started - queued, loop.time() - started
        )

    def _result(
        self, req: GenerateRequest, prompt: list[int], ids: list[int], lps: list[float],
        finish: str, version: int, queue_s: float, compute_s: float,
    ) -> GenerateResult:  # fmt: skip
        self._stats["generate_requests"] += 1
        self._stats["prompt_tokens"] += len(prompt)
        self._stats["completion_tokens"] += len(ids)
        return GenerateResult(
            request_id=req.request_id,
            completion_ids=pack_i32(ids),
            logprobs=pack_f32(lps),
            finish_reason=finish,
            policy_version=version,
            prompt_tokens=len(prompt),
            queue_s=queue_s,
            compute_s=compute_s,
        )

    # -- score --------------------------------------------------------------------------

    async def score(self, reqs: list[ScoreRequest]) -> list[ScoreResult | InferenceFailed]:
        return list(await asyncio.gather(*(self._score_one(r) for r in reqs)))

    async def _score_one(self, req: ScoreRequest) -> ScoreResult | InferenceFailed:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = admit_score(req, vocab_size=self._vocab_size, max_model_len=self._max_model_len)
        if isinstance(ids, InferenceFailed):
            self._stats["failed_requests"] += 1
            return ids
        if req.temperature not in (0.0, 1.0):
            self._stats["failed_requests"] += 1
            return InferenceFailed(
                request_id=req.request_id,
                kind="bad_request",
                message="the vllm backend scores at temperature 1 only (prompt logprobs are raw)",
            )
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        async with self._gate.request():
            version = self._version
            final = None
            async for out in self._engine.generate(
                TokensPrompt(prompt_token_ids=ids), params, request_id=self._rid(req.request_id)
            ):
                final = out
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError(f"vLLM returned no prompt logprobs for {req.request_id}")
        lps = [float(final.prompt_logprobs[j][ids[j]].logprob) for j in range(req.start, len(ids))]
        self._stats["score_requests"] += 1
        self._stats["scored_tokens"] += len(lps)
        return ScoreResult(
            request_id=req.request_id, logprobs=pack_f32(lps), policy_version=version
        )

    @staticmethod
    def _rid(request_id: str) -> str:
        # vLLM requires unique ids among live requests; ours may repeat across retries.
        return f"{request_id}-{uuid.uuid4().hex[:8]}"

    # -- weights ------------------------------------------------------------------------

    async def load_weights(self, data: bytes, digest: str, version: int) -> float:
        data = verified(data, digest)
        if adapter_scale(data) is not None:  # LoRA: the adapted layers merged on the host
            merged = await asyncio.to_thread(merged_with, self._model_path, data, whole=False)
            data = tensors_to_bytes(merged)
        path = self._weights_dir / f"policy-v{version}.safetensors"
        await asyncio.to_thread(write_atomic, path, data)
        try:
            await asyncio.to_thread(_check_finite_file, path)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        async with self._gate.swap():  # no request in flight: none sees two versions
            start = time.perf_counter()
            await self._engine.collective_rpc("rlbus_load_weights", args=(str(path),))
            await self._engine.reset_prefix_cache()
            self._version = version
            paused = time.perf_counter() - start
        for old in self._weights_dir.glob("policy-v*.safetensors"):
            if old != path:
                old.unlink(missing_ok=True)
        return paused

    async def load_shared(self, ref: ObjectRef, version: int) -> float:
        raise NotImplementedError(
            "the vLLM backend loads weights from bytes only (trainer.weights_via = 'ipc' "
            "falls back to the stored versions)"
        )

    def stats(self) -> dict[str, float]:
        return dict(self._stats)

    async def close(self) -> None:
        shutdown = getattr(self._engine, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _check_finite_file(path: Path) -> None:
    """``check_finite`` over a safetensors file, one tensor in memory at a time (the
    file is memory-mapped: a large model is not held twice)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        check_finite((name, f.get_tensor(name)) for name in f.keys())
