"""The orchestrator's decisions: a pure function of its state and the config.

``decide(state, cfg)`` returns the events to publish now (dispatches, batches, evals,
metrics, the stop) and applies each to the state as it emits it. It never reads the
clock or a global RNG: task and env choices derive from the run seed and the group
counter, ids from the run and a counter, so replaying the log makes the same decisions
with the same ids (the server dedups the republished ones).

Asynchrony, the two documented bounds:
- ``max_async_level``: data for step s is only requested and assembled while the
  trainer has published version >= s - 1 - max_async_level (0 = on-policy, synchronous);
- ``max_off_policy_steps``: a sample whose oldest token came from a policy more than this
  many versions older than the one the batch trains (s - 1) is dropped and counted.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Literal

import msgspec

from configs import RunConfig
from roles.lib.tasks import choose_env, eval_request, train_request
from roles.orchestrator.eval_stats import eval_metrics
from roles.orchestrator.state import OrchestratorState
from schemas import (
    BatchAssembled,
    Event,
    MetricsReported,
    RunStopped,
    batch_id,
    derive_id,
    run_stopped_id,
)


def phase_of(step: int, cfg: RunConfig) -> Literal["sft", "rl"]:
    return "sft" if step <= cfg.orchestrator.warmup.steps else "rl"


def trains_on(cfg: RunConfig) -> dict[str, dict[str, set[str]]]:
    """Which algorithms' samples train each env's groups, per phase (shadows never train)."""
    o = cfg.orchestrator
    ids = [a.id for a in o.algorithms if not a.shadow]  # SamplesScored.algorithm is the config id
    rl = {e.key: {a for a in (e.algorithms or ids) if a in ids} for e in o.train.env}
    sft = {e.key: set(o.warmup.algorithms) for e in o.train.env}
    return {"rl": rl, "sft": sft}


class Decider:
    """Emits events and applies them to the state as it goes."""

    def __init__(self, state: OrchestratorState, cfg: RunConfig, cause: str | None = None):
        self.state, self.cfg = state, cfg
        self.run = cfg.run or ""
        self.cause = cause  # the event whose arrival led to these decisions
        self.out: list[Event] = []

    def emit(self, event: Event) -> None:
        if event.causation_id is None and self.cause is not None:
            event = msgspec.structs.replace(event, causation_id=self.cause)
        self.state.apply(event, skip_zero=self.cfg.orchestrator.skip_zero_advantage_groups)
        self.out.append(event)

    def decide(self) -> list[Event]:
        s = self.state
        if s.started is None or s.stopped is not None:
            return []
        if self.stop():
            return self.out
        self.assemble()
        # Eval requests before new train groups: they reach env servers first, so the
        # weights they are pinned to are still served (inference holds them, bounded).
        self.evaluate()
        self.dispatch()
        self.stop()
        return self.out

    # -- batches ------------------------------------------------------------------------

    def assemble(self) -> None:
        s, o = self.state, self.cfg.orchestrator
        while (
            step := s.assembled + 1
        ) <= self.cfg.max_steps and s.trainer_version >= step - 1 - o.max_async_level:
            phase = phase_of(step, self.cfg)
            queue = s.queues[phase]
            if phase == "rl":  # teacher samples (sft) carry the teacher's version, not ours
                oldest_ok = (step - 1) - o.max_off_policy_steps
                # Only the policy's tokens age: a frozen actor's sample is never stale.
                fresh = [
                    q for q in queue if not q.sample.from_policy or q.sample.policy_min >= oldest_ok
                ]
                s.dropped_stale += len(queue) - len(fresh)
                s.total_dropped_stale += len(queue) - len(fresh)
                queue.clear()
                queue.extend(fresh)
            if len(queue) < o.batch_size:
                return
            taken = [queue[i] for i in range(o.batch_size)]
            samples = [q.sample for q in taken]
            staleness = [(step - 1) - x.policy_min for x in samples if x.from_policy] or [0]
            group_rewards = {q.group_id: q.group_reward for q in taken}
            metrics = MetricsReported(
                run=self.run, event_id=derive_id(self.run, "orchestrator-metrics", step), role="orchestrator", step=step,
                policy_version=s.trainer_version,
                values={
                    "reward_mean": sum(x.reward for x in samples) / len(samples),
                    "group_reward_mean": sum(group_rewards.values()) / len(group_rewards),
                    "staleness_mean": sum(staleness) / len(staleness) if phase == "rl" else 0.0,
                    "staleness_max": float(max(staleness)) if phase == "rl" else 0.0,
                    "dropped_stale": float(s.dropped_stale), "skipped_zero_advantage": float(s.skipped_zero),
                    "dropped_stale_total": float(s.total_dropped_stale),
                    "skipped_zero_advantage_total": float(s.total_skipped_zero),
                    "groups_in_flight": float(len(s.groups)), "errored_rollouts_total": float(s.errored_rollouts),
                    "filtered_rollouts_total": float(s.filtered_rollouts),
                    "filtered_groups_total": float(s.filtered_groups),
                    "env_errors_total": float(len(s.env_failures)),
                    "groups_released_total": float(s.released),
                    "async_lag": float(step - 1 - s.trainer_version), "sft": float(phase == "sft"),
                    **(trainable_shares(s) if phase == "rl" else {}),
                },
            )  # fmt: skip
            if phase == "rl":
                s.batch_rollouts = s.batch_trainable = 0
                s.batch_filters.clear()
            self.emit(
                BatchAssembled(
                    run=self.run,
                    event_id=batch_id(self.run, step),
                    step=step,
                    samples=samples,
                    policy_version=s.trainer_version,
                    sources=sorted({x for q in taken for x in q.sources}),
                    num_tokens=sum(len(x) for x in samples),
                    dropped_stale=s.dropped_stale,
                    skipped_zero_advantage=s.skipped_zero,
                    phase=phase,
                )  # fmt: skip
            )
            self.emit(metrics)

    # -- dispatch -----------------------------------------------------------------------

    def dispatch(self) -> None:
        s, o = self.state, self.cfg.orchestrator
        horizon = min(self.cfg.max_steps, s.trainer_version + 1 + o.max_async_level)
        phases: tuple[Literal["sft", "rl"], ...] = ("sft", "rl")
        for phase in phases:
            steps = sum(
                1 for k in range(s.assembled + 1, horizon + 1) if phase_of(k, self.cfg) == phase
            )
            pending = len(s.queues[phase]) + sum(
                g.request.group_size for g in s.groups.values() if g.request.phase == phase
            )
            need = steps * o.batch_size - pending
            while need > 0 and len(s.groups) < o.max_groups_in_flight:
                need -= self.dispatch_group(phase)

    def dispatch_group(self, phase: Literal["sft", "rl"]) -> int:
        s = self.state
        env_key = choose_env(self.cfg, s.dispatched).key
        request = train_request(
            self.cfg, self.run, s.dispatched, phase, step=s.assembled,
            policy_version=s.trainer_version, algorithms=sorted(s.trains_on[phase].get(env_key, ())),
        )  # fmt: skip
        self.emit(request)
        return request.group_size

    # -- eval ---------------------------------------------------------------------------

    def evaluate(self) -> None:
        s, e = self.state, self.cfg.orchestrator.eval
        v = s.trainer_version
        if self.cfg.evaluates(v) and v not in s.eval_rounds:
            # Train envs and eval-only ones alike (`eval_targets`), each with its own
            # task count and sampling; an eval-only env is never dispatched for training.
            for env in self.cfg.orchestrator.eval_targets():
                for i in range(env.num_tasks):
                    self.emit(eval_request(self.cfg, self.run, env, v, i, step=s.assembled))
        for version, round_ in sorted(s.eval_rounds.items()):
            if not round_.reported and round_.expected and round_.answered >= round_.expected:
                self.emit(
                    MetricsReported(
                        run=self.run,
                        event_id=derive_id(self.run, "eval-metrics", version),
                        role="eval",
                        step=version,
                        policy_version=version,
                        values=eval_metrics(round_.results, e.k, version)
                        | ({"dead_lettered": float(round_.dead)} if round_.dead else {}),
                    )  # fmt: skip
                )

    # -- stopping -----------------------------------------------------------------------

    def stop(self) -> bool:
        s, o = self.state, self.cfg.orchestrator
        if s.stopped is not None:
            return True
        groups_per_batch = max(
            1, math.ceil(o.batch_size / max(1, min(e.group_size for e in o.train.env)))
        )
        reason = detail = None
        if len(s.env_failures) >= o.max_env_errors:
            reason, detail = "env_error", env_error_detail(s)
        elif s.no_signal_streak >= o.max_no_signal_batches * groups_per_batch:
            reason = "no_learning_signal"
            detail = (
                f"{s.no_signal_streak} groups in a row had all-equal rewards (zero advantage); "
                "the policy gets no learning signal: check the reward function, raise the temperature "
                "or the group size, or warm-start the policy"
            )
        elif (
            o.max_filtered_batches
            and s.filtered_streak >= o.max_filtered_batches * groups_per_batch
        ):
            reason, detail = "rollouts_filtered", filter_stop_detail(s, o.max_filtered_batches)
        elif s.trainer_version >= self.cfg.max_steps:
            # The final eval reported, and every earlier round too: an older round can be
            # answered after a newer one (inference loading late, its env server slower).
            final = s.eval_rounds.get(self.cfg.max_steps)
            evaluated = not self.cfg.evaluates(self.cfg.max_steps) or (
                final is not None and final.reported
            )
            if evaluated and all(r.reported for r in s.eval_rounds.values() if r.expected):
                reason, detail = "max_steps", f"trained {self.cfg.max_steps} steps"
        if reason is None:
            return False
        self.emit(
            RunStopped(
                run=self.run,
                event_id=run_stopped_id(self.run, s.segment),
                reason=reason,
                step=s.trainer_version,
                detail=detail or "",
            )
        )
        return True


def env_error_detail(state: OrchestratorState) -> str:
    """The stop message of a run whose env servers keep dead-lettering its tasks: which
    env(s), the newest error's first line, where to read the rest."""
    failures = state.env_failures
    envs = sorted({f.subject.rsplit(".", 1)[-1] for f in failures})
    last = failures[-1]
    return (
        f"{len(failures)} task(s) of env {', '.join(envs)} dead-lettered by the env server: "
        f"{last.headline} (the traceback: `rlbus events {last.run} "
        "--topic dead.lettered --json`)"
    )


