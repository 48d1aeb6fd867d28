"""The env server runs only what the orchestrator dispatches: every request the
orchestrator's fold makes passes ``undispatched``; a request that differs from it in
anything the config and its counter decide, or asks for a step or version outside the
run, does not (the issue's forgeries: a 32-rollout group, an eval "at v1e6")."""

from __future__ import annotations

import msgspec

from roles.lib.tasks import undispatched
from schemas import TaskRef, TaskRequested, new_id
from tests.unit.test_orchestrator import make, scored, started, step, tasks, weights


def dispatched() -> tuple[object, list[TaskRequested]]:
    """A short fold: RL groups for two steps, evals at versions 0 and 2."""
    cfg, state = make("orchestrator.eval.interval=2", "orchestrator.eval.num_tasks=3")
    made = tasks(step(state, cfg, started(cfg)))
    for v in (1, 2):
        for t in [t for t in made if t.phase == "rl" and t.group_id in state.groups]:
            made += tasks(step(state, cfg, scored(t, [0.0, 1.0, 0.0, 1.0])))
        made += tasks(step(state, cfg, weights(v)))
    return cfg, made


def test_every_request_the_orchestrator_makes_is_its_own() -> None:
    cfg, made = dispatched()
    assert {t.phase for t in made} == {"rl", "eval"}
    assert {t.policy_version for t in made if t.phase == "eval"} == {0, 2}
    assert len({t.number for t in made if t.phase == "rl"}) > 4
    assert [undispatched(cfg, "r", t) for t in made] == [None] * len(made)  # type: ignore[arg-type]
    warm, state = make("orchestrator.warmup.steps=1")
    sft = tasks(step(state, warm, started(warm)))
    assert {t.phase for t in sft} == {"sft"}
    assert [undispatched(warm, "r", t) for t in sft] == [None] * len(sft)


def test_a_request_the_orchestrator_did_not_make_is_named() -> None:
    cfg, made = dispatched()
    rl = next(t for t in made if t.phase == "rl")
    ev = next(t for t in made if t.phase == "eval")

    def why(request: TaskRequested) -> str:
        return undispatched(cfg, "r", request) or ""  # type: ignore[arg-type]

    def bent(t: TaskRequested, **changes: object) -> TaskRequested:
        return msgspec.structs.replace(t, **changes)

    assert "its group_size is 32, not the orchestrator's 4" in why(bent(rl, group_size=32))
    assert "at step 0, version 1000000, in a run of 5 steps" in why(bent(ev, policy_version=10**6))
    assert "eval of task 3" in why(bent(ev, task=TaskRef(index=3, split="eval")))
    assert "seed is" in why(bent(rl, seed=rl.seed + 1))
    assert "task is" in why(bent(rl, task=TaskRef(index=rl.task.index + 1, split="train")))
    assert "event_id is" in why(bent(rl, event_id=new_id()))
    assert "without the orchestrator's group number" in why(bent(rl, number=None))
    assert "args is" in why(bent(rl, args={"evil": 1}))
    # another counter's request is self-consistent only if every derived field follows it
    assert "not the orchestrator's" in why(bent(rl, number=rl.number + 1))  # type: ignore[operator]
    no_warmup, _ = make()
    assert undispatched(no_warmup, "r", bent(rl, phase="sft")) == (
        "an sft task in a run without a warm start"
    )
    # rlbus rollout / rlbus eval ask adhoc: never the orchestrator's, always run
    assert undispatched(cfg, "r", bent(rl, phase="adhoc", group_size=32, number=None)) is None  # type: ignore[arg-type]
    # what the orchestrator's state decides is not checked against the config
    assert why(bent(rl, step=4, policy_version=3, algorithms=["other"])) == ""
