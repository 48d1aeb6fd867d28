"""Task requests, built one way: the orchestrator's train and eval dispatches
(``train_request``, ``eval_request``: each a function of the config and a counter), the
env server's check that a request is one of those (``undispatched``), and what
``rlbus rollout`` / ``rlbus eval`` share with them (``roles.up.rollout``): sampling
parameters and seeds. ``rlbus eval`` of a checkpoint reproduces the run's eval of that
version because both take their seeds from here.

    train_request(cfg, run, n, "rl", step=3, policy_version=2, algorithms=["grpo"])
    eval_request(cfg, run, target, version=4, index=0, step=4)
    undispatched(cfg, run, request)                       # None: the orchestrator's own
    sampling_params(cfg.orchestrator.train.sampling)      # SamplingParams for the request
    seed_root(cfg.seed, sampling)                         # the sampling table's seed, else the run's
    eval_seed(root, "reverse-text", 3)                    # task 3's eval seed
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import msgspec

from roles.lib.envs.seats import seating_of
from schemas import SamplingParams, TaskRef, TaskRequested, derive_id, stable_seed

if TYPE_CHECKING:
    from configs import RunConfig
    from configs.orchestrator import EnvConfig, EvalTarget


def choose_env(cfg: RunConfig, n: int) -> EnvConfig:
    """The env of train group ``n``: drawn by ratio from a seed derived from the run and n."""
    envs = cfg.orchestrator.train.env
    total = sum(e.ratio for e in envs)
    x = (stable_seed(cfg.seed, "env", n) % 1_000_003) / 1_000_003 * total
    for env in envs:
        x -= env.ratio
        if x < 0:
            return env
    return envs[-1]


def train_request(
    cfg: RunConfig, run: str, n: int, phase: Literal["sft", "rl"], *,
    step: int, policy_version: int, algorithms: list[str],
) -> TaskRequested:  # fmt: skip
    """The orchestrator's train group ``n``: its env, task, seeds and ids follow from the
    config and ``n``; ``step``, ``policy_version`` and ``algorithms`` from its state."""
    o = cfg.orchestrator
    env = choose_env(cfg, n)
    sampling = env.sampling or o.train.sampling
    return TaskRequested(
        run=run,
        event_id=derive_id(run, "task", n),
        env=env.key,
        task=TaskRef(index=stable_seed(cfg.seed, "task", env.id, n) % 2**31, split="train"),
        group_id=derive_id(run, "group", n),
        group_size=o.warmup.group_size if phase == "sft" else env.group_size,
        sampling=sampling_params(sampling),
        model=o.warmup.actor if phase == "sft" else o.actor,
        step=step,
        policy_version=policy_version,
        seed=stable_seed(seed_root(cfg.seed, sampling), "rollout", n),
        max_turns=env.max_turns,
        args=dict(env.args),
        phase=phase,
        algorithms=algorithms,
        seating=seating_of(env),
        number=n,
    )


def eval_request(
    cfg: RunConfig, run: str, target: EvalTarget, version: int, index: int, *, step: int
) -> TaskRequested:
    """The orchestrator's eval of task ``index`` of ``target`` at weights ``version``."""
    e = cfg.orchestrator.eval
    return TaskRequested(
        run=run,
        event_id=derive_id(run, "eval", version, target.id, index),
        env=target.key,
        task=TaskRef(index=index, split="eval"),
        group_id=derive_id(run, "eval-group", version, target.id, index),
        group_size=e.k,
        sampling=sampling_params(target.sampling),
        model=cfg.orchestrator.actor,
        step=step,
        policy_version=version,
        seed=eval_seed(seed_root(cfg.seed, target.sampling), target.id, index),
        max_turns=target.max_turns,
        args=dict(target.args),
        phase="eval",
        seating=seating_of(target.train, e.learner_seat) if target.train else None,
    )


# What a request's own state fields may hold, not made from the config and a counter
_STATE = ("ts_ns", "producer", "causation_id", "step", "policy_version", "algorithms")


def undispatched(cfg: RunConfig, run: str, request: TaskRequested) -> str | None:
    """Why ``request`` is not a task this run's orchestrator dispatches under ``cfg``
    (None: it is one, or it is ``adhoc``: ``rlbus rollout``/``rlbus eval``'s). Every
    field the orchestrator derives from the config and its counter must be what it
    derives; the step and version it was dispatched at must lie within the run. (Which
    versions are evaluated is not checked: ``--resume`` may change the interval while
    evals of the old one wait.)"""
    if request.phase == "adhoc":
        return None
    if request.step > cfg.max_steps or request.policy_version > cfg.max_steps:
        return (
            f"a task ({request.phase}) at step {request.step}, version "
            f"{request.policy_version}, in a run of {cfg.max_steps} steps"
        )
    if request.phase == "eval":
        v = request.policy_version
        targets = [t for t in cfg.orchestrator.eval_targets() if t.key == request.env]
        if not targets or not 0 <= request.task.index < targets[0].num_tasks:
            return f"an eval of task {request.task.index} of {request.env!r}, not one of the run's"
        ours = eval_request(cfg, run, targets[0], v, request.task.index, step=request.step)
    else:
        if request.phase == "sft" and cfg.orchestrator.warmup.steps == 0:
            return "an sft task in a run without a warm start"
        if request.number is None:  # (a request logged before the counter was, too)
            return f"a train task ({request.phase}) without the orchestrator's group number"
        ours = train_request(
            cfg, run, request.number, request.phase, step=request.step,
            policy_version=request.policy_version, algorithms=request.algorithms,
        )  # fmt: skip
    theirs, mine = msgspec.structs.asdict(request), msgspec.structs.asdict(ours)
    differ = [k for k in mine if k not in _STATE and theirs[k] != mine[k]]
    if differ:
        k = differ[0]
        return f"its {k} is {theirs[k]!r}, not the orchestrator's {mine[k]!r}"
    return None


def sampling_params(s: Any) -> SamplingParams:
    """A config sampling table (``[orchestrator.train.sampling]``, an env's or eval's)
    as the request's ``SamplingParams``."""
    return SamplingParams(
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        max_completion_tokens=s.max_completion_tokens, stop=list(s.stop),
    )  # fmt: skip


def seed_root(run_seed: int, sampling: Any) -> int:
    """The root of rollouts' sampling seeds: the sampling table's ``seed``, else the run
    seed. Setting it redraws every sample on the same tasks (the run seed picks them)."""
    return run_seed if sampling.seed is None else sampling.seed


def eval_seed(root: int, env_id: str, index: int) -> int:
    """The sampling seed of eval task ``index`` of ``env_id``: the same in every eval
    round of a run and in ``rlbus eval`` of its checkpoints."""
    return stable_seed(root, "eval", env_id, index)
