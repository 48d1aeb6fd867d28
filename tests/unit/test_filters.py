"""Rollout filters: each built-in detector on hand-made completions, enforce vs monitor,
user detectors by import path, config errors that name the filter, errored traces."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from configs.orchestrator import EnvConfig, FilterConfig
from roles.lib.envs.base import EnvCodeError
from roles.lib.envs.filters import (
    Detector,
    apply_filters,
    build_filters,
    filter_problems,
    sampled_turns,
)
from schemas import Branch, FilterVerdict, Message, TaskRef, Trace, TraceError
from schemas.arrays import pack_f32, pack_i32, pack_mask

GEN_PREFIX = 99  # an unsampled scaffolding token before each completion (logprob 0)


def completion_trace(
    *turns: Sequence[int] | tuple[Sequence[int], Sequence[float]],
    finish: str = "stop",
    errors: Sequence[TraceError] = (),
) -> Trace:
    """A trace whose assistant messages sampled ``turns``: token ids, or (ids, logprobs)
    (default logprob -0.1). The prompt's tokens carry a very low logprob on purpose:
    they were not sampled, so no detector may count them."""
    prompt = Message(
        id=0, role="user", content="q", token_ids=pack_i32([1, 2, 3]),
        sampled=pack_mask([0, 0, 0]), logprobs=pack_f32([-20.0] * 3),
    )  # fmt: skip
    messages = [prompt]
    for i, turn in enumerate(turns, start=1):
        ids, lps = turn if isinstance(turn, tuple) else (turn, [-0.1] * len(turn))
        messages.append(
            Message(
                id=i,
                role="assistant",
                content="a",
                parent=i - 1,
                token_ids=pack_i32([GEN_PREFIX, *ids]),
                sampled=pack_mask([0] + [1] * len(ids)),
                logprobs=pack_f32([0.0, *lps]),
                finish_reason=finish,
            )
        )
    return Trace(
        rollout_id="r", env="e", task=TaskRef(index=0), group_id="g", sample_index=0,
        messages=messages, branches=[Branch(messages=[m.id for m in messages])],
        errors=list(errors), num_turns=len(turns),
    )  # fmt: skip


def verdict(trace: Trace, type_: str, enforce: bool = True, **options: object) -> FilterVerdict:
    """The verdict of one filter of ``type_`` built with ``options``."""
    filters = build_filters([FilterConfig(type=type_, enforce=enforce, options=options)])
    (v,) = apply_filters(trace, filters).filters
    return v


def test_sampled_turns_leave_out_prompt_and_scaffolding() -> None:
    """Detectors see only what the model sampled: the assistant messages' sampled tokens."""
    (turn,) = sampled_turns(completion_trace(([5, 6], [-1.0, -2.0])))
    assert turn.token_ids.tolist() == [5, 6] and turn.logprobs.tolist() == [-1.0, -2.0]


def test_only_the_turns_of_members_that_train_are_judged() -> None:
    """Multi-agent: a frozen opponent's degenerate turn does not filter the learner's
    rollout; the learner's own turns are what the detectors see."""
    import msgspec

    trace = completion_trace([5, 6, 7], [1, 2, 3] * 4)
    learner, opponent = trace.messages[1], trace.messages[2]
    seated = msgspec.structs.replace(
        trace,
        messages=[trace.messages[0], msgspec.structs.replace(learner, member="alice"),
                  msgspec.structs.replace(opponent, member="bob")],
        branches=[Branch(messages=[0, 1, 2], member="alice")],
    )  # fmt: skip
    assert [t.token_ids.tolist() for t in sampled_turns(seated)] == [[5, 6, 7]]
    assert not verdict(seated, "repetition").flagged
    assert verdict(trace, "repetition").flagged  # both turns judged when both train


def test_gibberish_flags_low_logprob_garbage_not_a_confident_completion() -> None:
    """Garbage drawn from the far tail is flagged; a confident completion is not."""
    garbage = completion_trace(([7, 41, 3, 88, 12, 60], [-9.0, -7.5, -0.2, -11.0, -8.0, -6.5]))
    v = verdict(garbage, "gibberish")
    assert v.name == "gibberish" and v.value == pytest.approx(5 / 6) and v.flagged
    confident = completion_trace(([7, 8, 9, 10, 11, 12], [-0.1, -0.3, -2.0, -0.05, -1.0, -0.2]))
    v = verdict(confident, "gibberish")
    assert v.value == 0.0 and not v.flagged
    # the threshold and the share are options: one rare token in six is fine by default,
    # flagged when no rare token at all is tolerated
    one_rare = completion_trace(([1, 2, 3, 4, 5, 6], [-0.1, -0.1, -7.0, -0.1, -0.1, -0.1]))
    assert not verdict(one_rare, "gibberish").flagged
    assert verdict(one_rare, "gibberish", max_share=0.0).flagged
    assert not verdict(one_rare, "gibberish", logprob_below=-8, max_share=0.0).flagged


