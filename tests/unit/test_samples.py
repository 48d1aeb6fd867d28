"""Traces to flat samples: alignment, loss masks, shared prefixes, errored traces, grouping."""

from __future__ import annotations

import msgspec
import numpy as np

from roles.algorithm import create
from roles.algorithm.base import Targets
from roles.algorithm.samples import GroupBuffer, score_group, trace_samples
from schemas import (
    Branch,
    FilterVerdict,
    Message,
    TaskRef,
    Trace,
    TraceCompleted,
    TraceError,
    derive_id,
)
from schemas.arrays import f32, mask, pack_f32, pack_i32, pack_mask


def msg(mid: int, role: str, ids: list[int], sampled: list[int], parent: int | None = None,
        temperature: float = 1.0) -> Message:  # fmt: skip
    lps = [-0.5 - 0.01 * t if s else 0.0 for t, s in zip(ids, sampled, strict=True)]
    return Message(id=mid, role=role, content="", parent=parent, token_ids=pack_i32(ids),
                   sampled=pack_mask(sampled), logprobs=pack_f32(lps), temperature=temperature)  # fmt: skip


def single(
    rollout: str = "r0", reward: float = 1.0, index: int = 0, errored: bool = False
) -> Trace:
    """A prompt (not sampled) and an answer whose first token is scaffolding."""
    return Trace(
        rollout_id=rollout, env="e", task=TaskRef(index=7), group_id="g", sample_index=index,
        messages=[msg(0, "user", [1, 2, 3], [0, 0, 0]), msg(1, "assistant", [4, 5, 6, 7], [0, 1, 1, 1], 0, 0.7)],
        branches=[Branch(messages=[0, 1])], reward=reward, policy_min=2, policy_max=3,
        errors=[TraceError(kind="inference_timeout", message="t")] if errored else [],
    )  # fmt: skip


def forked() -> Trace:
    """Two branches sharing a prompt and a first assistant turn, then diverging."""
    return Trace(
        rollout_id="f", env="e", task=TaskRef(index=1), group_id="g", sample_index=0,
        messages=[
            msg(0, "user", [1, 2], [0, 0]),
            msg(1, "assistant", [3, 4, 5], [1, 1, 1], 0),
            msg(2, "user", [6], [0], 1),
            msg(3, "assistant", [7, 8], [1, 1], 2),
            msg(4, "assistant", [9, 10, 11], [0, 1, 1], 2),
        ],
        branches=[Branch(messages=[0, 1, 2, 3]), Branch(messages=[0, 1, 2, 4], reward=0.25)],
        reward=1.0,
    )  # fmt: skip


def completed(trace: Trace, group_size: int = 4) -> TraceCompleted:
    return TraceCompleted(run="r", env=trace.env, request_id="req", group_size=group_size, step=3,
                          trace=trace, event_id=derive_id("trace", trace.rollout_id))  # fmt: skip


def test_sample_arrays_are_aligned() -> None:
    """Every per-token array of every branch has one entry per token."""
    for sample in trace_samples(forked(), 0.5) + trace_samples(single(), -1.0):
        lengths = {k: len(v) for k, v in sample.arrays().items()}
        assert set(lengths.values()) == {len(sample)}, lengths


def test_single_branch_mask_is_sampled_and_carries_the_advantage() -> None:
    """mask == sampled; the advantage sits on masked tokens only; logprobs/temps as recorded."""
    t = single()
    (s,) = trace_samples(t, 0.5)
    ids, sampled, lps, temps = t.branch_tokens(t.branches[0])
    a = s.arrays()
    assert np.array_equal(a["mask"], sampled)
    assert np.array_equal(a["token_ids"], ids)
    assert a["advantages"].tolist() == [0, 0, 0, 0, 0.5, 0.5, 0.5]
    assert np.array_equal(a["logprobs"], lps) and a["logprobs"][4] == np.float32(-0.55)
    assert a["temperatures"].tolist() == [1.0] * 3 + [np.float32(0.7)] * 4
    assert s.sft_mask is None
    assert (s.rollout_id, s.branch, s.env, s.task_index, s.group_id) == ("r0", 0, "e", 7, "g")
    assert (s.reward, s.policy_min, s.policy_max) == (1.0, 2, 3)


