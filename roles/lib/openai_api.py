"""The OpenAI API's wire format, and nothing else: requests in, response bodies out.

Pure (no bus, no HTTP server), shared by the two places that speak it: the gateway role
(``roles.gateway.role``, over HTTP) and a rollout's own endpoint for agent code
(``roles.lib.envs.agent``, in process). Each parses a body with ``parse_request``,
renders and generates, and answers with ``chat_response`` / ``completion_response``,
or an ``ApiError``'s ``body()``.

Beside them, vLLM's token-in/token-out ``POST /inference/v1/generate`` (``TokensRequest``
-> ``tokens_response``): the prompt as token ids, sampling in ``sampling_params``, the
completion's ids and logprobs back. It is what verifiers' training client and prime-rl
call: they render the conversation themselves (the ``renderers`` package) and must get
back exactly the tokens that were sampled.

Requests follow OpenAI's ``/v1/chat/completions`` and ``/v1/completions``: ``model``,
``messages`` (or ``prompt``: text or token ids), ``tools``, ``n``, ``temperature``,
``top_p``, ``max_tokens`` / ``max_completion_tokens``, ``stop``, ``seed``, ``logprobs``,
``top_logprobs`` (0 only: the engine returns the sampled token's logprob) and vLLM's
``top_k``. Unknown fields are accepted and ignored, as OpenAI-compatible servers do
(clients send ``user``, ``metadata``, ...); a field whose value the gateway cannot honour
(``stream``, ``top_logprobs`` > 0, a negative temperature) is a 400 naming it.

Responses carry, beside OpenAI's fields, what RL needs to train on exactly what was
sampled (the fields vLLM returns with ``return_token_ids``, which verifiers and prime-rl
read): ``prompt_token_ids`` on the response, ``token_ids`` on each choice, and on each
choice's ``logprobs.content`` one entry per completion token with its logprob; plus
``reasoning_content`` when the model's format has reasoning, and ``policy_version`` (the
weights that sampled it).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from roles.lib.model.render import Reply
from schemas import GenerateResult, InferenceFailed
from schemas.arrays import f32, i32


class ApiError(Exception):
    """An error as the OpenAI API writes it: an HTTP status and
    ``{"error": {"message", "type", "param", "code"}}``."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error",
             404: "invalid_request_error", 413: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "server_error",
             504: "timeout"}  # fmt: skip

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code}}  # fmt: skip


class _NoStream(BaseModel):
    model_config = ConfigDict(extra="allow")

    stream: bool = False

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool) -> bool:
        if v:
            raise ValueError("streaming is not supported; send stream=false")
        return v


class _Request(_NoStream):
    model: str
    n: int = Field(default=1, ge=1, le=128)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # vLLM's extension; 0 = off
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=0)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(_Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False

    @field_validator("messages")
    @classmethod
    def _roles(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for k, m in enumerate(v):
            if m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
                raise ValueError(f"messages[{k}].role must be system, user, assistant or tool")
            if not isinstance(m.get("content") or "", (str, list)):
                raise ValueError(f"messages[{k}].content must be a string or a list of parts")
        return v

    def budget(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(_Request):
    prompt: str | list[int] = Field(min_length=1)
    logprobs: int | None = Field(default=None, ge=0, le=0)
    echo: Literal[False] = False

    def budget(self, default: int) -> int:
        return self.max_tokens or default


class TokenSampling(BaseModel):
    """``sampling_params`` of a token-in request (vLLM's names; others are ignored)."""

    model_config = ConfigDict(extra="allow")

    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)  # -1 and 0 both mean off
    max_tokens: int | None = Field(default=None, ge=1)
    stop_token_ids: list[int] = Field(default_factory=list)
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1)


class TokensRequest(_NoStream):
    """vLLM's ``/inference/v1/generate``: sample a completion of ``token_ids``."""

    model: str
    token_ids: list[int] = Field(min_length=1)
    sampling_params: TokenSampling = Field(default_factory=TokenSampling)


def tokens_response(
    request_id: str, prompt_ids: Sequence[int], result: GenerateResult
) -> dict[str, Any]:
    """The ``/inference/v1/generate`` body: the completion's ids as sampled, one logprob
    per id (its ``token`` is ``token_id:<id>``, as vLLM writes it for this endpoint)."""
    ids, lps = i32(result.completion_ids).tolist(), f32(result.logprobs).tolist()
    content = [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip(ids, lps, strict=True)]
    return {
        "request_id": request_id,
        "prompt_token_ids": list(prompt_ids),
        "choices": [{"index": 0, "token_ids": ids, "logprobs": {"content": content},
                     "finish_reason": result.finish_reason,
                     "policy_version": result.policy_version}],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                  "total_tokens": len(prompt_ids) + len(ids)},
    }  # fmt: skip


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # OpenAI's code for a prompt too long