# What to change, by the kind of a rollout's first error (``TraceError.kind``).
ERROR_ADVICE = {
    "context_too_long": (
        "prompts outgrow the model: raise `inference.max_model_len` or shorten the env's "
        "prompts and `max_completion_tokens`"
    ),
    "inference_timeout": (
        "the model's server answers too slowly or not at all: read its log, or raise "
        "`inference.request_timeout_s`"
    ),
    "inference_error": "the model's server could not be reached: read its log",
    "no_responders": "no server answers for the model: read its log",
    "internal": "the model's server raised on every request: its log has the traceback",
    "bad_request": "the model's server refused the requests: its log says why",
    "bad_reply": "the model's replies are malformed: read its server's log",
    "render_error": (
        "the renderer cannot extend the conversation token for token: check "
        "`model.renderer` (docs/models.md)"
    ),
    "no_actor_turn": "the learner never spoke: check the env's members and seating",
}
DEFAULT_ADVICE = "read the env server's and the model's role logs"


def error_stop(state: OrchestratorState, cfg: RunConfig, erroring_s: float) -> str | None:
    """The stop message of a run whose rollouts only error, or None while it may go on.

    ``erroring_s``: how long (the watch's clock) rollouts have errored with no rollout
    that could train and no trainer step since (the later of the two). Past
    ``orchestrator.error_stop_s`` (0: never) it stops: one line naming how many errored,
    the most frequent error (kind and message), the env and model, and what to change.
    A stall would stop the run too, but only past ``stall_stop_s`` and naming what it
    waits for, not why: every errored rollout is replaced by a new one, silently.
    """
    limit = cfg.orchestrator.error_stop_s
    if limit <= 0 or state.error_streak == 0 or erroring_s < limit:
        return None
    # The most frequent kind (messages differ in their numbers), with its most frequent one.
    by_kind: Counter[str] = Counter()
    for headline, n in state.streak_errors.items():
        by_kind[headline.split(":", 1)[0]] += n
    kind, count = by_kind.most_common(1)[0]
    headline = max(
        (h for h in state.streak_errors if h.split(":", 1)[0] == kind),
        key=lambda h: state.streak_errors[h],
    )
    return (
        f"{state.error_streak} rollouts in a row errored and none could train "
        f"(no trainer step for {erroring_s:.0f} s); {count} of them {headline} "
        f"[{state.streak_source}]; {ERROR_ADVICE.get(kind, DEFAULT_ADVICE)} "
        f"(stopped by `orchestrator.error_stop_s` = {limit:g}; 0 never stops)"
    )


