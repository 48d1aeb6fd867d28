"""The `[orchestrator]` section: what to roll out, with which algorithms, how async.

Sampling, environments, algorithms, auxiliary model endpoints (teacher, reference),
eval (its envs: train envs, or eval-only ones that are never trained on; resolved by
`OrchestratorConfig.eval_targets`) and the SFT warm start. `orchestrator_problems` holds
the cross-field rules (actor and env algorithm references, unique ids, the reserved
`policy` model key, an env's `min_turns` against its `max_turns` and `schedule`:
`_turn_problems`); `RunConfig` calls it so its messages can name full dotted paths.

`OrchestratorConfig` reads old and prime-rl spellings of its keys before validating
(`configs.deprecations.translate_orchestrator`), so a section validated on its own
(`OrchestratorConfig.model_validate(section)`) reads them as a whole file does. The
naming rules translation needs live here: `is_token` (subject tokens), `env_key` (an
env's token) and `algorithm_name` (an algorithm id's registered name: `rl` is `grpo`).
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, model_validator

from configs.errors import ConfigDeprecationWarning

# The built-in name of the model being trained; always a valid actor.
POLICY = "policy"
# Algorithm ids and model names become subject tokens and consumer names; the same rule
# as bus.subjects.check_token (configs imports no bus), checked at load, not in a role.
_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")
# Algorithm ids that run a registered algorithm of another name when the entry names
# none. `rl` is prime-rl's default loss: a group's advantages r_i - mean(r) (no division
# by the std) under the token-level importance-ratio loss with a trust region, which is
# `grpo` with its default options (`std_normalize = false`) under rlbus's trainer loss.
ALGORITHM_ALIASES: dict[str, str] = {"rl": "grpo"}


def is_token(value: str) -> bool:
    """Whether ``value`` may name subjects and consumers (an algorithm id, a model name)."""
    return bool(_TOKEN.match(value))


def env_key(env_id: str) -> str:
    """An env's token on subjects and consumer names (``bus.subjects.token_for``)."""
    from bus.subjects import token_for  # a pure string function; keeps configs light

    return token_for(env_id)


def algorithm_name(algorithm_id: str, name: str | None) -> str:
    """The registered algorithm an algorithm id runs: ``name``, else the id's alias
    (`ALGORITHM_ALIASES`), else the id itself."""
    return name if name is not None else ALGORITHM_ALIASES.get(algorithm_id, algorithm_id)


class _Section(BaseModel):
    # Unknown keys are typos until proven otherwise: fail loudly, naming the key.
    model_config = ConfigDict(extra="forbid")


class SamplingConfig(_Section):
    """How completions are sampled during training rollouts."""

    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)  # 0 = off
    max_completion_tokens: int = Field(default=32, gt=0)
    stop: list[str] = []
    seed: int | None = None  # None = derived from the run seed and the request id


class EvalSamplingConfig(SamplingConfig):
    """Eval sampling: like training, but greedy (temperature 0) is allowed and default."""

    temperature: float = Field(default=0.0, ge=0)


class EnvSftConfig(_Section):
    """Auxiliary SFT loss on tool outputs inside RL traces (for tool-using envs)."""

    on_tool_outputs: bool = False
    alpha: float = Field(default=0.1, ge=0)  # weight of the SFT term next to the RL loss
    tool_names: list[str] | None = None  # None = every tool


def pool_bounds(replicas: int, low: int | None, high: int | None) -> tuple[int, int]:
    """A pool's (min, max) replicas (an env's servers, the policy's inference): an unset
    bound defaults to ``replicas``, so a pool with neither set is static."""
    lo = replicas if low is None else low
    return lo, max(lo, replicas) if high is None else high


class FilterConfig(_Section):
    """A rollout filter (`[[orchestrator.train.env.filters]]`, `roles.lib.envs.filters`)."""

    # A built-in detector ("gibberish", "repetition", "length") or an import path
    # "package.module:Class" of a user's detector.
    type: str = Field(min_length=1)
    name: str | None = None  # how verdicts and metrics name it; defaults to `type`
    # true: a flagged rollout never trains (it still counts in reward metrics);
    # false: monitor only, the verdict is recorded and counted.
    enforce: bool = True
    options: dict[str, Any] = {}  # the detector's thresholds (docs/configuration.md)

    @model_validator(mode="after")
    def _default_name(self) -> FilterConfig:
        if self.name is None:
            self.name = self.type.rsplit(":", 1)[-1] if ":" in self.type else self.type
        return self