def test_shared_prefix_is_trained_once_across_branches() -> None:
    """A message on two branches is trained only in the first; each branch keeps its own tail."""
    first, second = trace_samples(forked(), 1.0)
    assert mask(first.mask).tolist() == [0, 0, 1, 1, 1, 0, 1, 1]
    assert mask(second.mask).tolist() == [0, 0, 0, 0, 0, 0, 0, 1, 1]
    assert f32(second.advantages).tolist() == [0] * 7 + [1.0, 1.0]
    assert (first.branch, second.branch) == (0, 1)
    assert (first.reward, second.reward) == (1.0, 0.25)  # a branch reward overrides the trace's


def test_ce_channel_marks_sampled_tokens_for_cross_entropy() -> None:
    """The sft algorithm's samples are ce-only: sft_mask = the sampled tokens, weight 1, no rl."""
    t = single()
    scored = score_group("sft", create("sft"), [completed(t, group_size=1)])
    (s,) = scored.samples
    assert np.array_equal(mask(s.sft_mask), t.branch_tokens(t.branches[0])[1])
    assert f32(s.ce_weights).tolist() == [0, 0, 0, 0, 1.0, 1.0, 1.0]
    assert not mask(s.mask).any() and not f32(s.advantages).any()
    assert s.ref_weights is None and s.algorithms == ["sft"]
    assert not scored.zero_advantage


def test_errored_traces_are_excluded_from_baseline_and_samples() -> None:
    """An errored trace yields no samples, is counted, and does not move the others' baseline."""
    group = [
        completed(single(f"r{i}", r, i, errored=(i == 1)))
        for i, r in enumerate([1.0, 1.0, 0.0, 0.0])
    ]
    scored = score_group("grpo", create("grpo"), group)
    assert [s.rollout_id for s in scored.samples] == ["r0", "r2", "r3"]
    assert scored.excluded == 1 and scored.rewards == [1.0, 0.0, 0.0]
    # baseline over the three non-errored rewards: mean 1/3
    assert [float(f32(s.advantages)[-1]) for s in scored.samples] == [
        float(np.float32(1 - 1 / 3)), float(np.float32(-1 / 3)), float(np.float32(-1 / 3))
    ]  # fmt: skip
    assert (scored.event_id, scored.causation_id) == (derive_id("scored", "grpo", "g"), "req")
    assert (scored.algorithm, scored.env, scored.group_id, scored.task_index, scored.step) == (
        "grpo",
        "e",
        "g",
        7,
        3,
    )


def test_all_errored_group_is_an_empty_zero_advantage_event() -> None:
    """A group where every rollout failed still yields one (empty) event for accounting."""
    group = [completed(single(f"r{i}", 1.0, i, errored=True), group_size=2) for i in range(2)]
    scored = score_group("grpo", create("grpo"), group)
    assert scored.samples == [] and scored.rewards == []
    assert scored.excluded == 2 and scored.zero_advantage


def test_equal_rewards_flag_zero_advantage() -> None:
    """Identical rewards: samples are still produced, but the group is flagged signal-free."""
    group = [completed(single(f"r{i}", 0.1, i)) for i in range(3)]
    scored = score_group("grpo", create("grpo"), group)
    assert len(scored.samples) == 3 and scored.zero_advantage


def test_score_group_ignores_arrival_order() -> None:
    """The same group in any arrival order encodes to the same event (replay reproduces it)."""
    group = [completed(single(f"r{i}", r, i)) for i, r in enumerate([0.2, 0.9, 0.4, 0.4])]
    a = score_group("rloo", create("rloo"), group)
    b = score_group("rloo", create("rloo"), group[::-1])
    b = msgspec.structs.replace(b, ts_ns=a.ts_ns)
    assert msgspec.msgpack.encode(a) == msgspec.msgpack.encode(b)
    assert [s.rollout_id for s in a.samples] == ["r0", "r1", "r2", "r3"]


def test_group_buffer_completes_once_and_dedups_redeliveries() -> None:
    """A redelivered trace never counts twice; a scored group ignores late deliveries."""
    buf = GroupBuffer()
    events = [completed(single(f"r{i}", 1.0, i), group_size=3) for i in range(3)]
    assert buf.add(events[1]) is None
    assert buf.add(events[1]) is None  # redelivery: still one of three
    assert buf.add(events[0]) is None
    group = buf.add(events[2])
    assert group is not None and [e.trace.rollout_id for e in group] == ["r0", "r1", "r2"]
    assert buf.add(events[2]) is not None  # not marked scored yet: a retry sees it again
    buf.mark_scored("g")
    assert buf.add(events[0]) is None and len(buf) == 0