FILTERED_SHARE = "filtered_share/"  # + a filter's name: a batch metric


def trainable_shares(state: OrchestratorState) -> dict[str, float]:
    """An RL batch's metrics on the rollouts scored since the last RL batch:
    ``trainable_share``, those that could train (neither errored nor filtered; 1.0 when
    none was scored), and ``filtered_share/<filter>``, those each enforcing filter kept out."""
    n = state.batch_rollouts
    return {
        "trainable_share": state.batch_trainable / n if n else 1.0,
        **{
            f"{FILTERED_SHARE}{name}": k / n for name, k in sorted(state.batch_filters.items()) if n
        },
    }


def share_warning(metrics: MetricsReported, cfg: RunConfig) -> str | None:
    """The warning for a batch whose ``trainable_share`` fell under
    ``orchestrator.min_trainable_share`` (0: never): how low, and the filter that kept the
    most rollouts out."""
    share, floor = metrics.values.get("trainable_share"), cfg.orchestrator.min_trainable_share
    if share is None or share >= floor:
        return None
    shares = {k.removeprefix(FILTERED_SHARE): v for k, v in metrics.values.items()
              if k.startswith(FILTERED_SHARE)}  # fmt: skip
    top = max(shares, key=lambda k: shares[k]) if shares else None
    why = f"filter {top!r} flagged {shares[top]:.0%}" if top else "none filtered: they errored"
    return (
        f"only {share:.0%} of the rollouts scored for step {metrics.step} could train ({why}); "
        f"under `orchestrator.min_trainable_share` = {floor:g}"
    )


