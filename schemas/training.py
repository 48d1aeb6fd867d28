"""Training messages: scored samples, assembled batches, published weights.

A ``Sample`` is flat and aligned: ``token_ids``, ``mask`` (trainable positions),
``logprobs`` (inference logprobs), ``temperatures``, ``advantages`` and optional
``sft_mask`` all have one entry per token.
"""

from __future__ import annotations

import msgspec
import numpy as np

from schemas import arrays
from schemas.base import Event, Record
from schemas.run import ObjectRef


class Sample(Record, frozen=True):
    rollout_id: str
    branch: int
    env: str
    task_index: int
    group_id: str
    token_ids: bytes  # int32
    mask: bytes  # uint8: 1 = train on this token
    logprobs: bytes  # float32: inference logprob of each sampled token
    temperatures: bytes  # float32
    advantages: bytes  # float32
    sft_mask: bytes | None = None  # uint8: tokens trained by cross-entropy instead of RL
    reward: float = 0.0
    policy_min: int = 0
    policy_max: int = 0

    def __len__(self) -> int:
        return len(self.token_ids) // 4

    def arrays(self) -> dict[str, np.ndarray]:
        out = {
            "token_ids": arrays.i32(self.token_ids),
            "mask": arrays.mask(self.mask),
            "logprobs": arrays.f32(self.logprobs),
            "temperatures": arrays.f32(self.temperatures),
            "advantages": arrays.f32(self.advantages),
        }
        if self.sft_mask is not None:
            out["sft_mask"] = arrays.mask(self.sft_mask)
        return out


class SamplesScored(Event, frozen=True, tag="samples_scored/1"):
    """One complete group turned into trainable samples by one algorithm."""

    algorithm: str
    env: str
    group_id: str
    request_id: str  # the TaskRequested that started the group
    task_index: int
    step: int  # orchestrator step at dispatch
    samples: list[Sample]
    rewards: list[float] = msgspec.field(default_factory=list)  # of the non-errored rollouts
    excluded: int = 0  # errored rollouts left out of the baseline and of training
    zero_advantage: bool = False  # every advantage is zero: no learning signal


class BatchAssembled(Event, frozen=True, tag="batch_assembled/1"):
    """One training step's data. Large batches are offloaded by the bus transparently."""

    step: int
    samples: list[Sample]
    policy_version: int  # newest weights version when assembled
    sources: list[str] = msgspec.field(default_factory=list)  # SamplesScored event ids
    num_tokens: int = 0
    dropped_stale: int = 0  # samples dropped since the last batch for max_off_policy_steps
    skipped_zero_advantage: int = 0  # groups skipped since the last batch
    phase: str = "rl"  # "sft" (warm start) | "rl"


class WeightsPublished(Event, frozen=True, tag="weights_published/1"):
    version: int  # policy version == trainer step that produced it
    step: int
    weights: ObjectRef
    format: str = "safetensors"
    batch_id: str | None = None  # the BatchAssembled event it was trained on