class EnvConfig(_Section):
    """One training environment (`[[orchestrator.train.env]]`)."""

    id: str = Field(min_length=1)
    args: dict[str, Any] = {}
    group_size: int = Field(default=8, ge=1)  # rollouts per task; advantages are per group
    ratio: float = Field(default=1.0, gt=0)  # relative share of tasks drawn from this env
    # Per-env override; keys left out inherit `orchestrator.train.sampling` (see TrainConfig).
    sampling: SamplingConfig | None = None
    algorithms: list[str] = []  # ids from `orchestrator.algorithms`; empty = all
    max_turns: int | None = Field(default=None, ge=1)
    # No rollout ends before this many assistant turns: an env's `done` before them is
    # overridden (its messages are feedback, the next turn comes). None: the env's own.
    min_turns: int | None = Field(default=None, ge=1)
    # Multi-agent envs: the member writing each assistant turn, in order (a member may
    # speak several in a row); the rollout ends after the last. []: the env's own order.
    schedule: list[str] = []
    sft: EnvSftConfig = Field(default_factory=EnvSftConfig)
    # Multi-agent envs (docs/algorithms.md, "Members"): the model each member is played
    # by, "policy" or a key of `orchestrator.models` (unlisted members: the actor).
    members: dict[str, str] = {}
    # Who learns: None = every member played by the actor; a member name; "rotate" = a
    # seat per rollout, balanced over the env's seats. Only the learner's branch trains.
    learner_seat: str | None = None
    # The model key playing the seats the learner does not hold (None: the actor).
    opponent: str | None = None
    # Judge members never become samples (false: a judge played by the actor trains).
    drop_judge: bool = True
    filters: list[FilterConfig] = []  # rollout filters, applied by the env server
    # State keys recorded on each trace (`Trace.state`) after the env's own
    # `state_columns`: its own first, then these (duplicates dropped; a key the state
    # lacks is recorded as null).
    state_columns: list[str] = []
    # The env's server pool, started by `rlbus up`: `replicas` processes, each with
    # `max_concurrent` groups in flight (None: `env_server.groups_in_flight`). Elastic
    # when `max_replicas` > `min_replicas`: the launcher adds a replica while the env's
    # backlog stays high and retires idle ones (docs/running.md, "Env pools").
    replicas: int = Field(default=1, ge=1)
    max_concurrent: int | None = Field(default=None, ge=1)
    min_replicas: int | None = Field(default=None, ge=1)  # None: `replicas`
    max_replicas: int | None = Field(default=None, ge=1)  # None: `replicas` (static)

    @property
    def pool(self) -> tuple[int, int]:
        """(min, max) replicas of the env's server pool; equal for a static pool."""
        return pool_bounds(self.replicas, self.min_replicas, self.max_replicas)

    @property
    def servers(self) -> int:
        """Server processes `rlbus up` starts for the env (`replicas`)."""
        return self.replicas

    @property
    def key(self) -> str:
        """The env's token on subjects and consumer names (``env_key``)."""
        return env_key(self.id)


def _default_envs() -> list[EnvConfig]:
    return [EnvConfig(id="reverse-text")]


class TrainConfig(_Section):
    """Training rollouts: default sampling and the env mix."""

    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    env: list[EnvConfig] = Field(default_factory=_default_envs)

    @model_validator(mode="after")
    def _inherit_sampling(self) -> TrainConfig:
        # An env's sampling table overrides only the keys it sets; resolving the merge
        # here means every consumer (and the run.started event) sees final values, and
        # dump -> load is a fixed point because the merged table sets every key.
        self.env = [_with_merged_sampling(env, self.sampling) for env in self.env]
        return self


