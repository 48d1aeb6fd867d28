"""The algorithm worker's pure core: one trace in, at most one scored group out.

    core = ScoringCore.for_run(cfg, "grpo")             # or with the worker's attach event
    scored = await core.step(event, refs_for)           # route, buffer, score (or None)
    ...publish scored...
    core.done(scored)                                   # mark scored, fold the state

One object holds everything that decides a worker's output: which envs it scores
(routing), the traces of groups not complete yet (``GroupBuffer``), the algorithm, the
env's tool-output SFT rule and the algorithm's state (a fold over its own output). The
worker (``roles.algorithm.role``) drives it live and while catching up on the log;
algorithm replay (``replay.algorithm``) drives it over the recorded traces. Both take
the same steps in the same order, so replay is the worker, bit for bit, by construction.

The only input that is not in the trace is a distillation algorithm's reference
logprobs: ``refs_for(group)`` asks the inference role in the worker and returns the
recorded ones in replay. ``done`` runs after the result is stored: a failed publish
leaves the group unscored, and its redelivered trace completes it again. A group the
algorithm cannot score (it raises, or makes a sample ``Sample.problem`` refuses) gets a
``failed`` answer instead, so the orchestrator releases it rather than wait forever.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from configs import RunConfig
from roles.algorithm.base import Algorithm, Refs
from roles.algorithm.registry import create
from roles.algorithm.samples import GroupBuffer, ToolSft, score_group
from schemas import AlgorithmAttached, SamplesScored, TraceCompleted, derive_id

RefsFor = Callable[[list[TraceCompleted]], Awaitable[Refs | None]]


def tool_sft_rules(cfg: RunConfig) -> dict[str, ToolSft]:
    """Env key -> its tool-output SFT rule, for envs with ``sft.on_tool_outputs``."""
    return {
        e.key: ToolSft(e.sft.alpha, None if e.sft.tool_names is None else tuple(e.sft.tool_names))
        for e in cfg.orchestrator.train.env
        if e.sft.on_tool_outputs
    }


def attached_envs(event: AlgorithmAttached) -> set[str] | None:
    """Env keys a worker attached at runtime scores (None: every env; always for a shadow)."""
    return set(event.envs) if event.envs and not event.shadow else None


def failed(algorithm_id: str, group: list[TraceCompleted], reason: str) -> SamplesScored:
    """The group's answer when the algorithm cannot score it: no samples and why, so the
    orchestrator releases the group instead of waiting for it (same id as its scores
    would have had: scoring is a pure function of the group, a retry fails the same way)."""
    first = group[0]
    return SamplesScored(
        run=first.run, event_id=derive_id("scored", algorithm_id, first.trace.group_id),
        causation_id=first.request_id, algorithm=algorithm_id, env=first.env,
        group_id=first.trace.group_id, request_id=first.request_id,
        task_index=first.trace.task.index, step=first.step, samples=[], failed=reason[:2000],
    )  # fmt: skip


def needs_refs(algorithm: Algorithm) -> bool:
    """Whether the algorithm scores with a reference model (distillation)."""
    return type(algorithm).score_spec is not Algorithm.score_spec


@dataclass
class ScoringCore:
    algorithm_id: str
    algorithm: Algorithm
    envs: set[str] | None = None  # env keys whose groups it scores (None: every env)
    tool_sft: dict[str, ToolSft] = field(default_factory=dict)
    from_seq: int = 1  # the first stream sequence it scores (an attach point)
    buffer: GroupBuffer = field(default_factory=GroupBuffer)
    state: Any = None

    def __post_init__(self) -> None:
        if self.state is None:
            self.state = self.algorithm.initial_state()

    @classmethod
    def for_run(
        cls,
        cfg: RunConfig,
        algorithm_id: str,
        attached: AlgorithmAttached | None = None,
        options: dict[str, Any] | None = None,
    ) -> ScoringCore:
        """The core of ``algorithm_id`` in a run: as configured in
        ``orchestrator.algorithms``, or, for a worker attached at runtime (not in the
        config), as its ``algorithm.attached`` event says. ``options`` overrides the
        algorithm's options (a what-if replay)."""
        o = cfg.orchestrator
        if attached is not None and o.algorithm(algorithm_id) is None:
            return cls.attached(cfg, attached, options)
        name, spec_options = o.algorithm_spec(algorithm_id)
        algorithm = create(name, spec_options if options is None else options)
        return cls(algorithm_id, algorithm, o.routed_envs(algorithm_id), tool_sft_rules(cfg))

    @classmethod
    def attached(
        cls, cfg: RunConfig, event: AlgorithmAttached, options: dict[str, Any] | None = None
    ) -> ScoringCore:
        """The core of a worker attached at runtime, exactly as its attach event says."""
        algorithm = create(event.name, dict(event.options) if options is None else options)
        return cls(
            event.algorithm, algorithm, attached_envs(event), tool_sft_rules(cfg),
            max(1, event.from_seq),
        )  # fmt: skip

    @property
    def needs_refs(self) -> bool:
        return needs_refs(self.algorithm)

    def routes(self, event: TraceCompleted) -> bool:
        """Whether this trace's env is scored here (not routed: scoring would only cost)."""
        return self.envs is None or event.env in self.envs

    async def step(
        self, event: TraceCompleted, refs_for: RefsFor | None = None
    ) -> SamplesScored | None:
        """Route and buffer one trace; the scored group if it completes one (not yet
        marked scored: call ``done`` once the result is stored)."""
        if not self.routes(event):
            return None
        group = self.buffer.add(event)
        if group is None:
            return None
        refs = await refs_for(group) if refs_for is not None and self.needs_refs else None
        try:
            scored = score_group(
                self.algorithm_id, self.algorithm, group, self.state, refs,
                self.tool_sft.get(event.env),
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - the algorithm's own failure on this group
            return failed(self.algorithm_id, group, f"{type(e).__name__}: {e}")
        problem = next(
            (f"sample {i}: {p}" for i, x in enumerate(scored.samples) if (p := x.problem())),
            None,
        )
        return scored if problem is None else failed(self.algorithm_id, group, problem)

    def done(self, scored: SamplesScored) -> None:
        """The group is scored and stored: never score it again; fold the state."""
        self.buffer.mark_scored(scored.group_id)
        if self.algorithm.stateful and not scored.failed:
            self.state = self.algorithm.fold(self.state, scored)
