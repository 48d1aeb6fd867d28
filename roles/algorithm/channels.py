"""The built-ins that go beyond one scalar per trace: echo, opd, opsd and rae.

- ``echo``: GRPO on the actor's tokens (``rl``) plus cross-entropy with weight
  ``alpha`` on what the environment said after the first sampled response (tool
  outputs, optionally user feedback), content tokens only (``ce``); ``tool_names``
  keeps the outputs of those tools only (a tool message's name, or its call's).
- ``opd``: on-policy distillation. A frozen reference model scores each branch; the
  ``ref_kl`` channel pulls the policy toward it on the actor's tokens.
- ``opsd``: on-policy self-distillation. The live policy scores each branch with the
  env's demonstration prepended as a hint; those hinted logprobs are the ``ref_kl``
  target (the policy learns to act as if it had seen the demonstration).
- ``rae``: role-conditioned advantages for multi-agent rollouts. An EMA baseline per
  (env, task, member); for each branch in arrival order, first b <- a*b + (1-a)*r,
  then A = r - b (b starts at 0); an errored rollout then updates its members'
  baselines with reward 0 (``errored_reward``, as SPIRAL's Alg. 1). The baseline is a
  fold over the worker's own ``SamplesScored``, so it survives restarts and replays
  exactly.

Formulas, channels and configs: ``docs/algorithms.md``.
"""

from __future__ import annotations

from typing import Any

from configs.orchestrator import POLICY
from roles.algorithm.base import Algorithm, BranchView, Refs, ScoreSpec, Targets
from roles.algorithm.builtin import GRPO
from roles.algorithm.samples import env_token_masks
from schemas import SamplesScored, Trace


class Echo(GRPO):
    """GRPO on actions + ``alpha`` x cross-entropy on environment-provided content tokens."""

    name = "echo"
    channels = ("rl", "ce")

    def __init__(
        self,
        alpha: float = 0.1,
        include_user: bool = False,
        tool_names: list[str] | None = None,
        std_normalize: bool = False,
    ) -> None:
        super().__init__(std_normalize=std_normalize)
        if alpha < 0:
            raise ValueError(f"echo: alpha must be >= 0, got {alpha}")
        self.alpha = float(alpha)
        self.roles = ("tool", "user") if include_user else ("tool",)
        self.tool_names = None if tool_names is None else tuple(tool_names)

    def targets(
        self, group: list[Trace], views: list[list[BranchView]], state: Any, refs: Refs
    ) -> list[list[Targets]]:
        out = super().targets(group, views, state, refs)
        for trace, trace_targets in zip(group, out, strict=True):
            masks = env_token_masks(trace, self.roles, self.tool_names)
            for t, mask in zip(trace_targets, masks, strict=True):
                t.ce = mask * self.alpha
        return out


def _ref_targets(
    algorithm: str, views: list[list[BranchView]], refs: Refs, beta: float
) -> list[list[Targets]]:
    out = []
    for trace_views in views:
        row = []
        for v in trace_views:
            key = (v.trace.rollout_id, v.index)
            if key not in refs:
                raise ValueError(f"{algorithm}: no reference logprobs for branch {key}")
            row.append(Targets(ref_weights=beta, ref_logprobs=refs[key]))
        out.append(row)
    return out


class OPD(Algorithm):
    """On-policy distillation toward the frozen model ``orchestrator.models.<reference>``."""

    name = "opd"
    handles_members = True  # per-branch targets
    channels = ("ref_kl",)

    def __init__(self, reference: str = "reference", beta: float = 1.0) -> None:
        super().__init__()
        if beta <= 0:
            raise ValueError(f"opd: beta must be > 0, got {beta}")
        self.reference, self.beta = reference, float(beta)

    def models(self) -> list[str]:
        return [self.reference]

    def score_spec(self, trace: Trace) -> ScoreSpec:
        return ScoreSpec(model=self.reference)

    def targets(
        self, group: list[Trace], views: list[list[BranchView]], state: Any, refs: Refs
    ) -> list[list[Targets]]:
        return _ref_targets(self.name, views, refs, self.beta)


class OPSD(Algorithm):
    """Self-distillation: the policy with the env's demonstration prepended is the target."""

    name = "opsd"
    handles_members = True  # per-branch targets
    channels = ("ref_kl",)
    needs_demonstration = True

    def __init__(self, beta: float = 1.0, model: str = POLICY) -> None:
        super().__init__()
        if beta <= 0:
            raise ValueError(f"opsd: beta must be > 0, got {beta}")
        self.beta, self.model = float(beta), model

    def score_spec(self, trace: Trace) -> ScoreSpec:
        return ScoreSpec(model=self.model, hint=True)

    def targets(
        self, group: list[Trace], views: list[list[BranchView]], state: Any, refs: Refs
    ) -> list[list[Targets]]:
        return _ref_targets(self.name, views, refs, self.beta)


Key = tuple[str, int, str | None]  # (env, task index or ANY_TASK, member)
ANY_TASK = -1  # the task slot of the key with per_task = false: one baseline per (env, member)


class RAE(Algorithm):
    """Role-conditioned advantages: an EMA baseline per (env, task, member), or per (env,
    member) with ``per_task = false`` (SPIRAL's per-(game, role) baseline)."""

    name = "rae"
    stateful = True
    needs_members = True
    handles_members = True

    def __init__(
        self, alpha: float = 0.9, errored_reward: float | None = 0.0, per_task: bool = True
    ) -> None:
        super().__init__()
        if not 0.0 <= alpha < 1.0:
            raise ValueError(f"rae: alpha must be in [0, 1), got {alpha}")
        self.alpha = float(alpha)
        # What an errored rollout updates its members' baselines with (SPIRAL Alg. 1:
        # 0, an invalid game scores nothing); None leaves errored rollouts out.
        self.errored_reward = None if errored_reward is None else float(errored_reward)
        self.per_task = bool(per_task)

    def key(self, env: str, task_index: int, member: str | None) -> Key:
        return (env, task_index if self.per_task else ANY_TASK, member)

    def initial_state(self) -> dict[Key, float]:
        return {}

    def _update(self, baselines: dict[Key, float], key: Key, reward: float) -> float:
        b = self.alpha * baselines.get(key, 0.0) + (1.0 - self.alpha) * reward
        baselines[key] = b
        return reward - b

    def targets(
        self, group: list[Trace], views: list[list[BranchView]], state: Any, refs: Refs
    ) -> list[list[Targets]]:
        baselines = dict(state or {})  # the published state moves only in ``fold``
        return [
            [
                Targets(
                    advantages=self._update(
                        baselines, self.key(t.env, t.task.index, v.member), v.reward
                    )
                )
                for v in trace_views
            ]
            for t, trace_views in zip(group, views, strict=True)
        ]

    def fold(self, state: Any, scored: SamplesScored) -> dict[Key, float]:
        # The samples are in the order ``targets`` visited the branches, and each carries
        # its branch's reward: replaying the updates reproduces the baselines exactly.
        baselines = dict(state or {})
        for s in scored.samples:
            self._update(baselines, self.key(s.env, s.task_index, s.member), s.reward)
        if self.errored_reward is not None:  # after the group's own: targets never see them
            for member in scored.excluded_members:
                key = self.key(scored.env, scored.task_index, member)
                self._update(baselines, key, self.errored_reward)
        return baselines