# A config entry with a sampling table that inherits the keys it leaves out.
_Entry = TypeVar("_Entry", "EnvConfig", "EvalEnvConfig")


def _with_merged_sampling(env: _Entry, base: SamplingConfig) -> _Entry:
    if env.sampling is None:
        return env
    explicit = {name: getattr(env.sampling, name) for name in env.sampling.model_fields_set}
    return env.model_copy(update={"sampling": base.model_copy(update=explicit)})


class AlgorithmConfig(_Section):
    """One algorithm worker (`[[orchestrator.algorithms]]`)."""

    id: str = Field(min_length=1)  # unique within the run; envs refer to it
    # Registered algorithm name; defaults to `id` (`algorithm_name`: id "rl" runs "grpo").
    name: str | None = None
    options: dict[str, Any] = {}
    shadow: bool = False  # scores samples (for metrics/comparison) that are never trained on
    # Groups the worker scores at once while it waits on a model's logprobs (opd, opsd:
    # stateless algorithms that ask a reference): their score requests overlap. A stateful
    # algorithm (rae) folds each group into the next and one that asks no model has
    # nothing to wait on: both score one group at a time.
    max_concurrent: int = Field(default=4, ge=1)

    @model_validator(mode="after")
    def _default_name(self) -> AlgorithmConfig:
        self.name = algorithm_name(self.id, self.name)
        return self


class ModelEndpointConfig(_Section):
    """An auxiliary model served next to the policy (`[orchestrator.models.<key>]`)."""

    kind: Literal["policy", "teacher", "reference"] = "reference"
    path: str | None = None  # None = the frozen base weights at `model.path`
    # A frozen snapshot of the policy (kind "reference", no path): serves the weights the
    # trainer published as this version, following the policy until then (0: the
    # initial weights). The trainer keeps that version's weights for the whole run.
    policy_version: int | None = Field(default=None, ge=0)
    subject_model: str | None = None  # inference model name it answers on; defaults to the key


class EvalEnvConfig(_Section):
    """One env evaluated during the run (`[[orchestrator.eval.env]]`): a train env, by its
    id, or any other registered env, which the run then evaluates and never trains on."""

    id: str = Field(min_length=1)
    num_tasks: int | None = Field(default=None, ge=1)  # None: `orchestrator.eval.num_tasks`
    # Keys left out inherit `orchestrator.eval.sampling` (merged at load, see EvalConfig).
    sampling: EvalSamplingConfig | None = None
    # None: a train env's own `args` / `max_turns`; an eval-only env's: none.
    args: dict[str, Any] | None = None
    max_turns: int | None = Field(default=None, ge=1)
    # An eval-only env's `min_turns` and `schedule` (as `EnvConfig`'s); a train env's come
    # from its train entry, whose servers answer its evals.
    min_turns: int | None = Field(default=None, ge=1)
    schedule: list[str] = []
    # An eval-only env's server pool, started by `rlbus up` (a train env's eval requests go
    # to its train pool, so setting these on a train env is an error).
    replicas: int | None = Field(default=None, ge=1)  # None: 1
    max_concurrent: int | None = Field(default=None, ge=1)  # None: `env_server.groups_in_flight`
    # An eval-only env's extra state columns (as `EnvConfig.state_columns`); a train env's
    # come from its train entry, whose servers answer its evals.
    state_columns: list[str] = []

    @property
    def servers(self) -> int:
        """Server processes of an eval-only env (`replicas`, else 1)."""
        return self.replicas or 1

    @property
    def pool(self) -> tuple[int, int]:
        """(min, max) replicas of an eval-only env's server pool: static."""
        return self.servers, self.servers

    @property
    def key(self) -> str:
        """The env's token on subjects and consumer names (``env_key``)."""
        return env_key(self.id)


