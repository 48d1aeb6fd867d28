"""The inference client: generate and score through the bus (core request/reply).

Env servers and algorithm workers use it; the inference role answers. It is a library,
not a role, so roles do not import each other.
"""

from __future__ import annotations

from collections.abc import Sequence

from bus import rpc
from bus.runtime import Bus
from bus.subjects import infer_subject
from schemas import (
    GenerateRequest,
    GenerateResult,
    InferenceFailed,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
)
from schemas.arrays import pack_i32


class InferenceClient:
    def __init__(self, bus: Bus, timeout_s: float = 60.0):
        self.bus = bus
        self.timeout_s = timeout_s

    async def generate(
        self,
        model: str,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        stop_token_ids: Sequence[int] = (),
        seed: int = 0,
        env: str | None = None,
    ) -> GenerateResult | InferenceFailed:
        """Raises ``bus.errors.RequestTimeout`` when no replica answers in time."""
        req = GenerateRequest(
            request_id=request_id,
            prompt_ids=pack_i32(prompt_ids),
            sampling=sampling,
            stop_token_ids=list(stop_token_ids),
            seed=seed,
            env=env,
        )
        reply: GenerateResult | InferenceFailed = await rpc.request(
            self.bus.nc,
            infer_subject(self.bus.run, model),
            req,
            [GenerateResult, InferenceFailed],
            self.timeout_s,
        )
        return reply

    async def score(
        self,
        model: str,
        request_id: str,
        token_ids: Sequence[int],
        start: int = 1,
        temperature: float = 1.0,
    ) -> ScoreResult | InferenceFailed:
        req = ScoreRequest(
            request_id=request_id,
            token_ids=pack_i32(token_ids),
            start=start,
            temperature=temperature,
        )
        reply: ScoreResult | InferenceFailed = await rpc.request(
            self.bus.nc,
            infer_subject(self.bus.run, model),
            req,
            [ScoreResult, InferenceFailed],
            self.timeout_s,
        )
        return reply
