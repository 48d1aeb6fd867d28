"""Rollout messages: the request an env server runs, and the ``Trace`` it records.

A ``Trace`` is the message graph of one rollout. Each message carries exactly the
tokens the model saw for it (chat-template scaffolding included), a per-token
``sampled`` mask (1 where the actor sampled the token), per-token logprobs of the
sampled tokens, and the temperature they were sampled at. Concatenating the messages
of a ``Branch`` gives the full token sequence of that path, so a trainable sample is a
concatenation, never a re-tokenisation.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
import numpy as np

from schemas import arrays
from schemas.base import Bounded, Event, GroupSize, NonNegative, Record

# Whose request a task is: the orchestrator's warm start ("sft"), its train groups ("rl"),
# its eval rounds ("eval"), or a one-off from `rlbus rollout`/`rlbus eval` ("adhoc").
Phase = Literal["sft", "rl", "eval", "adhoc"]


class SamplingParams(Record, frozen=True):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_completion_tokens: int = 32
    stop: list[str] = msgspec.field(default_factory=list)


class TaskRef(Record, frozen=True):
    """Which task of an env's taskset; ``data`` is the task itself, for readers of the log."""

    index: int
    split: str = "train"  # "train" | "eval"
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class Seating(Record, frozen=True):
    """Who plays which member of a multi-agent rollout, and who learns.

    The orchestrator writes it from the env's config (``members``, ``learner_seat``,
    ``opponent``, ``drop_judge``); the env server casts each rollout from it
    (``roles.lib.envs.seats.cast``). None on a request = every member is played by the
    request's ``model`` and every non-judge member trains.
    """

    bindings: dict[str, str] = msgspec.field(default_factory=dict)  # member -> model key
    # None: every member played by the actor trains; a member name; "rotate": a seat per
    # rollout, balanced over the env's seats within the group.
    learner: str | None = None
    opponent: str | None = None  # model of the seats the learner does not hold (None: the actor)
    train_judges: bool = False


class TaskRequested(Event, frozen=True, tag="task_requested/1"):
    """Ask an env server for ``group_size`` rollouts of one task (one group)."""

    env: str
    task: TaskRef
    group_id: str
    group_size: GroupSize
    sampling: SamplingParams = SamplingParams()
    model: str = "policy"  # inference model key that acts (the policy, or a frozen teacher)
    step: NonNegative = 0  # orchestrator step at dispatch
    policy_version: NonNegative = 0  # newest weights version the orchestrator knew at dispatch
    seed: int = 0  # base seed of the group; rollout i uses derive(seed, i)
    max_turns: int | None = None
    args: dict[str, Any] = msgspec.field(default_factory=dict)  # env args from the config
    # The orchestrator's "sft" (warm start on a teacher) | "rl" (which batches its samples
    # feed) | "eval"; "adhoc": asked by `rlbus rollout`/`rlbus eval`, no orchestrator's own.
    phase: Phase = "rl"
    # Training algorithm ids whose samples this group waits for, decided at dispatch
    # (empty in logs written before runtime attach: the config's routing then applies).
    algorithms: list[str] = msgspec.field(default_factory=list)
    seating: Seating | None = None  # multi-agent envs: members' models and the learner
    # The orchestrator's train group counter n: a train request is a function of the
    # config and n (``roles.lib.tasks.train_request``), which the env server checks.
    # None: an eval or adhoc request, or one logged before the counter was recorded.
    number: NonNegative | None = None


class ToolCall(Record, frozen=True):
    """One tool call of an assistant message, OpenAI-style: the env answers it with a
    ``tool`` message whose ``tool_call_id`` is this ``id``."""

    id: str
    name: str
    arguments: str = "{}"  # JSON object text, as the model wrote it


class Message(Record, frozen=True):
    """One node of the message graph."""

    id: int
    role: str  # "system" | "user" | "assistant" | "tool"
    content: str
    parent: int | None = None  # previous message on its path
    name: str | None = None  # tool name (tool messages) or speaker name
    member: str | None = None  # multi-agent: which member produced it
    token_ids: bytes = b""  # int32, scaffolding included
    sampled: bytes = b""  # uint8 mask, same length
    logprobs: bytes = b""  # float32, same length; 0 where not sampled
    temperature: float = 1.0
    policy_version: int | None = None  # weights version that sampled it
    # A swap landed mid-reply (GenerateResult.version_spans): (index among its sampled
    # tokens, version) for each later version, oldest first; empty: one version.
    version_spans: list[tuple[int, int]] = msgspec.field(default_factory=list)
    model: str | None = None
    finish_reason: str | None = None  # "stop" | "length" for sampled messages
    # [start, end) of the content's tokens inside token_ids (the rest is chat-template
    # scaffolding); recorded for env messages so SFT on tool outputs trains content only.
    content_span: tuple[int, int] | None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call they answer
    # A reply that did not parse (``Trace.turn_errors`` says why): its tokens never train,
    # the rest of the rollout does.
    masked: bool = False
    # The reasoning a reply wrote (Qwen3's <think> block), as its renderer parsed it; its
    # tokens stay in token_ids as sampled. None: the format has no reasoning.
    reasoning: str | None = None

    def ids(self) -> np.ndarray:
        return arrays.i32(self.token_ids)


