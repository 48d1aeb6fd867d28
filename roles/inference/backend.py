"""The contract every inference backend fits: generate, score, load weights, report version.

The inference role (``roles.inference.role``) only ever talks to a ``Backend``. Two
implementations exist:

- ``roles.inference.torch_backend.TorchBackend`` (default, CPU or one GPU): the torch
  engine (``roles.inference.engine``: a preallocated KV slot per row, one fixed decode
  step, a CUDA graph on the GPU) driven by a decode loop in a worker thread. Requests
  join the running loop between two steps as slots free up, and each row is answered
  when it ends; a weights swap lands between two steps while rows decode
  (``inference.swap``), or once the live rows have finished ("drain").
- ``roles.inference.vllm_backend.VllmBackend`` (``inference.backend = "vllm"``, needs
  the ``vllm`` extra and a GPU): vLLM does its own continuous batching, so ``generate``
  simply submits each request to the async engine. New weights are loaded through
  vLLM's worker RPC (``collective_rpc``) into the engine's model runner
  (``model_runner.model.load_weights(...)``) from a safetensors file written next to the
  run; admission is paused and in-flight requests drained first, so no request ever
  sees two weight versions ("between batches" for an engine that has no batches).

Rules every backend keeps:

- ``generate``/``score`` take a list and answer a list of the same length and order;
  a request that cannot be served gets an ``InferenceFailed`` in its slot (never an
  exception for one bad request): ``context_too_long`` when the prompt leaves no room
  for one completion token in ``max_model_len``, ``bad_request`` for invalid ids or
  sampling parameters;
- every result carries the ``policy_version`` of the weights that sampled its first
  token, and ``version_spans`` for later versions when a swap landed mid-completion;
- ``load_weights`` verifies ``digest`` before touching the model (a mismatch raises
  ``roles.lib.model.weights.WeightsDigestMismatch`` and the old weights keep serving),
  then that every tensor is finite (``check_finite``: a NaN or an infinity raises
  ``WeightsNotFinite`` naming the tensor, and the old weights keep serving), and sets
  ``policy_version = version`` atomically with the swap;
- logprobs are of the sampled token under the distribution actually sampled from
  (see ``roles.inference.sampling``), computed in float32;
- on CUDA the weights are served in ``serving_dtype`` (bfloat16 unless ``model.dtype``
  is float16), and the backend keeps to ``inference.gpu_memory_fraction`` of the GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from roles.inference.sampling import validate
from schemas import (
    GenerateRequest,
    GenerateResult,
    InferenceFailed,
    ObjectRef,
    ScoreRequest,
    ScoreResult,
    arrays,
)


@runtime_checkable
class Backend(Protocol):
    """What the inference role needs from an engine."""

    name: str

    @property
    def policy_version(self) -> int:
        """Version of the weights now serving (0 = the initial weights)."""
        ...

    @property
    def max_model_len(self) -> int:
        """Longest prompt + completion the model accepts, in tokens."""
        ...

    async def generate(self, reqs: list[GenerateRequest]) -> list[GenerateResult | InferenceFailed]:
        """Complete each prompt; answers in request order."""
        ...

    async def score(self, reqs: list[ScoreRequest]) -> list[ScoreResult | InferenceFailed]:
        """Logprobs of ``token_ids[start:]`` under the model (prefill only)."""
        ...

    async def load_weights(self, data: bytes, digest: str, version: int) -> float:
        """Verify ``data`` against ``digest``, then swap it in between two steps (the
        torch backend: rows in flight carry on, or finish first with ``inference.swap =
        "drain"``); the seconds generation paused for it."""
        ...

    async def load_shared(self, ref: ObjectRef, version: int) -> float:
        """The same from the trainer's shared device ring (``trainer.weights_via =
        "ipc"``: ``roles.lib.model.shared_weights``); NotImplementedError where the
        backend cannot (the role then loads the stored bytes)."""
        ...

    def stats(self) -> dict[str, float]:
        """Cumulative counters (requests, tokens, batches...) for metrics."""
        ...

    async def close(self) -> None:
        """Finish queued work and release the engine."""
        ...


# -- rules shared by every backend (pure) --------------------------------------------------


class WeightsNotFinite(ValueError):
    """Weights holding a NaN or an infinity: refused, never served. The digest says the
    bytes are what the trainer sent; this says what it sent cannot answer anything (every
    logprob would be NaN), so it is refused at once, never retried."""

    def __init__(self, tensor: str) -> None:
        super().__init__(f"weights tensor {tensor!r} holds a non-finite value (NaN or inf)")
        self.tensor = tensor


def check_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raise ``WeightsNotFinite`` for the first floating-point tensor with a NaN or an inf.

    One ``isfinite(t).all()`` per tensor: a single pass over the weights, cheap next to
    fetching them, and it keeps no copy, so it can run over tensors read one at a time.
    """
    for name, tensor in tensors:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise WeightsNotFinite(name)


