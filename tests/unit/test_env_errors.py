"""Unit tests for the harness's failure kinds: retryable failures become errored traces,
a bug in env code raises ``EnvCodeError``, a parse error masks one turn, state columns
(docs/running.md, "Errors"). The token-attribution tests are in ``test_harness.py``."""

from __future__ import annotations

from typing import Any

import msgspec
import nats.errors
import numpy as np
import pytest

from bus.errors import RequestTimeout
from roles.algorithm import create
from roles.algorithm.samples import score_group
from roles.lib.envs.base import EnvCodeError, Environment, Harness, ParseError, Rubric
from roles.lib.envs.harness import run_rollout
from roles.lib.envs.registry import make_env
from schemas import GenerateResult, InferenceFailed, TaskRef, TraceCompleted
from schemas.arrays import f32, mask, pack_f32, pack_i32
from tests.unit.test_harness import SAMPLING, FakeGenerate, R, check_invariants, task_ref


class Boom(Harness):
    max_turns = 2

    def __init__(self, where: str) -> None:
        super().__init__("sys")
        self.where = where

    def user_prompt(self, task):  # type: ignore[no-untyped-def]
        if self.where == "prompt":
            raise KeyError("text")
        return "go"

    def env_response(self, messages, task, state):  # type: ignore[no-untyped-def]
        if self.where == "response":
            raise ZeroDivisionError("oops")
        return [{"role": "user", "content": "again"}], False


def _boom_env(where: str) -> Environment:
    def rubric(m, t, s):  # type: ignore[no-untyped-def]
        if where == "rubric":
            raise ValueError("bad rubric")
        return 1.0

    return Environment(
        "boom", make_env("reverse-text", {}).taskset, Boom(where), Rubric({"r": rubric})
    )


@pytest.mark.parametrize(
    ("replies", "kind", "turns"),
    [
        ([RequestTimeout("no reply on rl.x.infer.policy within 1s")], "inference_timeout", 0),
        ([InferenceFailed(request_id="x", kind="context_too_long", message="300 > 256")],
         "context_too_long", 0),  # at the first turn; at a later one: test_prompt_too_long
        ([nats.errors.ConnectionClosedError()], "inference_error", 0),
    ],
)  # fmt: skip
async def test_retryable_failures_become_errored_traces(
    replies: list, kind: str, turns: int
) -> None:
    """Timeouts, InferenceFailed and transport errors give a Trace with the error kind and
    reward 0 (stop condition has_error), never an exception; the recorded tokens stay
    consistent."""
    gen = FakeGenerate(*replies)
    trace = await run_rollout(_boom_env("none"), TaskRef(index=0, data={}), gen, R, SAMPLING, rollout_id="r")  # fmt: skip
    assert [e.kind for e in trace.errors] == [kind]
    assert not trace.ok and trace.reward == 0.0 and trace.rewards == {} and trace.metrics == {}
    assert trace.num_turns == turns and trace.state == {}
    assert trace.stop_condition == "has_error" and not trace.truncated
    if gen.calls:  # what was recorded is a prefix of the last prompt the model was given
        ids, *_ = trace.branch_tokens(trace.branches[0])
        assert gen.calls[-1]["prompt"][: len(ids)] == ids.tolist()
        for m in trace.messages:
            assert len(m.token_ids) // 4 == len(m.sampled) == len(m.logprobs) // 4


@pytest.mark.parametrize(
    ("where", "replies", "error", "function"),
    [
        ("prompt", [], "KeyError", "user_prompt"),
        ("response", [("a", "stop")], "ZeroDivisionError", "env_response"),
        ("rubric", [("a", "stop"), ("b", "stop")], "ValueError", "rubric"),
    ],
)  # fmt: skip
async def test_a_bug_in_env_code_raises_env_code_error(
    where: str, replies: list, error: str, function: str
) -> None:
    """An exception from env code (opening messages, env_response, the rubric) is not an
    errored trace: EnvCodeError propagates out of run_rollout, naming the env and the
    exception on one line and carrying the traceback of where env code raised."""
    gen = FakeGenerate(*replies)
    with pytest.raises(EnvCodeError) as info:
        await run_rollout(_boom_env(where), TaskRef(index=0, data={}), gen, R, SAMPLING, rollout_id="r")  # fmt: skip
    bug = info.value
    assert (bug.env, bug.error_type) == ("boom", error)
    assert str(bug).startswith(f"env 'boom' raised {error}: ") and "\n" not in str(bug)
    assert f"in {function}" in bug.traceback and error in bug.traceback
    assert len(gen.calls) == len(replies)


