"""Rollout filters: detectors of degenerate rollouts, and their verdicts on a trace.

    filters = build_filters(env_config.filters)   # at start: a bad filter config fails here
    trace = apply_filters(trace, filters)         # env server, each train rollout

A filter is a named ``Detector`` (a built-in, or ``package.module:Class`` by import
path, found like envs and algorithms by ``roles.lib.plugins.load_named``) and whether it
is enforced. A detector measures one number on what the model sampled (the sampled
tokens of the assistant messages, every turn) and says whether that number is
degenerate. ``apply_filters`` records one ``FilterVerdict`` per filter on the trace, and
``is_filtered`` when an enforced filter flagged it: such a trace counts in reward and
filter metrics but never trains. A monitor-only filter (``enforce = false``) records
and counts its verdict, nothing more.

Built-ins (docs/running.md, "Rollout filters"):

- ``gibberish``: the share of sampled tokens drawn at a logprob below ``logprob_below``
  (-6.0); flags a share above ``max_share`` (0.2).
- ``repetition``: the share of the completion's ``ngram``-grams (3) that repeat an
  earlier one; flags a share above ``max_repeat_share`` (0.5).
- ``length``: the number of sampled tokens; flags fewer than ``min_tokens``, more than
  ``max_tokens``, or (``flag_truncated``) a turn cut off by the token limit.

Pure and deterministic: the verdict is stored in the trace, so replay and the lake read
it instead of judging again. Imports nothing heavy (numpy only).
"""

from __future__ import annotations

import inspect
import math
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgspec
import numpy as np

from configs.orchestrator import EnvConfig, FilterConfig
from roles.lib.envs.base import EnvCodeError
from roles.lib.plugins import load_named
from schemas import FilterVerdict, Trace, arrays


class Turn(NamedTuple):
    """What the model sampled in one assistant message."""

    token_ids: np.ndarray  # int32, the sampled tokens only (scaffolding left out)
    logprobs: np.ndarray  # float32, aligned with token_ids
    finish_reason: str | None


def sampled_turns(trace: Trace) -> list[Turn]:
    """The sampled tokens of the assistant messages that would train, in message order:
    in a multi-agent trace only the turns of the members its branches train (a frozen
    opponent's or a judge's degenerate reply does not filter the learner's rollout).

    Masked turns (a reply that did not parse) are included: they never train, but they
    are still what the model wrote, and degenerate output is what filters look for."""
    trained = {b.member for b in trace.branches}
    turns = []
    for m in trace.messages:
        if m.role != "assistant" or (m.member is not None and m.member not in trained):
            continue
        sampled = arrays.mask(m.sampled)
        turns.append(Turn(m.ids()[sampled], arrays.f32(m.logprobs)[sampled], m.finish_reason))
    return turns


class Detector:
    """Measures one number on a trace and says whether it is degenerate.

    A subclass takes its options as keyword arguments (``[...filters] options``) and
    raises ``ValueError`` naming the option when one is invalid. It implements
    ``measure`` and ``flags``; ``judge`` is what ``apply_filters`` calls, and a detector
    whose verdict needs more than its value (``length``'s cut-off) overrides it. All
    three must be pure: the verdict is recorded once and replayed from the trace."""

    def measure(self, trace: Trace) -> float:
        """The detector's number for ``trace`` (its docstring says what)."""
        raise NotImplementedError

    def flags(self, value: float) -> bool:
        """Whether ``value`` crosses the detector's threshold."""
        raise NotImplementedError

    def judge(self, trace: Trace) -> tuple[float, bool]:
        """(value, flagged) of ``trace``."""
        value = self.measure(trace)
        return value, self.flags(value)


