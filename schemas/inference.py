"""Inference request/reply messages (core NATS, not stored: each trace records what came back)."""

from __future__ import annotations

import msgspec

from schemas.base import Record
from schemas.rollout import SamplingParams


class GenerateRequest(Record, frozen=True, tag="generate/1", tag_field="type"):
    request_id: str
    prompt_ids: bytes  # int32
    sampling: SamplingParams = SamplingParams()
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    seed: int = 0
    env: str | None = None  # which env asks (lets a scripted teacher pick its solver)
    # An eval's policy version: the policy's replicas hold back a weights swap while
    # requests pinned to the version they serve run (bounded: `inference.eval_pin_*`),
    # and briefly wait for it when it is newer. The reply's policy_version says what ran.
    pin_version: int | None = None


class ScoreRequest(Record, frozen=True, tag="score/1", tag_field="type"):
    """Per-token logprobs of given token ids (prefill only): reference models, distillation."""

    request_id: str
    token_ids: bytes  # int32
    start: int = 1  # return logprobs of token_ids[start:]
    temperature: float = 1.0


class GenerateResult(Record, frozen=True, tag="generated/1", tag_field="type"):
    request_id: str
    completion_ids: bytes  # int32
    logprobs: bytes  # float32, one per completion token, under the distribution sampled from
    finish_reason: str  # "stop" | "length"
    policy_version: int
    prompt_tokens: int = 0
    queue_s: float = 0.0  # time waiting for a batch slot
    compute_s: float = 0.0  # time in the forward passes of its batch
    # A weights swap landed while it decoded (inference.swap = "in_flight"): from which
    # completion token on each later version sampled, as (token index, version), oldest
    # first. Empty: ``policy_version`` sampled every token.
    version_spans: list[tuple[int, int]] = msgspec.field(default_factory=list)

    def versions(self) -> list[int]:
        """Every weights version that sampled a token of it, oldest first."""
        return [self.policy_version, *(v for _, v in self.version_spans)]


class ScoreResult(Record, frozen=True, tag="scored/1", tag_field="type"):
    request_id: str
    logprobs: bytes  # float32, len(token_ids) - start
    policy_version: int


class InferenceFailed(Record, frozen=True, tag="inference_failed/1", tag_field="type"):
    request_id: str
    kind: str  # "context_too_long" | "bad_request" | "internal"
    message: str


InferenceRequest = GenerateRequest | ScoreRequest
InferenceReply = GenerateResult | ScoreResult | InferenceFailed