# -- request checks shared by every backend (pure) ----------------------------------------


def _failed(req: GenerateRequest | ScoreRequest, kind: str, message: str) -> InferenceFailed:
    return InferenceFailed(request_id=req.request_id, kind=kind, message=message)


def _token_ids(buf: bytes, what: str, vocab_size: int) -> list[int] | str:
    if len(buf) % 4:
        return f"{what} is not int32 ({len(buf)} bytes)"
    ids = arrays.i32(buf).tolist()
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        return f"{what} has a token id outside [0, {vocab_size})"
    return ids


def admit_generate(
    req: GenerateRequest, *, vocab_size: int, max_model_len: int
) -> tuple[list[int], int] | InferenceFailed:
    """(prompt ids, completion budget) for a servable request, else why it is not.

    The budget is ``max_completion_tokens`` clamped so prompt + completion fits
    ``max_model_len``; a prompt that leaves no room for one token is ``context_too_long``.
    """
    prompt = _token_ids(req.prompt_ids, "prompt_ids", vocab_size)
    if isinstance(prompt, str):
        return _failed(req, "bad_request", prompt)
    if not prompt:
        return _failed(req, "bad_request", "empty prompt")
    s = req.sampling
    bad = validate(s.temperature, s.top_k, s.top_p)
    if bad is not None:
        return _failed(req, "bad_request", bad)
    if len(prompt) > max_model_len - 1:
        return _failed(
            req,
            "context_too_long",
            f"prompt has {len(prompt)} tokens; the model takes {max_model_len} in all, "
            "including at least one completion token",
        )
    return prompt, min(max(0, s.max_completion_tokens), max_model_len - len(prompt))


def admit_score(
    req: ScoreRequest, *, vocab_size: int, max_model_len: int
) -> list[int] | InferenceFailed:
    """The token ids of a servable score request, else why it is not."""
    ids = _token_ids(req.token_ids, "token_ids", vocab_size)
    if isinstance(ids, str):
        return _failed(req, "bad_request", ids)
    if not 1 <= req.start <= len(ids):
        return _failed(
            req,
            "bad_request",
            f"start must be in [1, {len(ids)}] for {len(ids)} tokens, got {req.start}",
        )
    if not req.temperature >= 0:
        return _failed(req, "bad_request", f"temperature must be >= 0, got {req.temperature}")
    if len(ids) > max_model_len:
        return _failed(
            req, "context_too_long", f"{len(ids)} tokens; the model takes at most {max_model_len}"
        )
    return ids


# -- metrics (pure) ------------------------------------------------------------------------


def throughput(prev: dict[str, float], cur: dict[str, float], dt: float) -> dict[str, float] | None:
    """Rates over one interval from two cumulative ``Backend.stats()``; None when idle."""

    def delta(key: str) -> float:
        return cur.get(key, 0.0) - prev.get(key, 0.0)

    requests = delta("generate_requests") + delta("score_requests")
    if requests <= 0 or dt <= 0:
        return None
    values = {
        "tokens_per_s": delta("completion_tokens") / dt,
        "prompt_tokens_per_s": delta("prompt_tokens") / dt,
        "requests_per_s": requests / dt,
        "failed_requests": delta("failed_requests"),
    }
    if (batches := delta("batches")) > 0:
        items = delta("batched_items")
        values["batch_size_mean"] = items / batches
        values["queue_s_mean"] = delta("queue_s") / max(items, 1.0)
        values["busy_frac"] = delta("busy_s") / dt
    return values