class EvalConfig(_Section):
    """Periodic evaluation on held-out tasks."""

    interval: int = Field(default=10, ge=0)  # every N trainer steps; 0 = off
    num_tasks: int = Field(default=32, ge=1)
    k: int = Field(default=1, ge=1)  # samples per task
    sampling: EvalSamplingConfig = Field(default_factory=EvalSamplingConfig)
    # The envs evaluated: empty = every train env; otherwise exactly these (a train env by
    # its id, or an eval-only env). Was `envs = [ids]` (configs/deprecations.py).
    env: list[EvalEnvConfig] = []
    at_start: bool = True  # also evaluate policy version 0
    # Multi-agent envs with a learner seat: the seat the learner plays in eval (None: the
    # env's own `learner_seat` rule, e.g. "rotate": both sides, balanced).
    learner_seat: str | None = None

    @model_validator(mode="after")
    def _inherit_sampling(self) -> EvalConfig:
        # As TrainConfig's: every consumer (and run.started) sees the merged tables.
        self.env = [_with_merged_sampling(env, self.sampling) for env in self.env]
        return self


@dataclass(frozen=True)
class EvalTarget:
    """One env a run evaluates, resolved (``OrchestratorConfig.eval_targets``): what its
    eval requests carry. ``train`` is the train entry (None: an eval-only env)."""

    id: str
    key: str
    num_tasks: int
    sampling: EvalSamplingConfig
    args: dict[str, Any]
    max_turns: int | None
    train: EnvConfig | None


class WarmupConfig(_Section):
    """SFT warm start: steps trained on another model's rollouts before RL begins."""

    steps: int = Field(default=0, ge=0)  # 0 = no warm start
    actor: str = "teacher"  # key of `orchestrator.models` that rolls out during warmup
    algorithms: list[str] = ["sft"]  # registered algorithm names used during warmup
    lr: float | None = Field(default=None, gt=0)  # None = `trainer.lr`
    # Rollouts per task while warming up: a deterministic teacher gives identical copies,
    # so one per task shows the student the most distinct examples per batch.
    group_size: int = Field(default=1, ge=1)


def _default_algorithms() -> list[AlgorithmConfig]:
    return [AlgorithmConfig(id="grpo")]