def with_masked_reply() -> Trace:
    """prompt, a reply that trains, feedback, a masked reply (it did not parse), a reply."""
    return Trace(
        rollout_id="m", env="e", task=TaskRef(index=2), group_id="g", sample_index=0,
        messages=[
            msg(0, "user", [1, 2], [0, 0]),
            msg(1, "assistant", [3, 4, 5], [0, 1, 1], 0),
            msg(2, "user", [6], [0], 1),
            msgspec.structs.replace(msg(3, "assistant", [7, 8, 9], [0, 1, 1], 2), masked=True),
            msg(4, "assistant", [10, 11], [0, 1], 3),
        ],
        branches=[Branch(messages=[0, 1, 2, 3, 4])], reward=1.0,
        turn_errors=[TraceError(kind="parse_error", message="bad call", message_id=3)],
    )  # fmt: skip


MASKED = [6, 7, 8]  # positions of message 3 in the branch


class EveryToken:
    """An algorithm that puts weight on every token of every channel (even unsampled)."""

    name = "every"
    stateful = False

    def targets(self, group, views, state, refs):  # type: ignore[no-untyped-def]
        def ones(v):  # type: ignore[no-untyped-def]
            return np.ones(len(v), np.float32)

        return [[Targets(advantages=1.0, ce=ones(v), ref_weights=ones(v), ref_logprobs=-ones(v))
                 for v in trace_views] for trace_views in views]  # fmt: skip


def test_a_masked_reply_trains_on_no_channel_and_the_rest_trains() -> None:
    """A masked message's tokens get no rl, ce or ref_kl weight, whatever the algorithm
    returned for them; the trace's other sampled tokens train as usual."""
    (s,) = trace_samples(with_masked_reply(), 0.5)
    assert np.flatnonzero(mask(s.mask)).tolist() == [3, 4, 10]
    assert f32(s.advantages).tolist() == [0, 0, 0, 0.5, 0.5, 0, 0, 0, 0, 0, 0.5]
    (ce,) = trace_samples(with_masked_reply(), 1.0, channel="ce")
    assert np.flatnonzero(mask(ce.sft_mask)).tolist() == [3, 4, 10]
    scored = score_group("every", EveryToken(), [completed(with_masked_reply(), group_size=1)])
    (s,) = scored.samples
    for channel in (s.ce_weights, s.ref_weights):
        weights = f32(channel)
        assert not weights[MASKED].any() and weights[[0, 1, 2, 3, 4, 5, 9, 10]].all()
    assert np.flatnonzero(mask(s.sft_mask)).tolist() == [0, 1, 2, 3, 4, 5, 9, 10]
    assert not f32(s.advantages)[MASKED].any()


def test_filtered_traces_count_in_the_baseline_but_never_train() -> None:
    """A filtered trace's reward is in the group's rewards and baseline, but no sample of
    it is kept; it is not an errored (excluded) rollout."""
    traces = [single(f"r{i}", r, i) for i, r in enumerate([1.0, 0.0, 0.0, 1.0])]
    flagged = [
        FilterVerdict(name="gibberish", value=0.9, flagged=True, enforced=True),
        FilterVerdict(name="length", value=40.0, flagged=True),  # monitored: not named
    ]
    traces[3] = msgspec.structs.replace(traces[3], is_filtered=True, filters=flagged)
    scored = score_group("grpo", create("grpo"), [completed(t) for t in traces])
    assert [s.rollout_id for s in scored.samples] == ["r0", "r1", "r2"]
    assert scored.filtered == 1 and scored.filtered_by == {"gibberish": 1}
    assert scored.rewards == [1.0, 0.0, 0.0, 1.0] and scored.excluded == 0
    # baseline over all four rewards (mean 0.5), the filtered one included
    assert [float(f32(s.advantages)[-1]) for s in scored.samples] == [0.5, -0.5, -0.5]
    every = [msgspec.structs.replace(t, is_filtered=True) for t in traces]
    scored = score_group("grpo", create("grpo"), [completed(t) for t in every])
    assert scored.samples == [] and scored.rewards == [1.0, 0.0, 0.0, 1.0]
    assert scored.zero_advantage and scored.excluded == 0
