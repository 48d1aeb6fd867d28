"""Schemas: goldens decode forever, round trips are lossless, evolution rules hold."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bus import codec
from bus.errors import DecodeError, UnknownSchema
from schemas import (
    EVENT_TYPES,
    Event,
    RunStopped,
    Sample,
    TraceCompleted,
    derive_id,
    schema_of,
    stable_seed,
)
from schemas.arrays import f32, i32, mask, pack_f32, pack_i32, pack_mask
from schemas.base import VALUE_BOUND
from tests.golden.make_golden import golden_path
from tests.samples import every_event, sample, trace


def test_every_event_type_has_a_golden_sample_that_decodes() -> None:
    """Old writers' bytes (committed goldens) still decode to the same event."""
    by_tag = {codec.tag_of(type(e)): e for e in every_event()}
    assert set(by_tag) == {codec.tag_of(t) for t in EVENT_TYPES}
    for tag, expected in by_tag.items():
        data = golden_path(tag).read_bytes()
        decoded = codec.decode(data, EVENT_TYPES, tag)
        assert decoded == expected, tag


def test_tags_are_versioned_and_unique() -> None:
    """Every event is tagged name/version; no tag is reused."""
    tags = [schema_of(t) for t in EVENT_TYPES]
    assert len(set(tags)) == len(tags)
    assert all(v >= 1 for _, v in tags)


def test_stored_events_are_not_array_like_and_omit_defaults() -> None:
    """STYLE: never array_like for stored messages; omit_defaults keeps them small."""
    for t in EVENT_TYPES:
        cfg = t.__struct_config__
        assert not cfg.array_like, t
        assert cfg.omit_defaults, t


def test_old_reader_ignores_new_optional_field() -> None:
    """A field added later (with a default) does not break readers that do not know it."""

    class RunStoppedV1Plus(Event, frozen=True, tag="run_stopped/1"):
        reason: str
        step: int = 0
        detail: str = ""
        new_field: str = "x"

    data = msgspec.msgpack.encode(RunStoppedV1Plus(run="r", reason="user", new_field="hello"))
    old = codec.decode(data, [RunStopped])
    assert old.reason == "user"


def test_unknown_schema_version_is_a_clear_error() -> None:
    """A reader meeting a newer version fails naming it, instead of misreading it."""
    raw = msgspec.msgpack.encode({"type": "run_stopped/2", "run": "r", "reason": "x"})
    with pytest.raises(UnknownSchema, match="run_stopped/2"):
        codec.decode(raw, [RunStopped])
    with pytest.raises(UnknownSchema, match="run_stopped/2"):
        codec.decode(raw, [RunStopped], "run_stopped/2")


def test_garbage_is_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        codec.decode(b"\xc1\xff garbage", [RunStopped])


def test_trace_branch_tokens_are_aligned() -> None:
    """A branch's concatenated arrays all have one entry per token."""
    t = trace()
    ids, sampled, lps, temps = t.branch_tokens(t.branches[0])
    assert len(ids) == len(sampled) == len(lps) == len(temps) == 17
    assert sampled.sum() == 11


def test_sample_arrays_view_bytes() -> None:
    s = sample(n=9)
    a = s.arrays()
    assert len(s) == 9 and all(len(v) == 9 for v in a.values())
    assert a["mask"].dtype == bool and a["token_ids"].dtype == np.int32


def test_derived_ids_and_seeds_are_stable() -> None:
    """Ids and seeds derive from data, never from per-process state."""
    assert derive_id("a", 1) == derive_id("a", 1) != derive_id("a", 2)
    assert stable_seed("run", 3) == stable_seed("run", 3) >= 0


@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=300))
def test_int32_arrays_round_trip(values: list[int]) -> None:
    assert i32(pack_i32(values)).tolist() == values


@given(
    st.lists(st.floats(width=32, allow_nan=False), max_size=300),
    st.lists(st.booleans(), max_size=300),
)
def test_float_and_mask_arrays_round_trip(values: list[float], flags: list[bool]) -> None:
    assert f32(pack_f32(values)).tolist() == values
    assert mask(pack_mask(flags)).tolist() == flags


_text = st.text(max_size=40)
_floats = st.floats(allow_nan=False, allow_infinity=False)
_rewards = st.floats(min_value=-VALUE_BOUND, max_value=VALUE_BOUND)


@given(
    reward=_rewards,
    rewards=st.dictionaries(_text, _rewards, max_size=4),
    n=st.integers(2, 64),
    rollout=st.text(min_size=1, max_size=20),
    step=st.integers(0, 2**40),
)
def test_trace_completed_round_trips(
    reward: float, rewards: dict[str, float], n: int, rollout: str, step: int
) -> None:
    """Any trace survives encode -> decode unchanged."""
    t = msgspec.structs.replace(trace(rollout=rollout, n_tokens=n), reward=reward, rewards=rewards)
    ev = TraceCompleted(
        run="r", env="reverse-text", request_id="q", group_size=4, step=step, trace=t
    )
    assert codec.decode(codec.encode(ev), [TraceCompleted]) == ev


@pytest.mark.parametrize("reward", [1e7, -1e38, math.nan, math.inf])
def test_a_reward_beyond_the_bound_is_a_decode_error(reward: float) -> None:
    """Finite but absurd is refused by the same rule as non-finite: a decode error,
    which every reader dead-letters."""
    t = msgspec.structs.replace(trace(), reward=reward)
    ev = TraceCompleted(run="r", env="reverse-text", request_id="q", group_size=4, step=0, trace=t)
    with pytest.raises(DecodeError, match="reward"):
        codec.decode(codec.encode(ev), [TraceCompleted])


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [
        ("advantages", 1e38, "advantages holds a value beyond"),
        ("advantages", -2e6, "advantages holds a value beyond"),
        ("logprobs", 0.5, "log-probability above 0"),
        ("temperatures", 1e30, "temperatures holds a value beyond"),
        ("advantages", math.nan, "non-finite"),
    ],
)
def test_a_sample_with_an_absurd_value_cannot_be_trained(
    field: str, value: float, problem: str
) -> None:
    s = sample(n=4)
    assert s.problem() is None
    bad = msgspec.structs.replace(
        s,
        **{
            field: pack_f32(
                [value, 0.0, 0.0, 0.0] if field != "logprobs" else [value, -1.0, -1.0, -1.0]
            )
        },
    )
    assert problem in (bad.problem() or "")


@given(n=st.integers(1, 200), adv=_rewards, rollout=_text)
def test_sample_round_trips(n: int, adv: float, rollout: str) -> None:
    s = msgspec.structs.replace(sample(rollout=rollout, n=n), advantages=pack_f32([adv] * n))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(s), type=Sample) == s