class OrchestratorConfig(_Section):
    """Batching, the two asynchrony bounds, and everything rolled out."""

    batch_size: int = Field(default=32, ge=1)  # samples per trainer step
    # Policy versions rollout generation may run ahead of the trainer (0 = on-policy).
    max_async_level: int = Field(default=1, ge=0)
    # Samples from a policy older than this many versions are dropped and counted.
    max_off_policy_steps: int = Field(default=2, ge=0)
    max_groups_in_flight: int = Field(default=16, ge=1)
    skip_zero_advantage_groups: bool = True
    max_no_signal_batches: int = Field(default=5, ge=1)  # stop after this many signal-free batches
    # Stop (reason "rollouts_filtered", naming the filter) after this many batches' worth of
    # RL groups in a row had every rollout filtered: each such group is regenerated (a new
    # one is dispatched in its place) until then. 0 = never.
    max_filtered_batches: int = Field(default=5, ge=0)
    # A warning (log line `batch.low_trainable_share`, naming the filter) when fewer than
    # this share of the rollouts scored for an RL batch could train (errored or filtered
    # ones cannot); each batch's `trainable_share` metric says it. 0 = never.
    min_trainable_share: float = Field(default=0.5, ge=0, le=1)
    # A train group not fully scored this long after the orchestrator saw it dispatched is
    # released ("deadline"): its slot frees, nothing of it trains.
    group_timeout_s: float = Field(default=600.0, gt=0)
    # An attached training algorithm (`rlbus algorithm attach`) whose worker shows no
    # heartbeat this long after the orchestrator saw its attach is detached (reason "no
    # worker ..."): groups never wait on a worker that is not there.
    attach_timeout_s: float = Field(default=30.0, gt=0)
    # A stall: no batch for `stall_factor` x the median recent step time, and at least
    # `stall_min_s`. It is reported (log line, `rlbus status`, the live view) with what
    # the run waits for; a stall longer than `stall_stop_s` stops the run (reason "stalled").
    stall_factor: float = Field(default=5.0, gt=0)
    stall_min_s: float = Field(default=30.0, gt=0)
    stall_stop_s: float = Field(default=900.0, gt=0)
    # Rollouts that only error: no trainer step and not one rollout that could train for
    # this long, while rollouts keep erroring, stops the run (reason "rollout_errors")
    # naming the most frequent error, long before a stall would (0 = never).
    error_stop_s: float = Field(default=120.0, ge=0)
    # Tasks dead-lettered because env code raised (a bug, not a flaky model) before the
    # run stops with reason "env_error", naming the env and the error.
    max_env_errors: int = Field(default=3, ge=1)
    actor: str = POLICY
    train: TrainConfig = Field(default_factory=TrainConfig)
    algorithms: list[AlgorithmConfig] = Field(default_factory=_default_algorithms)
    models: dict[str, ModelEndpointConfig] = {}
    eval: EvalConfig = Field(default_factory=EvalConfig)
    warmup: WarmupConfig = Field(default_factory=WarmupConfig)

    @model_validator(mode="before")
    @classmethod
    def _translate(cls, data: Any, info: ValidationInfo) -> Any:
        # Old and prime-rl spellings of this section's keys, each warned once. A whole
        # config is translated before it is validated (configs.deprecations
        # .translate_deprecated, which warns): it passes TRANSLATED, so nothing is
        # translated, or warned, twice. Imported here: deprecations imports this module.
        from configs.deprecations import TRANSLATED, translate_orchestrator

        if not isinstance(data, dict) or (info.context or {}).get(TRANSLATED):
            return data
        translated, messages = translate_orchestrator(data)
        for msg in messages:
            warnings.warn(msg, ConfigDeprecationWarning, stacklevel=2)
        return translated

    # -- lookups and routing (one place for each; roles and replay ask these) ------------

    def env(self, id_or_key: str) -> EnvConfig | None:
        """The train env with this id, or with this subject key (None if not configured)."""
        envs = self.train.env
        return next((e for e in envs if e.id == id_or_key), None) or next(
            (e for e in envs if e.key == id_or_key), None
        )

    def eval_targets(self) -> list[EvalTarget]:
        """The envs this run evaluates, in order, resolved: `eval.env` (empty: every
        train env with the eval defaults), each taking what it leaves unset from
        `eval` and from its train entry, if it has one."""
        e = self.eval
        entries = e.env or [EvalEnvConfig(id=env.id) for env in self.train.env]
        out = []
        for entry in entries:
            train = self.env(entry.id)
            out.append(
                EvalTarget(
                    id=entry.id,
                    key=entry.key,
                    num_tasks=entry.num_tasks or e.num_tasks,
                    sampling=entry.sampling or e.sampling,
                    args=dict(
                        entry.args if entry.args is not None else train.args if train else {}
                    ),
                    max_turns=entry.max_turns or (train.max_turns if train else None),
                    train=train,
                )
            )
        return out

    def eval_target(self, id_or_key: str) -> EvalTarget | None:
        """The evaluated env with this id, or with this subject key (None: not evaluated)."""
        targets = self.eval_targets()
        return next((t for t in targets if t.id == id_or_key), None) or next(
            (t for t in targets if t.key == id_or_key), None
        )

    def eval_only_envs(self) -> list[EvalEnvConfig]:
        """`eval.env` entries that name no train env: the run starts servers for them when
        it evaluates at all (`eval.interval` > 0), and never trains on them."""
        if self.eval.interval == 0:
            return []
        return [e for e in self.eval.env if self.env(e.id) is None]

    def served_env(self, id_or_key: str) -> EnvConfig | EvalEnvConfig | None:
        """The entry an env server of this env is configured by: its train entry, else
        its eval-only entry (None: neither; `rlbus rollout` of any env)."""
        found = self.env(id_or_key)
        if found is not None:
            return found
        only = [e for e in self.eval.env if self.env(e.id) is None]
        return next((e for e in only if e.id == id_or_key), None) or next(
            (e for e in only if e.key == id_or_key), None
        )

    def algorithm(self, algorithm_id: str) -> AlgorithmConfig | None:
        return next((a for a in self.algorithms if a.id == algorithm_id), None)

    def algorithm_spec(self, algorithm_id: str) -> tuple[str, dict[str, Any]]:
        """(registered name, options) of an algorithm id; an id absent from the config is
        taken as a registered name (or an alias of one: `rl`) with no options."""
        spec = self.algorithm(algorithm_id)
        if spec is None:
            return algorithm_name(algorithm_id, None), {}
        return algorithm_name(spec.id, spec.name), dict(spec.options)

    def routed_envs(self, algorithm_id: str) -> set[str] | None:
        """Env keys a config algorithm trains on (None: every env, e.g. a shadow, an id not
        in the config, the warm start's)."""
        spec = self.algorithm(algorithm_id)
        if spec is None or spec.shadow:
            return None
        return {e.key for e in self.train.env if not e.algorithms or algorithm_id in e.algorithms}

    def model_keys(self) -> tuple[str, ...]:
        """Every model key of the run: the policy, then ``models``' keys."""
        return (POLICY, *self.models)

    @model_validator(mode="after")
    def _default_subject_models(self) -> OrchestratorConfig:
        self.models = {
            key: m if m.subject_model else m.model_copy(update={"subject_model": key})
            for key, m in self.models.items()
        }
        return self


