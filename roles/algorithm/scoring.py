"""Fetching the logprobs a distillation algorithm asks for (``Algorithm.score_spec``).

    scorer = RefScorer(InferenceClient(bus), renderer, envs)
    refs = await scorer.refs(algorithm, "opd", traces)   # {(rollout, branch): logprobs}

For each branch the inference role's ``score`` request returns the model's logprob of
every token of the branch at temperature 1 (the first token, which nothing predicts,
gets 0). With ``hint``, the env's ``demonstration(task)`` messages are rendered and put
in front of the branch, and only the branch's logprobs are kept: what the model would
say about these tokens had it seen the demonstration first.

This is the worker's only I/O besides the bus; its answers are recorded in the samples
(``Sample.ref_logprobs``), so the trainer and any replay read them from the log.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np

from roles.algorithm.base import Algorithm, Refs
from roles.algorithm.samples import branch_views
from roles.lib.clients import InferenceClient
from roles.lib.envs.base import Environment
from schemas import InferenceFailed, Trace, arrays, derive_id


class ScoringFailed(RuntimeError):
    """The inference role refused a score request (the group is retried, then dead-lettered)."""


class RefScorer:
    def __init__(
        self,
        client: InferenceClient,
        renderer: Any,
        env_for: Callable[[str], Environment],
    ) -> None:
        self.client = client
        self.renderer = renderer
        self.env_for = env_for  # env key (Trace.env) -> its Environment

    def hint_ids(self, trace: Trace) -> list[int]:
        """The rendered demonstration of ``trace``'s task (empty when the env has none)."""
        messages = self.env_for(trace.env).demonstration(trace.task.data)
        return [t for m in messages or [] for t in self.renderer.message_tokens(m)]

    async def refs(self, algorithm: Algorithm, algorithm_id: str, traces: list[Trace]) -> Refs:
        jobs = []
        for trace in traces:
            spec = algorithm.score_spec(trace)
            if spec is None:
                continue
            prefix = self.hint_ids(trace) if spec.hint else []
            for view in branch_views(trace):
                jobs.append(
                    self._one(algorithm_id, spec.model, trace, view.index, view.token_ids, prefix)
                )
        return dict(await asyncio.gather(*jobs))

    async def _one(
        self,
        algorithm_id: str,
        model: str,
        trace: Trace,
        branch: int,
        ids: np.ndarray,
        prefix: list[int],
    ) -> tuple[tuple[str, int], np.ndarray]:
        start = max(1, len(prefix))
        reply = await self.client.score(
            model,
            derive_id("ref", algorithm_id, trace.rollout_id, branch),
            prefix + ids.tolist(),
            start=start,
        )
        if isinstance(reply, InferenceFailed):
            raise ScoringFailed(
                f"{model} could not score {trace.rollout_id}/{branch}: {reply.kind}: {reply.message}"
            )
        lps = arrays.f32(reply.logprobs)
        if not prefix:  # token 0 has no prediction; it is never trained
            lps = np.concatenate([np.zeros(1, arrays.F32), lps])
        if len(lps) != len(ids):
            raise ScoringFailed(f"{model} returned {len(lps)} logprobs for {len(ids)} tokens")
        return (trace.rollout_id, branch), lps
