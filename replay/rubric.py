"""Rubric replay: re-score recorded conversations with today's reward functions.

    rlbus replay <run> rubric [--env reverse-text] [--no-eval]

The debugging loop for reward functions, with no model and no inference: every
recorded trace (``trace.completed.*``, and the traces inside ``eval.completed.*``) is
scored again with ``make_env(env_id, args).score(messages, task, state)`` and its reward
and each named reward (and each member's reward) are compared exactly with what the env
server recorded.

- ``messages``: the trace's message nodes in order, as the harness's chat
  (``role``, ``content``, ``name`` when set), closing env remarks included.
- ``task``: ``trace.task.data`` (regenerated from the taskset when a trace lacks it).
- ``args``: the ``task.requested`` event's ``args`` (what the env server used), else the
  env's ``args`` in the run's config.
- ``state``: ``env.init_state(task)``, then the env's ``env_response`` replayed after every
  assistant turn the harness answered (turns before ``max_turns``), on the recorded
  conversation so far: state a rubric reads is rebuilt as the rollout built it. An env
  whose ``env_response`` does I/O (a tool call) is re-executed here; one whose state
  depends on something outside the conversation (the clock, a sandbox) cannot be
  rebuilt, and its rubric may score differently for that reason alone.

Errored traces (reward 0, no named rewards) are counted and skipped. A rubric that raises
is reported per trace, never fatal. The env key on the bus maps back to the env id via
``orchestrator.train.env`` (``token_for(id) == key``).

Reading and rescoring take ``on_progress(done, total)``: messages read, then traces
rescored (``rlbus replay`` draws both).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from bus.reader import Progress, read_log
from bus.runtime import Bus
from bus.subjects import Topic
from configs import RunConfig, resolve
from replay.diff import ValueDiff, diff_values
from roles.lib.envs.base import ParseError
from roles.lib.envs.chat import chat_message
from schemas import EvalCompleted, RunStarted, TaskRequested, Trace, TraceCompleted


@dataclass
class RubricLog:
    cfg: RunConfig
    requests: dict[str, TaskRequested]  # by event id
    traces: list[tuple[str, Trace]]  # (request id, trace), log order


async def read_rubric_log(
    bus: Bus, env_key: str | None = None, evals: bool = True, on_progress: Progress | None = None
) -> RubricLog:
    started: RunStarted | None = None
    requests: dict[str, TaskRequested] = {}
    traces: list[tuple[str, Trace]] = []
    topics = [(Topic.RUN_STARTED, None), (Topic.TASK_REQUESTED, env_key),
              (Topic.TRACE_COMPLETED, env_key)]  # fmt: skip
    if evals:
        topics.append((Topic.EVAL_COMPLETED, env_key))
    types = (RunStarted, TaskRequested, TraceCompleted, EvalCompleted)
    seen: set[str] = set()
    async for event in read_log(bus, topics, types, on_progress=on_progress):
        match event:
            case RunStarted():
                started = started or event
            case TaskRequested():
                requests.setdefault(event.event_id, event)
            case TraceCompleted() | EvalCompleted():
                found = [event.trace] if isinstance(event, TraceCompleted) else event.traces
                for t in found:
                    if t.rollout_id not in seen:  # a redelivered request re-records a trace
                        seen.add(t.rollout_id)
                        traces.append((event.request_id, t))
    if started is None:
        raise ValueError(f"run {bus.run!r} has no run.started event")
    return RubricLog(resolve(started.config), requests, traces)


def env_ids(cfg: RunConfig) -> dict[str, tuple[str, dict[str, Any]]]:
    """Bus env key -> (env id, config args)."""
    return {e.key: (e.id, dict(e.args)) for e in cfg.orchestrator.train.env}


def chat_of(trace: Trace) -> list[dict[str, Any]]:
    """The conversation as the env saw it (tool calls and their ids included)."""
    return [chat_message(m) for m in trace.messages]


def rebuild_state(env: Any, chat: list[dict[str, Any]], task: dict[str, Any], turns: int) -> Any:
    """The env state as the harness left it: init, then ``env_response`` after each
    assistant turn before the last one the harness allowed."""
    state = env.init_state(task)
    answered = 0
    for i, m in enumerate(chat):
        if m["role"] != "assistant":
            continue
        answered += 1
        if answered < turns:
            try:
                env.env_response(chat[: i + 1], task, state)
            except ParseError:  # a reply the env refused: the harness masked it and went on
                pass
    return state


@dataclass
class RubricResult:
    scored: int = 0
    errored: int = 0  # recorded traces with errors: skipped
    failures: list[str] = field(default_factory=list)  # "rollout: exception"
    diff: ValueDiff = field(default_factory=ValueDiff)
    changed_traces: list[str] = field(default_factory=list)


class _Envs:
    """One env instance per (id, args), built on first use."""

    def __init__(self) -> None:
        self.cache: dict[str, Any] = {}

    def get(self, env_id: str, args: dict[str, Any]) -> Any:
        from roles.lib.envs.registry import make_env

        key = env_id + json.dumps(args, sort_keys=True, default=str)
        if key not in self.cache:
            self.cache[key] = make_env(env_id, args)
        return self.cache[key]


def rescore(log: RubricLog, on_progress: Progress | None = None) -> RubricResult:
    out = RubricResult()
    ids = env_ids(log.cfg)
    envs = _Envs()
    for done, (request_id, trace) in enumerate(log.traces):
        if on_progress is not None:  # traces done before this one (the last: below)
            on_progress(done, len(log.traces))
        if trace.errors:
            out.errored += 1
            continue
        try:
            recorded, now = score_one(envs, ids, log.requests.get(request_id), trace)
        except Exception as e:  # noqa: BLE001 - a rubric that raises is a finding, not a crash
            out.failures.append(f"{trace.rollout_id}: {type(e).__name__}: {e}")
            continue
        out.scored += 1
        d = diff_values(recorded, now)
        if not d.ok:
            out.changed_traces.append(trace.rollout_id)
        out.diff.merge(d)
    if on_progress is not None:
        on_progress(len(log.traces), len(log.traces))
    return out


def score_one(
    envs: _Envs, ids: dict[str, tuple[str, dict[str, Any]]], request: TaskRequested | None,
    trace: Trace,
) -> tuple[dict[str, float], dict[str, float]]:  # fmt: skip
    """(recorded, rescored) rewards of one trace, keyed ``rollout`` and ``rollout/name``."""
    env_id, args = ids.get(trace.env, (trace.env, {}))
    if request is not None and request.args:
        args = dict(request.args)
    env = envs.get(env_id, args)
    task = dict(trace.task.data) or env.task(trace.task.split, trace.task.index)
    chat = chat_of(trace)
    turns = (request.max_turns if request is not None else None) or env.max_turns
    score = env.score(chat, task, rebuild_state(env, chat, task, turns))
    recorded = {**trace.rewards, **{f"member:{m}": r for m, r in trace.member_rewards.items()}}
    rescored = {**score.rewards, **{f"member:{m}": r for m, r in score.member_rewards.items()}}
    return dict(_keyed(trace.rollout_id, trace.reward, recorded)), dict(
        _keyed(trace.rollout_id, score.reward, rescored)
    )


def _keyed(rollout: str, reward: float, rewards: dict[str, float]) -> Iterator[tuple[str, float]]:
    """``rollout`` -> the reward, ``rollout/name`` -> each named reward (``member:<m>``: a
    member's reward, the training signal of multi-agent envs)."""
    yield rollout, float(reward)
    for name, value in rewards.items():
        yield f"{rollout}/{name}", float(value)