def _duplicates(items: list[str]) -> list[str]:
    return sorted(x for x, n in Counter(items).items() if n > 1)


def _token_problems(o: OrchestratorConfig) -> list[str]:
    """Names that go on subjects must be plain tokens: a role would fail on them at start."""
    named = [(f"orchestrator.algorithms.{i}.id", a.id) for i, a in enumerate(o.algorithms)]
    named += [(f"orchestrator.models.{k}.subject_model", m.subject_model or k)
              for k, m in o.models.items()]  # fmt: skip
    return [
        f"`{key}` = {value!r} must use letters, digits, '-' and '_' only (it names subjects)"
        for key, value in named
        if not is_token(value)
    ]


def orchestrator_problems(o: OrchestratorConfig) -> list[str]:
    """Cross-field problems of an orchestrator section, each naming its full dotted path."""
    problems: list[str] = []
    keys = sorted(o.models)
    if o.actor != POLICY and o.actor not in o.models:
        problems.append(
            f"`orchestrator.actor` = {o.actor!r} must be {POLICY!r} or a key of "
            f"`orchestrator.models` (declared: {keys or 'none'})"
        )
    if POLICY in o.models:
        problems.append(
            f"`orchestrator.models.{POLICY}`: {POLICY!r} is the model being trained, a model "
            "key of every run; an auxiliary model (a frozen copy of the policy: kind = "
            '"reference") needs a key of its own, e.g. `[orchestrator.models.ref]`'
        )
    problems += _token_problems(o)
    algo_ids = [a.id for a in o.algorithms]
    if not algo_ids:
        problems.append("`orchestrator.algorithms` must declare at least one algorithm")
    for dup in _duplicates(algo_ids):
        problems.append(f"`orchestrator.algorithms`: id {dup!r} is declared more than once")
    env_ids = [e.id for e in o.train.env]
    if not env_ids:
        problems.append("`orchestrator.train.env` must declare at least one env")
    for dup in _duplicates(env_ids):
        problems.append(f"`orchestrator.train.env`: id {dup!r} is declared more than once")
    for i, env in enumerate(o.train.env):
        for algo in env.algorithms:
            if algo not in algo_ids:
                problems.append(
                    f"`orchestrator.train.env.{i}.algorithms` names {algo!r}, which is not an "
                    f"id in `orchestrator.algorithms` (declared: {algo_ids})"
                )
    for i, env in enumerate(o.train.env):
        bound = [(f"members.{m}", k) for m, k in env.members.items()]
        for key, model in bound + [("opponent", env.opponent)]:
            if model is not None and model != POLICY and model not in o.models:
                problems.append(
                    f"`orchestrator.train.env.{i}.{key}` = {model!r} must be {POLICY!r} or a "
                    f"key of `orchestrator.models` (declared: {keys or 'none'})"
                )
    for i, env in enumerate(o.train.env):
        low, high = env.pool
        if not low <= env.replicas <= high:
            problems.append(
                f"`orchestrator.train.env.{i}.replicas` = {env.replicas} must lie within "
                f"`min_replicas`..`max_replicas` ({low}..{high})"
            )
        names = [f.name or f.type for f in env.filters]
        for dup in _duplicates(names):
            problems.append(
                f"`orchestrator.train.env.{i}.filters`: name {dup!r} is used more than once "
                "(give each filter of a type its own `name`)"
            )
    for key, m in o.models.items():
        if m.policy_version is not None and (m.kind != "reference" or m.path is not None):
            problems.append(
                f"`orchestrator.models.{key}.policy_version` is a snapshot of the policy: it "
                'needs kind = "reference" and no `path`'
            )
    for i, env in enumerate(o.train.env):
        problems += _turn_problems(f"orchestrator.train.env.{i}", env)
    problems += _eval_env_problems(o, env_ids)
    if o.warmup.steps > 0 and o.warmup.actor not in o.models:
        problems.append(
            f"`orchestrator.warmup.actor` = {o.warmup.actor!r} must be a key of "
            f"`orchestrator.models` when `orchestrator.warmup.steps` > 0 (declared: {keys or 'none'})"
        )
    return problems