def test_repetition_flags_a_token_loop_not_a_normal_sequence() -> None:
    """abcabcabcabc: 10 trigrams, 3 distinct, 70% repeats; distinct tokens repeat nothing."""
    loop = verdict(completion_trace([1, 2, 3] * 4), "repetition")
    assert loop.value == pytest.approx(0.7) and loop.flagged
    normal = verdict(completion_trace(list(range(10, 22))), "repetition")
    assert normal.value == 0.0 and not normal.flagged
    # bigrams of 1 2 1 3 1 4: (1,2) (2,1) (1,3) (3,1) (1,4), none repeated; unigrams: 1 x3
    mixed = completion_trace([1, 2, 1, 3, 1, 4])
    assert verdict(mixed, "repetition", ngram=2).value == 0.0
    assert verdict(mixed, "repetition", ngram=1).value == pytest.approx(2 / 6)


def test_repetition_counts_a_turn_that_repeats_an_earlier_one() -> None:
    """n-grams are taken within turns and counted over the whole completion."""
    v = verdict(completion_trace([1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6]), "repetition")
    assert v.value == pytest.approx(4 / 8)  # 8 trigrams, 4 distinct
    assert verdict(completion_trace([1, 2]), "repetition").value == 0.0  # too short to judge


@settings(max_examples=200, deadline=None)
@given(
    turns=st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=30), min_size=1, max_size=3),
    n=st.integers(1, 4),
)
def test_repetition_is_one_minus_distinct_over_total_ngrams(turns: list[list[int]], n: int) -> None:
    """The share against numpy's count of distinct rows of every turn's n-gram windows."""
    rows = [np.lib.stride_tricks.sliding_window_view(t, n) for t in turns if len(t) >= n]
    expected = 0.0
    if rows:
        grams = np.concatenate(rows)
        expected = 1.0 - len(np.unique(grams, axis=0)) / len(grams)
    assert verdict(completion_trace(*turns), "repetition", ngram=n).value == expected


def test_length_flags_too_long_too_short_and_truncated() -> None:
    """Sampled tokens summed over turns, against the bounds; a cut-off only when asked."""
    assert verdict(completion_trace([1] * 6, [2] * 6), "length", max_tokens=10).value == 12.0
    assert verdict(completion_trace([1] * 6, [2] * 6), "length", max_tokens=10).flagged
    assert verdict(completion_trace([1, 2]), "length", min_tokens=3).flagged
    assert not verdict(completion_trace([1, 2, 3]), "length", min_tokens=3, max_tokens=3).flagged
    cut = completion_trace([1, 2, 3], finish="length")
    assert verdict(cut, "length", flag_truncated=True).flagged
    assert not verdict(cut, "length", max_tokens=100).flagged
    assert not verdict(completion_trace([1, 2, 3]), "length", flag_truncated=True).flagged


def test_enforced_filter_filters_monitor_only_just_records() -> None:
    """A flagged verdict keeps a trace out of training only when its filter is enforced."""
    loop = completion_trace([1, 2, 3] * 4)
    configs = [
        FilterConfig(type="repetition", name="loops", enforce=False),
        FilterConfig(type="length", options={"max_tokens": 100}),
    ]
    monitored = apply_filters(loop, build_filters(configs))
    assert [(v.name, v.flagged, v.enforced) for v in monitored.filters] == [
        ("loops", True, False),
        ("length", False, False),
    ]
    assert not monitored.is_filtered
    enforcing = build_filters([FilterConfig(type="repetition")])
    enforced = apply_filters(loop, enforcing)
    assert enforced.is_filtered and enforced.filters[0].enforced
    kept = apply_filters(completion_trace(list(range(12))), enforcing)
    assert not kept.is_filtered and not kept.filters[0].flagged


def test_verdicts_are_deterministic_and_replace_earlier_ones() -> None:
    """Judging the same trace twice gives the same trace: replay can rely on the record."""
    filters = build_filters([FilterConfig(type="gibberish"), FilterConfig(type="repetition")])
    trace = completion_trace(([5, 6, 5, 6], [-9.0, -0.1, -9.0, -0.1]))
    once = apply_filters(trace, filters)
    assert apply_filters(once, filters) == once == apply_filters(trace, filters)
    assert trace.filters == [] and not trace.is_filtered  # the input is left as it was


def test_errored_trace_is_left_alone() -> None:
    """A rollout that errored has nothing to judge: no verdict, never filtered."""
    timeout = TraceError(kind="inference_timeout", message="t")
    errored = completion_trace([1, 2, 3] * 4, errors=[timeout])
    assert apply_filters(errored, build_filters([FilterConfig(type="repetition")])) is errored


