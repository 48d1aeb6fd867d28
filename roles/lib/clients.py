"""The inference client: generate and score through the bus (core request/reply).

Env servers and algorithm workers use it; the inference role answers. It is a library,
not a role, so roles do not import each other.

A request is retried, not just waited on: each attempt waits at most
``attempt_timeout_s``, and a timeout or "no responders" sends it again (same
``request_id``) until ``timeout_s`` is spent in all. The queue group hands each attempt
to a live replica. With ``silence_s`` (``inference.silence_s``), the replica that takes
an attempt sends signs of life while it works on it (``bus.rpc``), and an attempt whose
replica falls silent that long is sent again at once: a replica that died holding a
request (or a server restart that lost it) costs ``silence_s``, not the attempt's
timeout. Inference dedups nothing: a slow replica may still answer an earlier attempt,
which is harmless, the reply goes to that attempt's own inbox.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from bus.errors import NoResponders, RequestTimeout
from bus.runtime import Bus
from bus.subjects import infer_replica_subject, infer_subject
from configs import InferenceConfig
from schemas import (
    GenerateRequest,
    GenerateResult,
    InferenceFailed,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
)
from schemas.arrays import pack_i32

_BACKOFF_S = (0.1, 0.2, 0.3, 0.5)  # before retrying "no responders" (a replica starting)


class InferenceClient:
    def __init__(
        self, bus: Bus, timeout_s: float = 60.0, attempt_timeout_s: float = 20.0,
        silence_s: float | None = None,
    ) -> None:  # fmt: skip
        self.bus = bus
        self.timeout_s = timeout_s
        self.attempt_timeout_s = attempt_timeout_s
        self.silence_s = silence_s

    @classmethod
    def from_config(cls, bus: Bus, inference: InferenceConfig) -> InferenceClient:
        """The client every role asks inference with: the run's ``[inference]`` limits."""
        return cls(bus, inference.request_timeout_s, inference.attempt_timeout_s,
                   inference.silence_s)  # fmt: skip

    async def generate(
        self,
        model: str,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        stop_token_ids: Sequence[int] = (),
        seed: int = 0,
        env: str | None = None,
        pin_version: int | None = None,
        replica: str | None = None,
    ) -> GenerateResult | InferenceFailed:
        """Raises ``bus.errors.RequestTimeout`` when no replica answers in time.

        ``pin_version``: the policy version an eval asks at; a policy replica serving it
        keeps those weights until the pinned requests are done (``GenerateRequest``).
        ``replica``: ask that instance first (its own subject: a session's cached
        prefix lives there); if it does not answer, any replica of the model."""
        req = GenerateRequest(
            request_id=request_id,
            prompt_ids=pack_i32(prompt_ids),
            sampling=sampling,
            stop_token_ids=list(stop_token_ids),
            seed=seed,
            env=env,
            pin_version=pin_version,
        )
        reply: GenerateResult | InferenceFailed = await self._request(
            model, req, request_id, [GenerateResult, InferenceFailed], replica
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
        """Raises ``bus.errors.RequestTimeout`` when no replica answers in time."""
        req = ScoreRequest(
            request_id=request_id,
            token_ids=pack_i32(token_ids),
            start=start,
            temperature=temperature,
        )
        reply: ScoreResult | InferenceFailed = await self._request(
            model, req, request_id, [ScoreResult, InferenceFailed]
        )
        return reply

    async def _request(
        self,
        model: str,
        req: msgspec.Struct,
        request_id: str,
        reply_types: list[type],
        replica: str | None = None,
    ) -> Any:
        """``req`` answered by a replica, retried until ``timeout_s`` is spent; raises the
        last ``RequestTimeout`` (``NoResponders`` if nobody was subscribed) after that.
        The first attempt goes to ``replica``'s own subject when given; a retry, to the
        model's queue group."""
        group = infer_subject(self.bus.run, model)
        subject = infer_replica_subject(self.bus.run, model, replica) if replica else group
        deadline = time.monotonic() + self.timeout_s
        attempt = 0
        while True:
            attempt += 1
            wait_s = min(self.attempt_timeout_s, deadline - time.monotonic())
            try:
                return await self.bus.request(subject, req, reply_types, wait_s, self.silence_s)
            except RequestTimeout as e:  # NoResponders included
                if subject != group:  # the replica is gone (or slow): any replica will do
                    subject = group
                    continue
                pause = _BACKOFF_S[min(attempt, len(_BACKOFF_S)) - 1]
                left = deadline - time.monotonic()
                if left <= (pause if isinstance(e, NoResponders) else 0.0):
                    raise type(e)(
                        f"no reply on {subject} within {self.timeout_s:g} s "
                        f"({attempt} attempt(s); last: {e})"
                    ) from e
                # A replica lost is news; nobody subscribed yet is what a start looks like.
                quiet = isinstance(e, NoResponders)
                log = self.bus.log.debug if quiet else self.bus.log.warning
                log("inference.retry", request=request_id, model=model, attempt=attempt,
                    error=repr(e))  # fmt: skip
                if quiet:
                    await asyncio.sleep(pause)