def _number(option: str, value: Any, low: float | None = None, high: float | None = None) -> float:
    """``value`` as a float within [low, high]; ``ValueError`` naming ``option`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"option {option!r} must be a number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{'-inf' if low is None else low}, {'inf' if high is None else high}]"
        raise ValueError(f"option {option!r} must lie within {bounds}, got {value!r}")
    return float(value)


def _integer(option: str, value: Any, low: int) -> int:
    """``value`` as an int of at least ``low``; ``ValueError`` naming ``option`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"option {option!r} must be an integer >= {low}, got {value!r}")
    return value


class Gibberish(Detector):
    """Rare tokens sampled at low probability: the share of sampled tokens whose logprob
    is below ``logprob_below``; flags a share above ``max_share``.

    Default -6.0 (p < 0.25%, 1 draw in 400): a healthy policy draws from that far tail
    for a few percent of its tokens at most, while a collapsing one, whose distribution
    has gone flat, draws most of its tokens there. It sits below a uniform guess over a
    small vocabulary (-4.66 for the tiny model's 106 tokens), so an untrained tiny model
    is not called gibberish. Default ``max_share`` 0.2: one token in five from the tail
    is noise, not language. 0.0 for a trace that sampled nothing."""

    def __init__(self, *, logprob_below: float = -6.0, max_share: float = 0.2) -> None:
        self.logprob_below = _number("logprob_below", logprob_below, high=0.0)
        self.max_share = _number("max_share", max_share, low=0.0, high=1.0)

    def measure(self, trace: Trace) -> float:
        logprobs = [t.logprobs for t in sampled_turns(trace)]
        flat = np.concatenate(logprobs) if logprobs else np.zeros(0, arrays.F32)
        return float(np.mean(flat < self.logprob_below)) if len(flat) else 0.0

    def flags(self, value: float) -> bool:
        return value > self.max_share


class Repetition(Detector):
    """Repeated n-grams: the share of the completion's ``ngram``-grams of tokens that
    repeat one seen before, ``1 - distinct / total``, with n-grams taken within each turn
    and counted over all turns together; flags a share above ``max_repeat_share``.

    A token loop tends to 1 (``abcabcabcabc``: 10 trigrams, 3 distinct, 0.7); text that
    never repeats itself is 0. Default ``max_repeat_share`` 0.5: more than half of the
    completion is a copy of itself. 0.0 for a completion shorter than ``ngram``."""

    def __init__(self, *, ngram: int = 3, max_repeat_share: float = 0.5) -> None:
        self.ngram = _integer("ngram", ngram, low=1)
        self.max_repeat_share = _number("max_repeat_share", max_repeat_share, low=0.0, high=1.0)

    def measure(self, trace: Trace) -> float:
        # A set of tuples: completions are short, and numpy's unique over rows costs
        # ~0.1 ms each, a third of the env server's work per rollout.
        n = self.ngram
        grams: list[tuple[int, ...]] = []
        for turn in sampled_turns(trace):
            ids = turn.token_ids.tolist()
            grams += [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
        if not grams:
            return 0.0
        return 1.0 - len(set(grams)) / len(grams)

    def flags(self, value: float) -> bool:
        return value > self.max_repeat_share


class Length(Detector):
    """Completion length: the number of sampled tokens over all turns; flags fewer than
    ``min_tokens`` or more than ``max_tokens`` and, with ``flag_truncated``, a trace in
    which a turn ended by hitting the token limit (``finish_reason == "length"``).

    No default bounds: a length filter must set at least one of the three."""

    def __init__(
        self, *, min_tokens: int = 0, max_tokens: int | None = None, flag_truncated: bool = False
    ) -> None:
        self.min_tokens = _integer("min_tokens", min_tokens, low=0)
        self.max_tokens = None if max_tokens is None else _integer("max_tokens", max_tokens, low=1)
        if not isinstance(flag_truncated, bool):
            raise ValueError(f"option 'flag_truncated' must be true or false, got {flag_truncated!r}")  # fmt: skip
        self.flag_truncated = flag_truncated
        if self.max_tokens is not None and self.max_tokens < self.min_tokens:
            raise ValueError(
                f"option 'max_tokens' ({self.max_tokens}) is below 'min_tokens' ({self.min_tokens})"
            )
        if not (self.min_tokens or self.max_tokens is not None or flag_truncated):
            raise ValueError("set 'min_tokens', 'max_tokens' or 'flag_truncated': it flags nothing")

    def measure(self, trace: Trace) -> float:
        return float(sum(len(t.token_ids) for t in sampled_turns(trace)))

    def flags(self, value: float) -> bool:
        return value < self.min_tokens or (self.max_tokens is not None and value > self.max_tokens)

    def judge(self, trace: Trace) -> tuple[float, bool]:
        value, flagged = super().judge(trace)
        truncated = any(t.finish_reason == "length" for t in sampled_turns(trace))
        return value, flagged or (self.flag_truncated and truncated)


BUILTINS: dict[str, type[Detector]] = {
    "gibberish": Gibberish,
    "repetition": Repetition,
    "length": Length,
}


@dataclass(frozen=True)
class Filter:
    """A detector under its configured name; ``enforce``: a flagged trace never trains."""

    name: str
    enforce: bool
    detector: Detector


def _check_options(cls: type[Detector], options: Mapping[str, Any]) -> None:
    """``ValueError`` naming the first option ``cls`` does not take (a typo, mostly)."""
    try:
        params = inspect.signature(cls).parameters.values()
    except (TypeError, ValueError):  # no signature to read: the constructor decides
        return
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    known = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in options:
        if key not in known:
            raise ValueError(f"unknown option {key!r} (options: {', '.join(known) or 'none'})")


def make_detector(type_: str, options: Mapping[str, Any]) -> Detector:
    """The detector called ``type_`` (a built-in or ``module:Class``) built with ``options``."""
    cls = load_named(type_, BUILTINS, "filter type", "my_pkg.filters:MyDetector", ValueError)
    if not (isinstance(cls, type) and issubclass(cls, Detector)):
        raise ValueError(f"{type_!r} is not a subclass of roles.lib.envs.filters.Detector")
    _check_options(cls, options)
    try:
        return cls(**options)
    except TypeError as e:  # e.g. a required option left out
        raise ValueError(str(e)) from None


def build_filter(config: FilterConfig) -> Filter:
    """One configured filter; ``ValueError("filter '<name>': ...")`` if it cannot be built."""
    name = config.name or config.type
    try:
        detector = make_detector(config.type, config.options)
    except ValueError as e:
        raise ValueError(f"filter {name!r}: {e}") from None
    return Filter(name=name, enforce=config.enforce, detector=detector)


def build_filters(configs: Sequence[FilterConfig]) -> list[Filter]:
    """An env's filters, in config order (see ``build_filter``)."""
    return [build_filter(c) for c in configs]


def apply_filters(trace: Trace, filters: Sequence[Filter]) -> Trace:
    """``trace`` with one verdict per filter and ``is_filtered`` = an enforced filter flagged
    it. An errored trace (nothing to judge) and a trace without filters come back as is.

    A detector that raises, or measures a non-finite value (the log refuses NaN), is a
    bug in user code like one in env code: ``EnvCodeError`` naming the filter, which the
    env server dead-letters at once (a retry would judge the same way)."""
    if trace.errors or not filters:
        return trace
    verdicts = [_verdict(f, trace) for f in filters]
    return msgspec.structs.replace(
        trace, filters=verdicts, is_filtered=any(v.enforced for v in verdicts)
    )


def _verdict(f: Filter, trace: Trace) -> FilterVerdict:
    """One filter's verdict on ``trace`` (see ``apply_filters`` for its failures)."""
    try:
        value, flagged = f.detector.judge(trace)
        value = float(value)
    except Exception as e:  # noqa: BLE001 - user detector code: a bug in it, reported as such
        where = "".join(traceback.format_exception(e))
        raise EnvCodeError(trace.env, type(e).__name__, f"filter {f.name!r}: {e}", where) from e
    if not math.isfinite(value):
        message = f"filter {f.name!r} measured {value}, not a finite number"
        raise EnvCodeError(trace.env, "ValueError", message)
    flagged = bool(flagged)
    return FilterVerdict(name=f.name, value=value, flagged=flagged, enforced=flagged and f.enforce)


def filter_problems(env_configs: Sequence[EnvConfig]) -> list[str]:
    """Each train env's filters built as its env server will build them: one line per
    filter that cannot be, naming ``orchestrator.train.env.<i>.filters.<j>``."""
    problems = []
    for i, env in enumerate(env_configs):
        for j, config in enumerate(env.filters):
            where = f"`orchestrator.train.env.{i}.filters.{j}`"
            try:
                build_filter(config)
            except ValueError as e:
                problems.append(f"{where}: {_one_line(e)}")
            except Exception as e:  # noqa: BLE001 - a user detector's constructor: a config problem
                problems.append(
                    f"{where}: filter {config.name or config.type!r} fails to build: "
                    f"{type(e).__name__}: {_one_line(e)}"
                )
    return problems


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