class FirstTokenIs(Detector):
    """A user detector: 1.0 when the completion starts with ``token``."""

    def __init__(self, token: int) -> None:
        self.token = token

    def measure(self, trace: Trace) -> float:
        first = [int(t.token_ids[0]) for t in sampled_turns(trace) if len(t.token_ids)][:1]
        return float(first == [self.token])

    def flags(self, value: float) -> bool:
        return value == 1.0


class NotFinite(Detector):
    """A broken user detector: measures NaN."""

    def measure(self, trace: Trace) -> float:
        return float("nan")

    def flags(self, value: float) -> bool:
        return False


class Raises(NotFinite):
    """A broken user detector: raises."""

    def measure(self, trace: Trace) -> float:
        return 1 / 0


def test_detector_by_import_path() -> None:
    """``module:Class`` loads a user's Detector, named after the class by default."""
    config = FilterConfig(type="tests.unit.test_filters:FirstTokenIs", options={"token": 7})
    (f,) = build_filters([config])
    assert f.name == "FirstTokenIs" and isinstance(f.detector, FirstTokenIs)
    judged = apply_filters(completion_trace([7, 8]), [f])
    assert judged.is_filtered and judged.filters[0].value == 1.0
    assert not apply_filters(completion_trace([8, 7]), [f]).is_filtered


def test_a_broken_detector_is_a_bug_in_user_code() -> None:
    """A detector that raises or measures NaN (the log refuses it) fails like env code
    that raises: an EnvCodeError naming the filter, with where it raised."""
    filters = build_filters([FilterConfig(type="tests.unit.test_filters:NotFinite", name="nf")])
    with pytest.raises(EnvCodeError, match="filter 'nf' measured nan"):
        apply_filters(completion_trace([1]), filters)
    filters = build_filters([FilterConfig(type="tests.unit.test_filters:Raises")])
    with pytest.raises(EnvCodeError, match="raised ZeroDivisionError: filter 'Raises'") as caught:
        apply_filters(completion_trace([1]), filters)
    assert "return 1 / 0" in caught.value.traceback


@pytest.mark.parametrize(
    ("type_", "options", "message"),
    [
        ("nope", {}, r"filter 'nope': unknown filter type 'nope': built-ins are gibberish, length, repetition"),
        ("gibberish", {"max_shar": 0.1}, r"filter 'gibberish': unknown option 'max_shar' \(options: logprob_below, max_share\)"),
        ("gibberish", {"max_share": 2}, r"filter 'gibberish': option 'max_share' must lie within \[0.0, 1.0\], got 2"),
        ("gibberish", {"logprob_below": "low"}, r"option 'logprob_below' must be a number"),
        ("repetition", {"ngram": 0}, r"filter 'repetition': option 'ngram' must be an integer >= 1, got 0"),
        ("repetition", {"ngram": 2.5}, r"option 'ngram' must be an integer"),
        ("length", {}, r"filter 'length': set 'min_tokens', 'max_tokens' or 'flag_truncated'"),
        ("length", {"min_tokens": 5, "max_tokens": 4}, r"option 'max_tokens' \(4\) is below 'min_tokens' \(5\)"),
        ("length", {"flag_truncated": "yes"}, r"option 'flag_truncated' must be true or false"),
        ("tests.unit.test_filters:FirstTokenIs", {}, r"filter 'FirstTokenIs': .*missing .*'token'"),
        ("tests.unit.test_filters:completion_trace", {}, r"is not a subclass of .*Detector"),
        ("tests.unit.no_such_module:X", {}, r"cannot import module 'tests.unit.no_such_module'"),
    ],
)  # fmt: skip
def test_bad_filter_configs_raise_naming_the_filter(
    type_: str, options: dict[str, object], message: str
) -> None:
    """A bad type or option fails at start in one line naming the filter and the option."""
    with pytest.raises(ValueError, match=message) as caught:
        build_filters([FilterConfig(type=type_, options=options)])
    assert "\n" not in str(caught.value)


def test_filter_problems_name_the_config_key() -> None:
    """The start-time check reports each bad filter under its dotted key, good ones not."""
    envs = [
        EnvConfig(id="reverse-text", filters=[FilterConfig(type="length", options={"max_tokens": 9})]),
        EnvConfig(id="alphabet-sort", filters=[
            FilterConfig(type="gibberish"), FilterConfig(type="repetition", options={"n": 2}),
        ]),
    ]  # fmt: skip
    assert filter_problems(envs) == [
        "`orchestrator.train.env.1.filters.1`: filter 'repetition': unknown option 'n' "
        "(options: ngram, max_repeat_share)"
    ]
