"""What a task request asks, built one way for the orchestrator's dispatches and for
``rlbus rollout`` / ``rlbus eval`` (``roles.up.rollout``): its sampling parameters and
the seeds its rollouts sample with. ``rlbus eval`` of a checkpoint reproduces the run's
eval of that version because both take their seeds from here.

    sampling_params(cfg.orchestrator.train.sampling)      # SamplingParams for the request
    seed_root(cfg.seed, sampling)                         # the sampling table's seed, else the run's
    eval_seed(root, "reverse-text", 3)                    # task 3's eval seed
"""

from __future__ import annotations

from typing import Any

from schemas import SamplingParams, stable_seed


def sampling_params(s: Any) -> SamplingParams:
    """A config sampling table (``[orchestrator.train.sampling]``, an env's or eval's)
    as the request's ``SamplingParams``."""
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        max_completion_tokens=s.max_completion_tokens, stop=list(s.stop),
    )  # fmt: skip


def seed_root(run_seed: int, sampling: Any) -> int:
    """The root of rollouts' sampling seeds: the sampling table's ``seed``, else the run
    seed. Setting it redraws every sample on the same tasks (the run seed picks them)."""
    return run_seed if sampling.seed is None else sampling.seed


def eval_seed(root: int, env_id: str, index: int) -> int:
    """The sampling seed of eval task ``index`` of ``env_id``: the same in every eval
    round of a run and in ``rlbus eval`` of its checkpoints."""
    return stable_seed(root, "eval", env_id, index)