def failure_error(failed: InferenceFailed) -> ApiError:
    """Inference's refusal as the API says it: a prompt too long is OpenAI's
    ``context_length_exceeded``, a bad request a 400, anything else a 500."""
    if failed.kind == "context_too_long":
        return ApiError(400, failed.message, param="messages", code=CONTEXT_LENGTH_EXCEEDED)
    return ApiError(
        400 if failed.kind == "bad_request" else 500, f"{failed.kind}: {failed.message}"
    )


def parse_request(
    kind: type[ChatRequest] | type[CompletionRequest] | type[TokensRequest], raw: bytes
) -> Any:
    """The request in ``raw`` (JSON), else an ``ApiError`` 400 naming the field."""
    try:
        data = json.loads(raw or b"null")
    except ValueError as e:
        raise ApiError(400, f"body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "body must be a JSON object")
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        raise ApiError(400, f"{param}: {first['msg']}", param=param) from None


def chat_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the renderer takes them: text parts joined, ``developer`` as system,
    and each call's ``arguments`` as the JSON text OpenAI sends."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        msg = {**m, "role": "system" if m["role"] == "developer" else m["role"],
               "content": content or ""}  # fmt: skip
        out.append(msg)
    return out


def _token_logprobs(
    tokenizer: Any, ids: Sequence[int], lps: Sequence[float]
) -> list[dict[str, Any]]:
    out = []
    for t, lp in zip(ids, lps, strict=True):
        text = tokenizer.decode([t], skip_special_tokens=False)
        out.append({"token": text, "logprob": float(lp), "bytes": list(text.encode()),
                    "top_logprobs": []})  # fmt: skip
    return out


@dataclass(frozen=True)
class Choice:
    """One generated completion, read back."""

    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    reply: Reply
    policy_version: int


def _finish(choice: Choice) -> str:
    if choice.reply.calls and choice.finish_reason == "stop":
        return "tool_calls"
    return choice.finish_reason


def chat_response(
    request_id: str,
    model: str,
    prompt_ids: Sequence[int],
    choices: Sequence[Choice],
    tokenizer: Any,
    want_logprobs: bool,
) -> dict[str, Any]:
    """A ``chat.completion`` body, with token ids and per-token logprobs."""
    out = []
    for k, c in enumerate(choices):
        message: dict[str, Any] = {"role": "assistant", "content": c.reply.content}
        if c.reply.reasoning is not None:
            message["reasoning_content"] = c.reply.reasoning
        if c.reply.calls:
            message["tool_calls"] = [
                {"id": f"call_{request_id}_{k}_{j}", "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
                for j, call in enumerate(c.reply.calls)
            ]  # fmt: skip
        lp = {"content": _token_logprobs(tokenizer, c.completion_ids, c.logprobs)}
        out.append({"index": k, "message": message, "finish_reason": _finish(c),
                    "logprobs": lp if want_logprobs else None,
                    "token_ids": c.completion_ids, "policy_version": c.policy_version})  # fmt: skip
    return _envelope("chat.completion", request_id, model, prompt_ids, choices, out)


def completion_response(
    request_id: str,
    model: str,
    prompt_ids: Sequence[int],
    choices: Sequence[Choice],
    tokenizer: Any,
    want_logprobs: bool,
) -> dict[str, Any]:
    """A ``text_completion`` body, with token ids and per-token logprobs."""
    out = []
    for k, c in enumerate(choices):
        tokens = [tokenizer.decode([t], skip_special_tokens=False) for t in c.completion_ids]
        lp = {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": None,
              "text_offset": []}  # fmt: skip
        out.append({"index": k, "text": c.reply.text, "finish_reason": c.finish_reason,
                    "logprobs": lp if want_logprobs else None,
                    "token_ids": c.completion_ids, "policy_version": c.policy_version})  # fmt: skip
    return _envelope("text_completion", request_id, model, prompt_ids, choices, out)


def _envelope(
    kind: str,
    request_id: str,
    model: str,
    prompt_ids: Sequence[int],
    choices: Sequence[Choice],
    out: list[dict[str, Any]],
) -> dict[str, Any]:
    done = sum(len(c.completion_ids) for c in choices)
    return {
        "id": f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{request_id}",
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": out,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": done,
            "total_tokens": len(prompt_ids) + done,
        },  # fmt: skip
        "prompt_token_ids": list(prompt_ids),
    }


def models_response(models: Sequence[str], created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": m, "object": "model", "created": created,
                                        "owned_by": "rlbus"} for m in models]}  # fmt: skip