async def test_env_messages_that_are_not_chat_dicts_are_an_env_bug() -> None:
    """env_response must return chat dicts with a role: anything else is EnvCodeError."""

    class Sloppy(Harness):
        max_turns = 2

        def user_prompt(self, task):  # type: ignore[no-untyped-def]
            return "hi"

        def env_response(self, messages, task, state):  # type: ignore[no-untyped-def]
            return ["thanks"], False

    env = Environment("sloppy", make_env("reverse-text", {}).taskset, Sloppy(None),
                      Rubric({"r": lambda m, t, s: 1.0}))  # fmt: skip
    with pytest.raises(EnvCodeError, match="env_response returned 'thanks'"):
        await run_rollout(env, TaskRef(index=0, data={}), FakeGenerate(("a", "stop")), R,
                          SAMPLING, rollout_id="r")  # fmt: skip


class Strict(Harness):
    """Wants "ok" each turn: anything else is a ParseError, with feedback unless told not to."""

    max_turns = 3
    state_columns = ("turns", "last")

    def __init__(self, feedback: bool = True, state: Any = None) -> None:
        super().__init__(None)
        self.feedback, self.state = feedback, state

    def user_prompt(self, task):  # type: ignore[no-untyped-def]
        return "say ok"

    def init_state(self, task):  # type: ignore[no-untyped-def]
        return {"turns": 0, "last": self.state}

    def env_response(self, messages, task, state):  # type: ignore[no-untyped-def]
        state["turns"] += 1
        if messages[-1]["content"] != "ok":
            feedback = [{"role": "user", "content": "say ok"}] if self.feedback else None
            raise ParseError("not ok", feedback=feedback)
        return [{"role": "user", "content": "again"}], False


def strict_env(**kw: Any) -> Environment:
    return Environment("strict", make_env("reverse-text", {}).taskset, Strict(**kw),
                       Rubric({"oks": lambda m, t, s: float(sum(x["content"] == "ok" for x in m))}))  # fmt: skip