def filter_stop_detail(state: OrchestratorState, batches: int) -> str:
    """Why a run whose rollouts are all filtered stops: how many groups in a row, the
    filter that flagged most of them, and what to change."""
    named = state.streak_filters.most_common(1)
    which = (f"filter {named[0][0]!r} flagged {named[0][1]} of their rollouts"
             if named else "no filter named itself")  # fmt: skip
    return (
        f"{state.filtered_streak} groups in a row had every rollout filtered ({which}): "
        "nothing trains; loosen or stop enforcing that filter (`enforce = false` only "
        "records its verdicts), or warm-start the policy (stopped by "
        f"`orchestrator.max_filtered_batches` = {batches}; 0 never stops)"
    )


def waits_for(state: OrchestratorState, cfg: RunConfig) -> list[str]:
    """What the run waits for now, one phrase each (the stall report): the trainer, the
    batch's samples, the algorithms the groups in flight wait for, unanswered evals."""
    o, s = cfg.orchestrator, state
    out: list[str] = []
    step = s.assembled + 1
    if step <= cfg.max_steps:
        need = step - 1 - o.max_async_level
        if s.trainer_version < need:
            out.append(
                f"trainer: weights v{need} to assemble step {step} (newest v{s.trainer_version})"
            )
        else:
            have = len(s.queues[phase_of(step, cfg)])
            out.append(f"samples: {have} of {o.batch_size} for step {step}")
    elif s.trainer_version < cfg.max_steps:
        out.append(f"trainer: weights v{cfg.max_steps} (newest v{s.trainer_version})")
    by_algorithm: dict[str, int] = {}
    for g in s.groups.values():
        for a in g.waiting_for:
            by_algorithm[a] = by_algorithm.get(a, 0) + 1
    for a, n in sorted(by_algorithm.items()):
        envs = sorted({g.request.env for g in s.groups.values() if a in g.waiting_for})
        out.append(f"algorithm {a}: {n} group(s) of {', '.join(envs)} not scored")
    for version, r in sorted(s.eval_rounds.items()):
        if not r.reported and r.answered < r.expected:
            out.append(f"eval v{version}: {r.answered} of {r.expected} tasks answered")
    return out


def decide(state: OrchestratorState, cfg: RunConfig, cause: str | None = None) -> list[Event]:
    """The events to publish now, already applied to ``state``; ``cause`` becomes their causation id."""
    return Decider(state, cfg, cause).decide()
