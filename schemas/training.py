"""Training messages: scored samples, assembled batches, published weights.

A ``Sample`` is flat and aligned: every array has one entry per token. It carries up
to three loss channels (``docs/algorithms.md``):

- ``rl``: ``mask`` (the positions) and ``advantages`` (per-token A), trained by the
  importance-weighted policy gradient against ``logprobs`` (the inference logprobs);
- ``ce``: ``sft_mask`` (the positions) and ``ce_weights`` (per-token weight, 1 where
  absent), trained by weighted cross-entropy;
- ``ref_kl``: ``ref_weights`` (per-token coefficient; > 0 = in the channel) and
  ``ref_logprobs`` (a reference model's logprob of each token), pulling the policy
  toward the reference.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import msgspec
import numpy as np

from schemas import arrays
from schemas.base import (
    LOGPROB_MAX,
    VALUE_BOUND,
    Bounded,
    Event,
    NonNegative,
    Positive,
    Record,
    derive_id,
)
from schemas.run import ObjectRef

# A sample's arrays held to +-VALUE_BOUND (the loss weights ce_weights and ref_weights
# only to finite values: a weight that overflows the loss makes a non-finite step, which
# the trainer drops whole).
BOUNDED = ("advantages", "logprobs", "ref_logprobs", "temperatures")


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
    sft_mask: bytes | None = None  # uint8: the ce channel's positions
    reward: Bounded = 0.0
    policy_min: NonNegative = 0
    policy_max: NonNegative = 0
    ce_weights: bytes | None = None  # float32: ce weight per token (None = 1 on sft_mask)
    ref_logprobs: bytes | None = None  # float32: the reference's logprob of each token
    ref_weights: bytes | None = None  # float32: ref_kl coefficient per token (0 = not in it)
    member: str | None = None  # multi-agent: the member whose tokens this branch trains
    # False: a frozen model wrote every token (``Trace.from_policy``); never stale.
    from_policy: bool = True
    algorithms: list[str] = msgspec.field(default_factory=list)  # ids whose channels it carries

    def __len__(self) -> int:
        return len(self.token_ids) // 4

    def problem(self) -> str | None:
        """Why this sample cannot be trained (misaligned arrays, a non-finite value, an
        advantage, log-probability or temperature beyond ``VALUE_BOUND``, a
        log-probability above 0, a token id below 0), or None: what every reader of
        samples checks first."""
        n = len(self.token_ids) // 4
        if len(self.token_ids) % 4:
            return "token_ids is not a whole number of int32"
        try:
            arrays_ = self.arrays()
        except ValueError as e:  # a float32 buffer whose size is not a multiple of 4
            return f"unreadable array: {e}"
        for name, values in arrays_.items():
            if len(values) != n:
                return f"{name} has {len(values)} values for {n} tokens"
            if values.dtype.kind != "f" or not len(values):
                continue
            if not np.isfinite(values).all():
                return f"{name} holds a non-finite value"
            if name in BOUNDED and float(np.abs(values).max()) > VALUE_BOUND:
                return f"{name} holds a value beyond +-{VALUE_BOUND:g}"
            if name in ("logprobs", "ref_logprobs") and float(values.max()) > LOGPROB_MAX:
                return f"{name} holds a log-probability above 0 ({float(values.max()):g})"
        if n and int(arrays_["token_ids"].min()) < 0:
            return "a negative token id"
        if not math.isfinite(self.reward) or abs(self.reward) > VALUE_BOUND:
            return f"reward is not finite or beyond +-{VALUE_BOUND:g}"
        return None

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
        for name in ("ce_weights", "ref_logprobs", "ref_weights"):
            value = getattr(self, name)
            if value is not None:
                out[name] = arrays.f32(value)
        return out


class SamplesScored(Event, frozen=True, tag="samples_scored/1"):
    """One complete group turned into trainable samples by one algorithm."""

    algorithm: str
    env: str
    group_id: str
    request_id: str  # the TaskRequested that started the group
    task_index: int
    step: NonNegative  # orchestrator step at dispatch
    samples: list[Sample]
    rewards: list[Bounded] = msgspec.field(default_factory=list)  # of the non-errored rollouts
    excluded: NonNegative = 0  # errored rollouts left out of the baseline and of training
    # The members whose branches those errored rollouts would have trained, in group
    # order (what ``rae`` updates its baselines with at reward 0).
    excluded_members: list[str] = msgspec.field(default_factory=list)
    # Why they errored: each distinct first error, ``<kind>: <its message's first line>``
    # (cut to 200 characters), with how many of the group's rollouts had it; what the
    # orchestrator's error stop names (``orchestrator.error_stop_s``).
    excluded_errors: dict[str, NonNegative] = msgspec.field(default_factory=dict)
    # Rollouts an enforcing filter flagged (``Trace.is_filtered``): their rewards are in
    # ``rewards`` and the baseline, their samples are not here.
    filtered: NonNegative = 0
    # Which enforcing filters flagged them: filter name -> rollouts (a rollout flagged by
    # two counts for both); what the orchestrator's filter stop names.
    filtered_by: dict[str, NonNegative] = msgspec.field(default_factory=dict)
    zero_advantage: bool = False  # no channel has a non-zero weight: no learning signal
    # Why this algorithm could not score the group (its scoring raised, it made a sample
    # that cannot be trained, or the orchestrator gave up waiting: "deadline ..."); the
    # group is then released, not trained. Empty for a scored group.
    failed: str = ""


def batch_id(run: str, step: int) -> str:
    """The id of the orchestrator's batch for ``step``: the trainer, its catch-up and
    trainer replay take a ``batch.assembled`` only with this id (any other is not the
    orchestrator's, whatever it says)."""
    return derive_id(run, "batch", step)


class BatchAssembled(Event, frozen=True, tag="batch_assembled/1"):
    """One training step's data. Large batches are offloaded by the bus transparently."""

    step: Positive
    samples: list[Sample]
    policy_version: NonNegative  # newest weights version when assembled
    sources: list[str] = msgspec.field(default_factory=list)  # SamplesScored event ids
    num_tokens: NonNegative = 0
    dropped_stale: NonNegative = 0  # samples dropped since the last batch for max_off_policy_steps
    skipped_zero_advantage: NonNegative = 0  # groups skipped since the last batch
    phase: Literal["sft", "rl"] = "rl"  # "sft" (warm start) | "rl"


# ObjectRef kinds of weights that travel device to device, never stored as bytes.
IPC_KIND = "ipc"  # a slot of the trainer's shared ring (roles.lib.model.shared_weights)
BROADCAST_KIND = "broadcast"  # a rendezvous (roles.lib.model.broadcast)
DEVICE_KINDS = (IPC_KIND, BROADCAST_KIND)


class WeightsPublished(Event, frozen=True, tag="weights_published/1"):
    version: NonNegative  # policy version == trainer step that produced it
    step: NonNegative
    # Where the bytes are; or, for a version only shared on the device, ``device`` again.
    weights: ObjectRef
    format: str = "safetensors"
    batch_id: str | None = None  # the BatchAssembled event it was trained on
    # trainer.weights_via = "ipc" / "broadcast": the trainer's shared device buffer holding
    # this version (kind "ipc": copied from while the trainer keeps it, a few versions;
    # roles.lib.model.shared_weights), or its rendezvous (kind "broadcast": the version is
    # sent to every replica joined; roles.lib.model.broadcast); digest "dev:...".
    # ``weights`` is the fallback when this version is stored.
    device: ObjectRef | None = None

    def stored(self) -> ObjectRef | None:
        """Where this version's bytes are stored, or None (only sent device to device)."""
        return None if self.weights.kind in DEVICE_KINDS else self.weights


class WeightsStored(Event, frozen=True, tag="weights_stored/1"):
    """The bytes of a version announced only on the device, stored after its announcement.

    With ``trainer.weights_via = "ipc"`` / ``"broadcast"`` the trainer announces every
    version device to device at once and stores every ``trainer.store_weights_every``-th
    one while it trains the next step (``causation_id``: that version's
    ``weights.published``); readers that need bytes (a replica whose device copy is gone,
    one that restarts, an export) take them from here. ``weights.digest`` is of the bytes.
    """

    version: NonNegative
    step: NonNegative
    weights: ObjectRef
    format: str = "safetensors"
    batch_id: str | None = None


class AlgorithmAttached(Event, frozen=True, tag="algorithm_attached/1"):
    """A worker joined a live run (``rlbus algorithm attach``).

    Unless ``shadow``, it is a routing change: groups of ``envs`` (empty = every env)
    dispatched after this event wait for its samples and train on them. A shadow
    worker's samples go to the log and the lake only.
    """

    algorithm: str  # the worker's id (the samples.scored.<id> key)
    name: str  # registered algorithm name or import path
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    envs: list[str] = msgspec.field(default_factory=list)  # env keys; empty = every env
    shadow: bool = False
    from_seq: int = 1  # the first stream sequence whose traces it scores


class AlgorithmDetached(Event, frozen=True, tag="algorithm_detached/1"):
    """The worker's samples stop training (``rlbus algorithm detach``); it stops too."""

    algorithm: str
    reason: str = "user"