async def test_parse_error_masks_only_its_turn_and_the_rest_trains() -> None:
    """The env refuses turn 2 with ParseError: that reply is masked and recorded as a
    parse_error turn error, the env's feedback goes on, and the trace is ok. Built into
    samples, no channel trains turn 2's tokens while turns 1 and 3 train as usual."""
    gen = FakeGenerate(("ok", "stop"), ("nope", "stop"), ("ok", "stop"))
    trace = await run_rollout(strict_env(), TaskRef(index=0, data={}), gen, R, SAMPLING,
                              rollout_id="r")  # fmt: skip
    assert trace.ok and trace.reward == 2.0 and trace.num_turns == 3
    check_invariants(trace, gen.calls[-1]["prompt"] + gen.completions[-1])
    roles = [m.role for m in trace.messages]
    assert roles == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert [m.masked for m in trace.messages] == [False, False, False, True, False, False]
    bad = trace.messages[3]
    assert [(e.kind, e.message, e.message_id) for e in trace.turn_errors] == [("parse_error", "not ok", bad.id)]  # fmt: skip
    assert trace.messages[4].content == "say ok"  # the ParseError's feedback
    assert trace.state == {"turns": 2, "last": None}
    # Token positions of the masked reply inside the single branch.
    sizes = [len(m.token_ids) // 4 for m in trace.messages]
    start = sum(sizes[:3])
    bad_pos = set(range(start, start + sizes[3]))
    sampled = trace.branch_tokens(trace.branches[0])[1]
    # A group of two: the same trace, and a copy with reward 0 (so grpo has a signal).
    copy = msgspec.structs.replace(trace, rollout_id="r2", sample_index=1, reward=0.0)
    group = [TraceCompleted(run="x", env="strict", request_id="q", group_size=2, step=0, trace=t)
             for t in (trace, copy)]  # fmt: skip
    for algo, options in (
        ("grpo", {}),
        ("sft", {}),
        ("echo", {"alpha": 1.0, "include_user": True}),
    ):
        (s, _) = score_group(algo, create(algo, options), group).samples
        rl = np.flatnonzero(mask(s.mask)).tolist()
        trained = set(rl) | (
            set(np.flatnonzero(mask(s.sft_mask)).tolist()) if s.sft_mask else set()
        )
        assert not trained & bad_pos, algo
        assert not f32(s.advantages)[sorted(bad_pos)].any(), algo
        if algo != "echo":  # echo's ce is on env messages; its rl on the replies
            assert trained == set(np.flatnonzero(sampled).tolist()) - bad_pos, algo
    assert rl == sorted(set(np.flatnonzero(sampled).tolist()) - bad_pos)


async def test_parse_error_without_feedback_ends_the_rollout() -> None:
    """A ParseError with no feedback masks the turn and ends the rollout, which is scored."""
    gen = FakeGenerate(("nope", "stop"))
    trace = await run_rollout(strict_env(feedback=False), TaskRef(index=0, data={}), gen, R,
                              SAMPLING, rollout_id="r")  # fmt: skip
    assert trace.ok and trace.num_turns == 1 and len(gen.calls) == 1
    assert [m.role for m in trace.messages] == ["user", "assistant"]
    assert trace.messages[1].masked and [e.message_id for e in trace.turn_errors] == [1]
    assert trace.reward == 0.0 and trace.state == {"turns": 1, "last": None}


async def test_state_columns_are_json_and_a_bad_one_is_an_env_bug() -> None:
    """Declared state columns are recorded as JSON gives them back (a tuple becomes a
    list); a value that is not JSON-able raises EnvCodeError naming the column."""
    gen = FakeGenerate(("ok", "stop"), ("ok", "stop"), ("ok", "stop"))
    trace = await run_rollout(strict_env(state=("a", 1)), TaskRef(index=0, data={}), gen, R,
                              SAMPLING, rollout_id="r")  # fmt: skip
    assert trace.state == {"turns": 2, "last": ["a", 1]}
    gen = FakeGenerate(("ok", "stop"), ("ok", "stop"), ("ok", "stop"))
    with pytest.raises(EnvCodeError, match="state column 'last' is not JSON-able"):
        await run_rollout(strict_env(state={1, 2}), TaskRef(index=0, data={}), gen, R,
                          SAMPLING, rollout_id="r")  # fmt: skip


async def test_partial_member_rewards_are_an_env_bug() -> None:
    """A multi-agent rubric that rewards some members but not all raises EnvCodeError."""
    relay = make_env("relay-reverse", {})
    funcs = dict(relay.rubric.member_funcs)
    first = next(iter(funcs))
    partial = Environment(relay.name, relay.taskset, relay.harness,
                          Rubric(relay.rubric.funcs, member_funcs={first: funcs[first]}))  # fmt: skip
    gen = FakeGenerate(*[("abc", "stop")] * relay.max_turns)
    with pytest.raises(EnvCodeError, match="a multi-agent rubric rewards every member or none"):
        await run_rollout(partial, task_ref(relay), gen, R, SAMPLING, rollout_id="r")


async def test_malformed_reply_is_an_error() -> None:
    """A reply whose logprobs do not match its tokens is a bad_reply error, not a crash."""

    async def bad(*args: Any, **kw: Any) -> GenerateResult:
        return GenerateResult(request_id="x", completion_ids=pack_i32([5, 6]), logprobs=pack_f32([0.0]),
                              finish_reason="stop", policy_version=0)  # fmt: skip

    env = make_env("reverse-text", {})
    trace = await run_rollout(env, task_ref(env), bad, R, SAMPLING, rollout_id="r")
    assert [e.kind for e in trace.errors] == ["bad_reply"]


async def test_a_state_column_the_state_lacks_is_none_and_a_bad_score_is_an_env_bug() -> None:
    """A rollout that ended before the env set a column records None for it (not a bug);
    a rubric returning a non-finite reward is the env's bug (EnvCodeError)."""
    env = strict_env()
    env.harness.state_columns = ("turns", "never_set")
    env.state_columns = ("turns", "never_set")
    gen = FakeGenerate(("ok", "stop"), ("ok", "stop"), ("ok", "stop"))
    trace = await run_rollout(env, TaskRef(index=0, data={}), gen, R, SAMPLING, rollout_id="r")
    assert trace.ok and trace.state == {"turns": 2, "never_set": None}
    nan = Environment("nan", env.taskset, env.harness, Rubric({"x": lambda m, t, s: float("nan")}))
    gen = FakeGenerate(("ok", "stop"), ("ok", "stop"), ("ok", "stop"))
    with pytest.raises(EnvCodeError, match="not a finite number"):
        await run_rollout(nan, TaskRef(index=0, data={}), gen, R, SAMPLING, rollout_id="r")