def _turn_problems(where: str, env: EnvConfig | EvalEnvConfig) -> list[str]:
    """An env entry's `min_turns` against its `max_turns` and `schedule` (what the env
    allows, and whether the schedule names its members, is checked where envs are built:
    `roles.up.preflight.env_problems`)."""
    out = []
    low, high, schedule = env.min_turns, env.max_turns, env.schedule
    if low is not None and high is not None and low > high:
        out.append(f"`{where}.min_turns` = {low} exceeds `{where}.max_turns` = {high}")
    if low is not None and schedule and low > len(schedule):
        out.append(
            f"`{where}.min_turns` = {low} exceeds the {len(schedule)} turns of `{where}.schedule`"
        )
    if any(not m for m in schedule):
        out.append(f"`{where}.schedule` holds an empty member name: {schedule}")
    return out


def _eval_env_problems(o: OrchestratorConfig, train_ids: list[str]) -> list[str]:
    """`orchestrator.eval.env`: unique ids and keys (an eval-only env's key names its
    servers' consumer), no pool settings, state columns or turn settings on a train env
    (its eval requests go to the train env's own pool) and no eval `max_turns` below its
    `min_turns`, an eval-only env's `_turn_problems`. Whether an id names an env at all is
    checked where envs can be built (`roles.up.preflight.eval_env_problems`)."""
    problems = []
    entries = o.eval.env
    for dup in _duplicates([e.id for e in entries]):
        problems.append(f"`orchestrator.eval.env`: id {dup!r} is listed more than once")
    keys = [e.key for e in entries]
    for dup in _duplicates(keys):
        ids = sorted({e.id for e in entries if e.key == dup})
        if len(ids) > 1:
            problems.append(
                f"`orchestrator.eval.env`: ids {ids} share the subject key {dup!r}; "
                "evaluate one of them"
            )
    train_keys = {e.key: e.id for e in o.train.env}
    for i, entry in enumerate(entries):
        where = f"orchestrator.eval.env.{i}"
        if entry.id in train_ids:
            j = train_ids.index(entry.id)
            served = ("replicas", "max_concurrent", "state_columns", "min_turns", "schedule")
            pooled = [k for k in served if getattr(entry, k) not in (None, [])]
            for key in pooled:
                problems.append(
                    f"`{where}.{key}`: {entry.id!r} is a train env, whose eval is served "
                    f"by its train pool (set `orchestrator.train.env.{j}.{key}` instead)"
                )
            low = o.train.env[j].min_turns
            if entry.max_turns is not None and low is not None and low > entry.max_turns:
                problems.append(
                    f"`orchestrator.train.env.{j}.min_turns` = {low} exceeds "
                    f"`{where}.max_turns` = {entry.max_turns}: its eval rollouts could not "
                    "have that many turns"
                )
        elif entry.key in train_keys:
            problems.append(
                f"`{where}.id` = {entry.id!r} has the subject key of train env "
                f"{train_keys[entry.key]!r}; name that train env by its id"
            )
        else:
            problems += _turn_problems(where, entry)
    return problems
