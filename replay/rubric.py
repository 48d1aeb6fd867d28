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
  assistant turn the harness answered (turns before ``max_turns`` and the end of the
  env's ``schedule``: ``Environment.turn_limit``; the env is built with its config
  entry's ``schedule`` and ``min_turns``, as its env server built it), on the recorded
  conversation so far: state a rubric reads is rebuilt as the rollout built it. An env
  whose ``env_response`` does I/O (a tool call) is re-executed here; one whose state
  depends on something outside the conversation (the clock, a sandbox) cannot be
  rebuilt, and its rubric may score differently for that reason alone.

An env with a group rubric (``roles.lib.envs.group``) is re-scored a group at a time, as
the env server scored it: each finished trace of a request alone, then the group
functions over the finished ones in sample order, and each trace's final reward and
named rewards (the group functions' included) are compared. A group whose log holds fewer
traces than it had rollouts (a run cut off mid-publish) cannot be scored together: its
traces are reported as failures, as are all of a group's when one of them fails.

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
from roles.lib.envs.base import ParseError, Score
from roles.lib.envs.chat import chat_message
from roles.lib.envs.group import members
from schemas import EvalCompleted, RunStarted, TaskRequested, Trace, TraceCompleted


@dataclass
class RubricLog:
    cfg: RunConfig
    requests: dict[str, TaskRequested]  # by event id
    traces: list[tuple[str, Trace]]  # (request id, trace), log order
    # request id -> rollouts its group had (a train trace's ``group_size``, an eval's traces)
    group_sizes: dict[str, int] = field(default_factory=dict)


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
    sizes: dict[str, int] = {}
    async for event in read_log(bus, topics, types, on_progress=on_progress):
        match event:
            case RunStarted():
                started = started or event
            case TaskRequested():
                requests.setdefault(event.event_id, event)
            case TraceCompleted() | EvalCompleted():
                found = [event.trace] if isinstance(event, TraceCompleted) else event.traces
                size = event.group_size if isinstance(event, TraceCompleted) else len(found)
                sizes.setdefault(event.request_id, size)
                for t in found:
                    if t.rollout_id not in seen:  # a redelivered request re-records a trace
                        seen.add(t.rollout_id)
                        traces.append((event.request_id, t))
    if started is None:
        raise ValueError(f"run {bus.run!r} has no run.started event")
    return RubricLog(resolve(started.config), requests, traces, sizes)


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
    groups: int = 0  # groups scored together by a group rubric
    failures: list[str] = field(default_factory=list)  # "rollout: exception"
    diff: ValueDiff = field(default_factory=ValueDiff)
    changed_traces: list[str] = field(default_factory=list)


class _Envs:
    """One env instance per (id, args), built on first use with the turn settings of its
    entry in the run's config (``schedule``, ``min_turns``), as its env server built it."""

    def __init__(self, cfg: RunConfig | None = None) -> None:
        self.cfg = cfg
        self.cache: dict[str, Any] = {}

    def get(self, env_id: str, args: dict[str, Any]) -> Any:
        from roles.lib.envs.registry import make_env, turn_options

        key = env_id + json.dumps(args, sort_keys=True, default=str)
        if key not in self.cache:
            entry = self.cfg.orchestrator.served_env(env_id) if self.cfg is not None else None
            self.cache[key] = make_env(env_id, args, **turn_options(entry))
        return self.cache[key]


def rescore(log: RubricLog, on_progress: Progress | None = None) -> RubricResult:
    out = RubricResult()
    ids = env_ids(log.cfg)
    envs = _Envs(log.cfg)
    groups: dict[str, list[Trace]] = {}  # by request id, in log order of their first trace
    for request_id, trace in log.traces:
        groups.setdefault(request_id, []).append(trace)
    done = 0
    for request_id, group in groups.items():
        if on_progress is not None:  # traces done before this group (the last: below)
            on_progress(done, len(log.traces))
        done += len(group)
        finished = members(group)
        out.errored += len(group) - len(finished)
        results = score_group(
            envs, ids, log.requests.get(request_id), group, log.group_sizes.get(request_id)
        )
        out.groups += int(results.grouped)
        for trace, result in zip(finished, results.scores, strict=True):
            if isinstance(result, str):
                out.failures.append(f"{trace.rollout_id}: {result}")
                continue
            out.scored += 1
            d = diff_values(*result)
            if not d.ok:
                out.changed_traces.append(trace.rollout_id)
            out.diff.merge(d)
    if on_progress is not None:
        on_progress(len(log.traces), len(log.traces))
    return out


Compared = tuple[dict[str, float], dict[str, float]]  # (recorded, rescored) of one trace


@dataclass
class GroupScores:
    """``score_group``'s answer: for each finished trace (sample order), its (recorded,
    rescored) values or why it could not be scored; whether a group rubric scored it."""

    scores: list[Compared | str]
    grouped: bool = False


@dataclass
class _Alone:
    """One trace scored alone, with what its rubric saw."""

    env: Any
    task: dict[str, Any]
    chat: list[dict[str, Any]]
    state: Any
    score: Score


def score_group(
    envs: _Envs,
    ids: dict[str, tuple[str, dict[str, Any]]],
    request: TaskRequested | None,
    group: list[Trace],
    size: int | None = None,
) -> GroupScores:
    """The finished traces of one request (``members``: sample order) re-scored as the env
    server scored them: each alone, then, for an env with a group rubric, together.
    ``size``: the rollouts the group had (a group rubric needs them all in the log)."""
    finished = members(group)
    alone: list[_Alone | str] = []
    for trace in finished:
        try:
            alone.append(_score_alone(envs, ids, request, trace))
        except Exception as e:  # noqa: BLE001 - a rubric that raises is a finding, not a crash
            alone.append(f"{type(e).__name__}: {e}")
    ok = [a for a in alone if isinstance(a, _Alone)]
    if not ok or not ok[0].env.group_scored:
        return GroupScores(
            [
                a if isinstance(a, str) else _compared(t, a.score)
                for t, a in zip(finished, alone, strict=True)
            ]
        )
    why = next((f"its group could not be scored: {a}" for a in alone if isinstance(a, str)), None)
    if why is None and size is not None and len(group) < size:
        why = f"the log holds {len(group)} of its group's {size} rollouts"
    if why is not None:
        return GroupScores([why] * len(finished))
    try:
        scores = ok[0].env.score_group(
            [a.chat for a in ok], ok[0].task, [a.state for a in ok], [a.score for a in ok]
        )
    except Exception as e:  # noqa: BLE001 - a rubric that raises is a finding, not a crash
        return GroupScores([f"group rubric: {type(e).__name__}: {e}"] * len(finished))
    return GroupScores([_compared(t, s) for t, s in zip(finished, scores, strict=True)], True)


def _score_alone(
    envs: _Envs, ids: dict[str, tuple[str, dict[str, Any]]], request: TaskRequested | None,
    trace: Trace,
) -> _Alone:  # fmt: skip
    env_id, args = ids.get(trace.env, (trace.env, {}))
    if request is not None and request.args:
        args = dict(request.args)
    env = envs.get(env_id, args)
    task = dict(trace.task.data) or env.task(trace.task.split, trace.task.index)
    chat = chat_of(trace)
    turns = env.turn_limit(request.max_turns if request is not None else None)
    state = rebuild_state(env, chat, task, turns)
    return _Alone(env, task, chat, state, env.score(chat, task, state))


def _compared(trace: Trace, score: Score) -> Compared:
    """(recorded, rescored) rewards of one trace, keyed ``rollout`` and ``rollout/name``."""
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
