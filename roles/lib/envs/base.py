"""The environment API: an ``Environment`` is a ``Taskset``, a ``Harness`` and a ``Rubric``.

Shaped after verifiers / prime-rl environments, kept pure so each part is unit-testable
without a model or a bus:

- ``Taskset``: deterministic tasks in ``train`` and ``eval`` splits, generated locally
  from a seed (no downloads). ``task(split, index)`` is a JSON-able dict; the same
  (seed, split, index) gives the same task in every process (seeds come from
  ``schemas.stable_seed``, never Python's ``hash()``). ``GeneratedTaskset`` keeps the
  splits disjoint by assigning every task to a split by a stable hash of its key.
  ``ListTaskset`` holds given tasks: a Python list, or ``ListTaskset.from_file`` (JSONL
  or Parquet) or ``from_dataset`` (a local ``datasets.Dataset``); each task's split is
  the same stable hash of its JSON (or the splits are given).
- ``Harness``: the conversation protocol. The opening messages (system prompt + first
  user message), the env's feedback after each assistant turn
  (``env_response(messages, task, state) -> (new_messages, done)``), ``max_turns`` and
  ``min_turns`` (a done before it is overridden: ``roles.lib.envs.harness``), and
  ``reference_answer(messages, task)``: what a perfect policy would reply next (a
  scripted teacher uses it), and ``demonstration(task)``: a worked example as chat
  messages, the hint opsd-style self-distillation prepends for its teacher pass.
- ``Rubric``: named reward functions with weights. ``score`` gives ``rewards`` (each
  function), ``reward`` (the weighted sum divided by the sum of weights) and ``metrics``
  (the functions with weight 0, as in verifiers, plus extra metric functions). A
  function may be ``async`` (a judge that asks a model): the harness awaits
  ``ascore``; ``score`` runs them to completion where no event loop runs (replay).
  ``group_funcs`` score a whole group at once (comparative or pairwise judgements, as
  verifiers' group reward functions): ``(messages of each rollout, task, state of each
  rollout) -> one value per rollout``, run by the env server once every rollout of the
  group is done (``roles.lib.envs.group``). They share ``weights`` with ``funcs`` (one
  name space; weight 0 = a metric), and ``score_group`` folds their values into each
  rollout's ``Score``: ``reward`` is then the weighted mean over both kinds.

An ``Environment`` also declares its ``members`` (multi-agent envs name the agents
whose messages carry ``Message.member``; single-agent envs leave it empty) and which of
them are ``judges``; the other members are its ``seats``, where a learner may sit. Its
harness's ``speaker(turn)`` names who writes each assistant turn: the ``schedule`` when
it has one (members in turn order, a member may speak several turns in a row; the
rollout ends after its last entry), else round robin over the members. Its
``state_columns`` name state keys the harness records on the trace after scoring
(``Trace.state``: JSON-able values, queryable in the lake; a run's config may add more,
``make_env(..., state_columns=)``), and its harness's ``tools``
are the OpenAI function schemas the chat template shows the model (HF templates).

Messages are OpenAI-style dicts ``{"role": ..., "content": ...}``. An assistant message
the model ended with tool calls carries ``"tool_calls": [{"id", "type": "function",
"function": {"name", "arguments": JSON object text}}]`` (parsed by the harness, ids
derived from the rollout and turn); the env answers each with ``{"role": "tool",
"tool_call_id": id, "content": ...}`` (``"name"`` optional: the harness fills it in from
the call). The token-level rollout loop lives in ``roles.lib.envs.harness``; an env never
sees tokens.

Errors. An exception from env code is a bug: the harness raises ``EnvCodeError`` out of
the rollout (the env server dead-letters the task). A reply the env cannot read is not
a bug: ``env_response`` raises ``ParseError`` (optionally with feedback messages), the
harness masks that turn (its tokens never train), records a ``parse_error`` turn error
and goes on with the feedback, or ends the rollout without one. The harness itself
raises the same for a reply that starts a tool call that does not parse, and still
hands the raw reply to ``env_response``.

    env = make_env("reverse-text", {})            # roles.lib.envs.registry
    task = env.task("train", 0)
    msgs = env.initial_messages(task)
    msgs.append({"role": "assistant", "content": env.reference_answer(msgs, task)})
    assert env.score(msgs, task, env.init_state(task)).reward == 1.0
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import numbers
import random
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from traceback import format_exception
from typing import Any

from schemas import stable_seed

ChatMessage = dict[str, Any]
Messages = list[ChatMessage]
State = dict[str, Any]
# A reward or metric function: (messages, task, state) -> float (or an awaitable of one).
RewardFn = Callable[[Messages, dict[str, Any], State], float | Awaitable[float]]
# A group reward function: (each rollout's messages, the task, each rollout's state), the
# group's finished rollouts in sample order -> one float per rollout (or an awaitable).
GroupRewardFn = Callable[
    [list[Messages], dict[str, Any], list[State]], Sequence[float] | Awaitable[Sequence[float]]
]

SPLITS = ("train", "eval")


class EnvCodeError(Exception):
    """A bug in env code: one of its hooks raised, or it broke the env contract.

    ``run_rollout`` raises it instead of recording an errored trace: a retry would fail
    the same way, so the env server dead-letters the task with ``traceback`` (the text of
    where env code raised; "" for a contract violation found by the harness).
    """

    def __init__(self, env: str, error_type: str, message: str, traceback: str = "") -> None:
        self.env, self.error_type, self.message, self.traceback = (
            env,
            error_type,
            message,
            traceback,
        )
        line = " ".join(message.split())  # one line, whatever the exception's text
        super().__init__(f"env {env!r} raised {error_type}: {line}")

    @classmethod
    def from_exception(cls, env: str, error: BaseException) -> EnvCodeError:
        text = "".join(format_exception(error))
        return cls(env, type(error).__name__, str(error), text)


class ParseError(Exception):
    """Raised by ``env_response``: the last assistant reply cannot be read (a malformed
    tool call, an answer in no known shape). Not a bug: the harness masks that turn (its
    tokens never train), records a ``parse_error`` turn error with ``str(self)`` and goes
    on with ``feedback`` (the env's messages, e.g. a tool message saying what was wrong),
    or ends the rollout when ``feedback`` is None."""

    def __init__(self, message: str, feedback: Messages | None = None) -> None:
        super().__init__(message)
        self.feedback = feedback


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    return split


def last_answer(messages: Sequence[ChatMessage]) -> str:
    """The content of the last assistant message ("" if the assistant never spoke)."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return str(m.get("content", ""))
    return ""


def assistant_answers(messages: Sequence[ChatMessage]) -> list[str]:
    return [str(m.get("content", "")) for m in messages if m.get("role") == "assistant"]


# -- tasksets ---------------------------------------------------------------------------


class Taskset:
    """Deterministic tasks in a ``train`` and an ``eval`` split."""

    def size(self, split: str) -> int:
        raise NotImplementedError

    def task(self, split: str, index: int) -> dict[str, Any]:
        raise NotImplementedError

    def _check_index(self, split: str, index: int) -> None:
        n = self.size(check_split(split))
        if not 0 <= index < n:
            raise IndexError(f"task index {index} out of range for split {split!r} (size {n})")


def split_of_key(key: str, eval_fraction: float) -> str:
    """The split a task belongs to, from a stable hash of its key: the splits never overlap."""
    h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return "eval" if (h % 1_000_000) < eval_fraction * 1_000_000 else "train"


class GeneratedTaskset(Taskset):
    """Tasks drawn from a seeded generator; a task's split is decided by its key's hash.

    Task ``(split, index)`` is the first candidate drawn with seeds
    ``stable_seed(seed, split, index, attempt)`` (attempt = 0, 1, ...) whose key falls in
    ``split``: deterministic, independent of the process, and the two splits are
    disjoint by construction (duplicates *within* a split are allowed).
    """

    def __init__(
        self,
        seed: int = 0,
        train_size: int = 100_000,
        eval_size: int = 1_000,
        eval_fraction: float = 0.1,
    ) -> None:
        if not 0.0 < eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
        self.seed = seed
        self.sizes = {"train": int(train_size), "eval": int(eval_size)}
        self.eval_fraction = eval_fraction

    def size(self, split: str) -> int:
        return self.sizes[check_split(split)]

    def generate(self, rng: random.Random) -> dict[str, Any]:
        """One candidate task (JSON-able) from a seeded generator."""
        raise NotImplementedError

    def key(self, task: dict[str, Any]) -> str:
        """What makes two tasks the same task (decides the split)."""
        raise NotImplementedError

    def task(self, split: str, index: int) -> dict[str, Any]:
        self._check_index(split, index)
        for attempt in range(10_000):
            candidate = self.generate(random.Random(stable_seed(self.seed, split, index, attempt)))
            if split_of_key(self.key(candidate), self.eval_fraction) == split:
                return candidate
        raise RuntimeError(f"no {split} task found for index {index} (is the task space tiny?)")


class ListTaskset(Taskset):
    """Given tasks (JSON-able dicts): each goes to a split by a stable hash of its JSON
    (``split_of_key``, as generated tasks do), or the splits are given (``eval_tasks``).
    Order within a split is the given order, so index ``i`` is always the same task.

        ListTaskset([{"question": "2+2?", "answer": "4"}, ...])
        ListTaskset.from_file("tasks.jsonl")          # or .parquet
        ListTaskset.from_dataset(datasets.load_from_disk("my-ds"))
    """

    def __init__(
        self,
        tasks: Iterable[dict[str, Any]],
        eval_fraction: float = 0.1,
        eval_tasks: Iterable[dict[str, Any]] | None = None,
    ) -> None:
        items = list(tasks)
        for k, t in enumerate(items):
            if not isinstance(t, dict):
                raise TypeError(f"task {k} is {type(t).__name__}, not a dict")
            json.dumps(t)  # JSON-able (else TypeError): a task travels in TaskRequested events
        tasks = [dict(t) for t in items]
        if eval_tasks is not None:
            self.splits = {"train": tasks, "eval": [dict(t) for t in eval_tasks]}
        else:
            if not 0.0 <= eval_fraction < 1.0:
                raise ValueError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
            self.splits = {"train": [], "eval": []}
            for t in tasks:
                key = json.dumps(t, sort_keys=True, ensure_ascii=False)
                self.splits[split_of_key(key, eval_fraction)].append(t)

    @classmethod
    def from_file(cls, path: str | Path, **kwargs: Any) -> ListTaskset:
        """Tasks from a JSONL file (one object per line) or a Parquet file (one row each)."""
        path = Path(path)
        if path.suffix == ".parquet":
            import polars as pl

            return cls(pl.read_parquet(path).to_dicts(), **kwargs)
        lines = path.read_text().splitlines()
        return cls((json.loads(line) for line in lines if line.strip()), **kwargs)

    @classmethod
    def from_dataset(cls, dataset: Iterable[dict[str, Any]], **kwargs: Any) -> ListTaskset:
        """Tasks from a ``datasets.Dataset`` (or any iterable of row dicts)."""
        return cls((dict(row) for row in dataset), **kwargs)

    def size(self, split: str) -> int:
        return len(self.splits[check_split(split)])

    def task(self, split: str, index: int) -> dict[str, Any]:
        self._check_index(split, index)
        return dict(self.splits[split][index])


# -- harness ----------------------------------------------------------------------------


class Harness:
    """The conversation protocol: opening messages, env feedback, when it ends.

    The default is single-turn: the env never answers, the rollout ends after the
    first assistant message.
    """

    max_turns: int = 1
    # The fewest assistant turns of a rollout: the env's ``done`` before this many is
    # overridden (its messages are rendered as feedback and the next turn is generated);
    # ``max_turns`` still ends a rollout. A run may set it per env (``min_turns``).
    min_turns: int = 1
    # Multi-agent: the members taking turns (told which one they are by the
    # conversation); () = a single agent. Each member is played by the model the run
    # binds it to (the policy by default); ``judges`` are members that judge the others
    # and never train unless the env's ``drop_judge`` is off.
    members: tuple[str, ...] = ()
    judges: tuple[str, ...] = ()
    # Multi-agent: who writes each assistant turn, in order (a member may speak several
    # turns in a row: ``("a", "a", "b")``); the rollout ends after its last entry (or at
    # ``max_turns``, whichever comes first). () = round robin over ``members`` until
    # ``max_turns``. A run may set it per env (``schedule``).
    schedule: tuple[str, ...] = ()
    # State keys recorded on the trace after scoring (``Trace.state``; JSON-able values).
    state_columns: tuple[str, ...] = ()
    # OpenAI function schemas of the tools the env answers (``{"type": "function",
    # "function": {"name", "description", "parameters"}}``), shown by HF chat templates.
    # Only an env that declares tools gets the model's replies parsed into tool calls.
    tools: tuple[dict[str, Any], ...] = ()

    def speaker(self, turn: int) -> str | None:
        """The member who writes assistant turn ``turn`` (0-based): the ``schedule``'s
        entry (None past its end: the rollout is over), else round robin."""
        if self.schedule:
            return self.schedule[turn] if turn < len(self.schedule) else None
        return self.members[turn % len(self.members)] if self.members else None

    def __init__(self, system_prompt: str | None = None) -> None:
        self.system_prompt = system_prompt

    def user_prompt(self, task: dict[str, Any]) -> str:
        raise NotImplementedError

    def initial_messages(self, task: dict[str, Any]) -> Messages:
        msgs: Messages = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs.append({"role": "user", "content": self.user_prompt(task)})
        return msgs

    def init_state(self, task: dict[str, Any]) -> State:
        return {}

    def env_response(
        self, messages: Messages, task: dict[str, Any], state: State
    ) -> tuple[Messages, bool]:
        """The env's messages after an assistant turn, and whether the episode is over
        (``ParseError``: the turn cannot be read; see the module docstring)."""
        return [], True

    def reference_answer(self, messages: Messages, task: dict[str, Any]) -> str:
        """What a perfect policy would reply to ``messages`` (for a scripted teacher)."""
        raise NotImplementedError

    def solve(self, messages: Messages) -> str:
        """The perfect next reply from the conversation alone (what the model sees).

        The scripted teacher uses this: it speaks the inference protocol, so it sees only
        the prompt tokens, never the task record.
        """
        raise NotImplementedError(f"{type(self).__name__} has no solver from messages")

    def demonstration(self, task: dict[str, Any]) -> Messages | None:
        """A worked example of ``task`` as chat messages, or None if the env has none.

        opsd-style self-distillation prepends these messages to the conversation as a
        hint, so the same model scores the student's tokens knowing how to solve the
        task. The default is one user message ``"Example: <opening user content> ->
        <reference answer>"`` built from ``initial_messages`` and ``reference_answer``;
        None when the harness has no ``reference_answer``. Multi-turn envs whose first
        reference answer is not the solution should override it.
        """
        opening = self.initial_messages(task)
        users = [m for m in opening if m.get("role") == "user"]
        if not users:
            return None
        try:
            answer = self.reference_answer(opening, task)
        except NotImplementedError:
            return None
        return [{"role": "user", "content": f"Example: {users[-1]['content']} -> {answer}"}]


# -- rubric -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Score:
    reward: float
    rewards: dict[str, float]
    metrics: dict[str, float]
    member_rewards: dict[str, float] = field(default_factory=dict)  # multi-agent envs


@dataclass
class Rubric:
    """Named reward functions with weights (weight 0 = reported as a metric only).

    ``group_funcs`` score the finished rollouts of a group together (``score_group``);
    their names share ``weights`` with ``funcs`` and must differ from them. A rubric may
    hold group functions only (its per-rollout ``reward`` is then 0 until grouped).
    """

    funcs: Mapping[str, RewardFn]
    weights: Mapping[str, float] = field(default_factory=dict)  # missing name = weight 1
    # Multi-agent envs: each member's own reward (``Trace.member_rewards``), by member.
    member_funcs: Mapping[str, RewardFn] = field(default_factory=dict)
    metric_funcs: Mapping[str, Callable[[Messages, dict[str, Any], State], dict[str, float]]] = (
        field(default_factory=dict)
    )
    group_funcs: Mapping[str, GroupRewardFn] = field(default_factory=dict)

    def __post_init__(self) -> None:
        shared = sorted(set(self.funcs) & set(self.group_funcs))
        if shared:
            raise ValueError(f"names of both a reward and a group function: {shared}")
        unknown = set(self.weights) - set(self.funcs) - set(self.group_funcs)
        if unknown:
            raise ValueError(f"weights for unknown reward functions: {sorted(unknown)}")
        if any(w < 0 for w in self.weights.values()):
            raise ValueError("reward weights must be >= 0")
        if not any(self.weight(n) > 0 for n in (*self.funcs, *self.group_funcs)):
            raise ValueError("a rubric needs at least one reward function with weight > 0")

    def weight(self, name: str) -> float:
        return float(self.weights.get(name, 1.0))

    def total(self, rewards: Mapping[str, float]) -> float:
        """The reward: the weighted mean of ``rewards`` (named values of weight > 0, summed
        in their order), 0.0 when there are none."""
        total = 0.0
        norm = 0.0
        for name, value in rewards.items():
            w = self.weight(name)
            total += w * value
            norm += w
        return total / norm if norm else 0.0

    def _functions(self) -> list[tuple[str, str, Callable[..., Any]]]:
        """(kind, name, function) of every per-rollout function, in the order they run."""
        return [
            *(("reward", n, f) for n, f in self.funcs.items()),
            *(("metrics", n, f) for n, f in self.metric_funcs.items()),
            *(("member", n, f) for n, f in self.member_funcs.items()),
        ]

    def score(self, messages: Messages, task: dict[str, Any], state: State) -> Score:
        """Every function in order. An async one runs to completion here when no event
        loop runs (rubric replay, scripts); inside one, ``await ascore``."""
        values = {}
        for kind, name, fn in self._functions():
            values[kind, name] = _now(kind, name, fn(messages, task, state))
        return self._combine(values)

    async def ascore(self, messages: Messages, task: dict[str, Any], state: State) -> Score:
        """Every function in order, awaiting those that are async."""
        values = {}
        for kind, name, fn in self._functions():
            value = fn(messages, task, state)
            values[kind, name] = await value if inspect.isawaitable(value) else value
        return self._combine(values)

    def _combine(self, values: dict[tuple[str, str], Any]) -> Score:
        rewards: dict[str, float] = {}
        metrics: dict[str, float] = {}
        for name in self.funcs:
            value = float(values["reward", name])
            if self.weight(name) > 0:
                rewards[name] = value
            else:
                metrics[name] = value
        for name in self.metric_funcs:
            metrics.update({k: float(v) for k, v in values["metrics", name].items()})
        members = {m: float(values["member", m]) for m in self.member_funcs}
        return Score(
            reward=self.total(rewards), rewards=rewards, metrics=metrics, member_rewards=members
        )

    def score_group(
        self,
        messages: Sequence[Messages],
        task: dict[str, Any],
        states: Sequence[State],
        scores: Sequence[Score],
    ) -> list[Score]:
        """Each rollout's ``Score`` with the group functions' values folded in.

        ``messages``, ``states`` and ``scores`` (``score``'s) are the group's finished
        rollouts, in sample order. Each group function runs once, in order, and must
        return one number per rollout. Its value goes to ``rewards`` (weight > 0) or
        ``metrics`` (weight 0) under its name, after the per-rollout functions'; the
        reward is ``total`` over both. Async functions run as ``score`` runs them."""
        values = {}
        for name, fn in self.group_funcs.items():
            values[name] = _now(
                "group", name, fn(list(messages), task, list(states)), "ascore_group"
            )
        return self._fold_group(values, scores)

    async def ascore_group(
        self,
        messages: Sequence[Messages],
        task: dict[str, Any],
        states: Sequence[State],
        scores: Sequence[Score],
    ) -> list[Score]:
        """``score_group``, awaiting the group functions that are async."""
        values = {}
        for name, fn in self.group_funcs.items():
            value = fn(list(messages), task, list(states))
            values[name] = await value if inspect.isawaitable(value) else value
        return self._fold_group(values, scores)

    def _fold_group(self, values: dict[str, Any], scores: Sequence[Score]) -> list[Score]:
        n = len(scores)
        checked = {name: _group_values(name, v, n) for name, v in values.items()}
        out = []
        for i, score in enumerate(scores):
            rewards, metrics = dict(score.rewards), dict(score.metrics)
            for name, vs in checked.items():
                (rewards if self.weight(name) > 0 else metrics)[name] = vs[i]
            out.append(Score(reward=self.total(rewards), rewards=rewards, metrics=metrics,
                             member_rewards=dict(score.member_rewards)))  # fmt: skip
        return out


def _now(kind: str, name: str, value: Any, method: str = "ascore") -> Any:
    """A function's value in code that cannot await: an awaitable is run to completion
    when no event loop runs, refused inside one (await ``Rubric.<method>`` there)."""
    if not inspect.isawaitable(value):
        return value
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(_awaited(value))
    if inspect.iscoroutine(value):
        value.close()
    raise RuntimeError(
        f"{kind} function {name!r} is async: await Rubric.{method} in an event loop"
    ) from None


def _group_values(name: str, values: Any, n: int) -> list[float]:
    """A group function's result as ``n`` floats, else ``TypeError``/``ValueError`` (the
    env's bug)."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"group function {name!r} returned {values!r}, not a list of numbers")
    if len(values) != n:
        raise ValueError(f"group function {name!r} returned {len(values)} values for {n} rollouts")
    if not all(isinstance(v, numbers.Real) for v in values):
        raise TypeError(f"group function {name!r} returned {values!r}, not a list of numbers")
    return [float(v) for v in values]


async def _awaited(value: Awaitable[Any]) -> Any:
    return await value


# -- environment ------------------------------------------------------------------------


def members_problem(
    env: str, members: Sequence[str], judges: Sequence[str], rewarded: Sequence[str]
) -> str | None:
    """Why env ``env`` cannot run with ``members``, ``judges`` among them and a rubric
    that rewards the members ``rewarded`` (``Rubric.member_funcs``), or None."""
    if any(not isinstance(m, str) or not m.strip() for m in members):
        return f"env {env!r}: a member has an empty name (members: {list(members)})"
    if twice := sorted({m for m in members if list(members).count(m) > 1}):
        return f"env {env!r}: members {twice} are listed twice (members: {list(members)})"
    if unknown := sorted(set(judges) - set(members)):
        return f"env {env!r}: judges {unknown} are not members"
    if unknown := sorted(set(rewarded) - set(members)):
        return (
            f"env {env!r}: its rubric rewards {unknown}, which are not members "
            f"(members: {list(members)})"
        )
    return None


def schedule_problem(env: str, members: Sequence[str], schedule: Sequence[str]) -> str | None:
    """Why ``schedule`` cannot order the turns of env ``env`` with ``members``, or None."""
    if not schedule:
        return None
    if not members:
        return f"env {env!r} declares no members: a schedule names the member of each turn"
    unknown = [m for m in dict.fromkeys(schedule) if m not in members]
    if unknown:
        return f"{unknown} in the schedule of {env!r} are not members (members: {list(members)})"
    return None


class Environment:
    """A taskset, a harness and a rubric under one name."""

    def __init__(
        self,
        name: str,
        taskset: Taskset,
        harness: Harness,
        rubric: Rubric,
        args: dict[str, Any] | None = None,
        *,
        members: tuple[str, ...] = (),
        judges: tuple[str, ...] = (),
        state_columns: tuple[str, ...] = (),
    ) -> None:
        self.name = name
        self.taskset = taskset
        self.harness = harness
        self.rubric = rubric
        self.args = dict(args or {})
        # Multi-agent envs name their members (the values of Message.member); () = one
        # agent. Default: the harness's members.
        self.members = tuple(members) or tuple(harness.members)
        self.judges = tuple(judges) or tuple(harness.judges)
        self.state_columns = tuple(state_columns) or tuple(harness.state_columns)
        for why in (
            members_problem(name, self.members, self.judges, tuple(rubric.member_funcs)),
            schedule_problem(name, self.members, harness.schedule),
        ):
            if why:
                raise ValueError(why)

    @property
    def seats(self) -> tuple[str, ...]:
        """The members a learner may sit in: every member but the judges."""
        return tuple(m for m in self.members if m not in self.judges)

    def __repr__(self) -> str:
        return f"Environment({self.name!r}, args={self.args})"

    # taskset
    def size(self, split: str) -> int:
        return self.taskset.size(split)

    def task(self, split: str, index: int) -> dict[str, Any]:
        return self.taskset.task(split, index)

    # harness
    @property
    def system_prompt(self) -> str | None:
        return self.harness.system_prompt

    @property
    def max_turns(self) -> int:
        """The env's own turn limit: its schedule's length when it has one (a schedule is
        the whole turn plan), else its harness's ``max_turns``."""
        return len(self.harness.schedule) or self.harness.max_turns

    @property
    def min_turns(self) -> int:
        return self.harness.min_turns

    @property
    def schedule(self) -> tuple[str, ...]:
        return tuple(self.harness.schedule)

    def turn_limit(self, max_turns: int | None = None) -> int:
        """The most assistant turns of a rollout: a run's ``max_turns`` (None: the env's
        own), never past the end of the schedule."""
        limit = max_turns or self.max_turns
        return min(limit, len(self.harness.schedule)) if self.harness.schedule else limit

    @property
    def tools(self) -> tuple[dict[str, Any], ...]:
        return tuple(self.harness.tools)

    def initial_messages(self, task: dict[str, Any]) -> Messages:
        return self.harness.initial_messages(task)

    def init_state(self, task: dict[str, Any]) -> State:
        return self.harness.init_state(task)

    def env_response(
        self, messages: Messages, task: dict[str, Any], state: State
    ) -> tuple[Messages, bool]:
        return self.harness.env_response(messages, task, state)

    def reference_answer(self, messages: Messages, task: dict[str, Any]) -> str:
        return self.harness.reference_answer(messages, task)

    def solve(self, messages: Messages) -> str:
        return self.harness.solve(messages)

    def demonstration(self, task: dict[str, Any]) -> Messages | None:
        return self.harness.demonstration(task)

    def speaker(self, turn: int) -> str | None:
        return self.harness.speaker(turn) if self.members else None

    # rubric
    def score(self, messages: Messages, task: dict[str, Any], state: State) -> Score:
        return self.rubric.score(messages, task, state)

    async def ascore(self, messages: Messages, task: dict[str, Any], state: State) -> Score:
        if type(self).score is not Environment.score:  # a subclass that scores its own way
            return self.score(messages, task, state)
        return await self.rubric.ascore(messages, task, state)

    @property
    def group_scored(self) -> bool:
        """Whether the group's rollouts are scored together (``score_group``): the rubric
        has group functions, or a subclass scores groups its own way."""
        return bool(self.rubric.group_funcs) or (
            type(self).score_group is not Environment.score_group
        )

    def score_group(
        self,
        messages: Sequence[Messages],
        task: dict[str, Any],
        states: Sequence[State],
        scores: Sequence[Score],
    ) -> list[Score]:
        return self.rubric.score_group(messages, task, states, scores)

    async def ascore_group(
        self,
        messages: Sequence[Messages],
        task: dict[str, Any],
        states: Sequence[State],
        scores: Sequence[Score],
    ) -> list[Score]:
        if type(self).score_group is not Environment.score_group:  # scored its own way
            return self.score_group(messages, task, states, scores)
        return await self.rubric.ascore_group(messages, task, states, scores)