class Branch(Record, frozen=True):
    """A path through the graph, root first: one trainable sequence."""

    messages: list[int]
    member: str | None = None
    reward: Bounded | None = None  # per-branch reward when it differs from the trace's


class TraceError(Record, frozen=True):
    # docs/running.md, "Errors": inference_timeout, inference_error, no_responders,
    # context_too_long, bad_reply, no_actor_turn, render_error, harness_error, task_error
    # (rollout errors), parse_error (a turn error), env_exception (a bug in env code: the
    # task is dead-lettered).
    kind: str
    message: str
    message_id: int | None = None


class FilterVerdict(Record, frozen=True):
    """One rollout filter's verdict on a trace (``roles.lib.envs.filters``)."""

    name: str  # the filter's name in the env's config
    value: float  # what the detector measured (its docs say what)
    flagged: bool  # the value crossed the filter's threshold
    enforced: bool = False  # flagged by an enforcing filter: the trace never trains


class Trace(Record, frozen=True):
    rollout_id: str
    env: str
    task: TaskRef
    group_id: str
    sample_index: int
    messages: list[Message]
    branches: list[Branch]
    reward: Bounded = 0.0
    rewards: dict[str, Bounded] = msgspec.field(default_factory=dict)  # each named reward fn
    member_rewards: dict[str, Bounded] = msgspec.field(default_factory=dict)
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    timings: dict[str, float] = msgspec.field(default_factory=dict)  # seconds
    errors: list[TraceError] = msgspec.field(default_factory=list)
    policy_min: int = 0  # oldest weights version that sampled a token
    policy_max: int = 0  # newest
    truncated: bool = False  # a completion hit its token limit, or stop_condition "prompt_too_long"
    num_turns: int = 0
    # Multi-agent: the learner's member this rollout (None: no seat rule), and the model
    # key that played each member (its turns' ``Message.policy_version`` say which weights).
    seat: str | None = None
    member_models: dict[str, str] = msgspec.field(default_factory=dict)
    # Whether some token was sampled by the policy being trained (False: a frozen model
    # wrote every token, e.g. a frozen actor; staleness does not apply to it).
    from_policy: bool = True
    filters: list[FilterVerdict] = msgspec.field(default_factory=list)
    is_filtered: bool = False  # an enforcing filter flagged it: in metrics, never in a batch
    turn_errors: list[TraceError] = msgspec.field(default_factory=list)  # masked turns
    state: dict[str, Any] = msgspec.field(default_factory=dict)  # the env's state_columns
    # Why it ended, the highest that held (``roles.lib.envs.stop``): "has_error",
    # "schedule_exhausted", "prompt_too_long" (then ``truncated``) or "max_turns_reached";
    # "" in a trace recorded before stop conditions were.
    stop_condition: str = ""

    @property
    def ok(self) -> bool:
        return not self.errors

    def branch_tokens(self, branch: Branch) -> tuple[np.ndarray, ...]:
        """(token_ids, sampled, logprobs, temperatures) of a branch, concatenated."""
        by_id = {m.id: m for m in self.messages}
        msgs = [by_id[i] for i in branch.messages]
        ids = (
            np.concatenate([arrays.i32(m.token_ids) for m in msgs])
            if msgs
            else np.zeros(0, arrays.I32)
        )
        sampled = (
            np.concatenate([arrays.mask(m.sampled) for m in msgs]) if msgs else np.zeros(0, bool)
        )
        lps = (
            np.concatenate([arrays.f32(m.logprobs) for m in msgs])
            if msgs
            else np.zeros(0, arrays.F32)
        )
        temps = (
            np.concatenate(
                [np.full(len(m.token_ids) // 4, m.temperature, arrays.F32) for m in msgs]
            )
            if msgs
            else np.zeros(0, arrays.F32)
        )
        return ids, sampled, lps, temps


class TraceCompleted(Event, frozen=True, tag="trace_completed/1"):
    env: str  # == trace.env; the subject key
    request_id: str  # the TaskRequested event id
    group_size: GroupSize
    step: NonNegative
    trace: Trace


class EvalCompleted(Event, frozen=True, tag="eval_completed/1"):
    """All rollouts of one eval task (k samples), with their rewards."""

    request_id: str
    env: str
    step: NonNegative
    task_index: int
    rewards: list[Bounded]
    traces: list[Trace] = msgspec.field(default_factory=list)
    errors: NonNegative = 0
