"""Several algorithms on one env: merged samples, and routing changes folded from the log."""

from __future__ import annotations

import msgspec
import pytest

from configs import ConfigError, load_config
from roles.algorithm.checks import check_routing, routing_problems
from roles.orchestrator.merge import merge_scored
from roles.orchestrator.state import OrchestratorState
from schemas import AlgorithmAttached, AlgorithmDetached, Sample, TaskRef, TaskRequested, arrays
from tests.samples import sample
from tests.unit.test_orchestrator import make, scored, started, step


def channels(s: Sample, **fields: list[float] | list[bool] | None) -> Sample:
    packed = {}
    for name, values in fields.items():
        if values is None:
            packed[name] = None
        elif name in ("mask", "sft_mask"):
            packed[name] = arrays.pack_mask(values)
        else:
            packed[name] = arrays.pack_f32(values)
    return msgspec.structs.replace(s, **packed)


def request(group_id: str, size: int) -> TaskRequested:
    return TaskRequested(
        run="r", env="e", task=TaskRef(index=1), group_id=group_id, group_size=size
    )


def test_merge_adds_rl_takes_max_ce_and_weights_ref_targets() -> None:
    """rl advantages add, ce weights take the max, ref_kl targets are the beta-weighted mean."""
    base = sample(n=4)
    a = channels(base, mask=[0, 1, 1, 0], advantages=[0, 0.5, 0.5, 0], sft_mask=[0, 0, 0, 1],
                 ce_weights=[0, 0, 0, 0.1], ref_weights=[0, 1, 1, 0], ref_logprobs=[0, -1, -2, 0])  # fmt: skip
    b = channels(base, mask=[0, 0, 1, 1], advantages=[0, 0, -0.25, 1], sft_mask=[0, 0, 0, 1],
                 ce_weights=[0, 0, 0, 0.3], ref_weights=[0, 3, 0, 0], ref_logprobs=[0, -3, 0, 0])  # fmt: skip
    a, b = (msgspec.structs.replace(x, algorithms=[n]) for x, n in ((a, "a"), (b, "b")))
    ev = scored(request("g", 1), [1.0])
    ea = msgspec.structs.replace(ev, algorithm="a", samples=[a])
    eb = msgspec.structs.replace(ev, algorithm="b", samples=[b])
    for events in ([ea, eb], [eb, ea]):  # order-free
        (m,) = merge_scored(events)
        got = m.arrays()
        assert got["mask"].tolist() == [False, True, True, True]
        assert got["advantages"].tolist() == [0, 0.5, 0.25, 1]
        assert got["ce_weights"].tolist() == pytest.approx([0, 0, 0, 0.3])
        assert got["ref_weights"].tolist() == [0, 4, 1, 0]
        assert got["ref_logprobs"].tolist() == [0, -2.5, -2, 0]  # (1*-1 + 3*-3) / 4
        assert m.algorithms == ["a", "b"]


def test_a_single_algorithm_passes_its_samples_through_untouched() -> None:
    """One algorithm: the queued samples are exactly the scored ones (old runs replay the same)."""
    ev = scored(request("g", 2), [1.0, 0.0])
    assert merge_scored([ev]) == ev.samples


def dispatched(cfg, state: OrchestratorState) -> list[TaskRequested]:  # noqa: ANN001
    out = step(state, cfg, started(cfg))
    return [e for e in out if isinstance(e, TaskRequested)]


def test_attach_routes_later_groups_and_waits_for_both_algorithms() -> None:
    """Groups dispatched after algorithm.attached wait for its samples too, then merge."""
    cfg, state = make()
    first = dispatched(cfg, state)
    env = first[0].env
    state.apply(AlgorithmAttached(run="r", event_id="att", algorithm="rloo", name="rloo"))
    assert state.trains_on["rl"][env] == {"grpo", "rloo"}
    assert state.groups[first[0].group_id].waiting_for == {"grpo"}  # in flight: unchanged
    later = TaskRequested(run="r", event_id="t-late", env=env, task=first[0].task, group_id="late", group_size=2)  # fmt: skip
    state.apply(later)
    g = scored(later, [1.0, 0.0])
    state.apply(g)
    assert "late" in state.groups and not state.queues["rl"]  # still waiting for rloo
    r = msgspec.structs.replace(g, event_id="scored-late-rloo", algorithm="rloo",
                                samples=[msgspec.structs.replace(s, algorithms=["rloo"]) for s in g.samples])  # fmt: skip
    state.apply(r)
    assert "late" not in state.groups
    queued = list(state.queues["rl"])
    assert len(queued) == 2 and queued[0].sources == ("scored-late", "scored-late-rloo")


def test_shadow_attach_changes_no_routing_and_detach_releases_waiting_groups() -> None:
    """A shadow never trains; detaching an algorithm stops groups from waiting for it."""
    cfg, state = make()
    reqs = dispatched(cfg, state)
    env = reqs[0].env
    state.apply(
        AlgorithmAttached(run="r", event_id="sh", algorithm="max_rl", name="max_rl", shadow=True)
    )
    assert state.trains_on["rl"][env] == {"grpo"}
    state.apply(
        AlgorithmAttached(run="r", event_id="att", algorithm="rloo", name="rloo", envs=[env])
    )
    late = TaskRequested(run="r", event_id="t2", env=env, task=reqs[0].task, group_id="g2", group_size=2)  # fmt: skip
    state.apply(late)
    state.apply(scored(late, [1.0, 0.0]))
    assert state.groups["g2"].waiting_for == {"rloo"}
    state.apply(AlgorithmDetached(run="r", event_id="det", algorithm="rloo"))
    assert "g2" not in state.groups and len(state.queues["rl"]) == 2
    assert state.trains_on["rl"][env] == {"grpo"}


def test_routing_checks_name_the_offending_algorithm() -> None:
    """rae without members, opd without a reference model: clear errors naming the key."""
    cfg = load_config(
        "smoke", ['orchestrator.algorithms=[{id="grpo"},{id="rae"},{id="distill",name="opd"}]']
    )
    problems = routing_problems(cfg)
    assert len(problems) == 2
    assert "`orchestrator.algorithms.1` (rae)" in problems[0] and "no members" in problems[0]
    assert (
        "`orchestrator.algorithms.2` (opd)" in problems[1]
        and "orchestrator.models.reference" in problems[1]
    )
    with pytest.raises(ConfigError, match="invalid algorithm routing"):
        check_routing(cfg)
    ok = load_config(
        "smoke",
        ['orchestrator.algorithms=[{id="opd"}]', 'orchestrator.models.reference.kind="reference"'],
    )
    assert routing_problems(ok) == []
    bad_option = load_config("smoke", ['orchestrator.algorithms=[{id="echo",options={alpha=-1}}]'])
    assert "alpha must be >= 0" in routing_problems(bad_option)[0]


def test_routing_checks_catch_untrainable_envs_and_teacher_references() -> None:
    """An env routed only to shadows would stall; a scripted teacher cannot score for opd."""
    shadow_only = load_config("smoke", [
        'orchestrator.algorithms=[{id="grpo"},{id="watch",name="max_rl",shadow=true}]',
        'orchestrator.train.env.0.algorithms=["watch"]',
    ])  # fmt: skip
    (problem,) = routing_problems(shadow_only)
    assert "names only shadow algorithms" in problem and "reverse-text" in problem
    teacher_ref = load_config(
        "smoke", ['orchestrator.algorithms=[{id="opd",options={reference="teacher"}}]']
    )
    (problem,) = routing_problems(teacher_ref)
    assert "scripted teacher" in problem and 'kind = "reference"' in problem


def test_every_bundled_preset_passes_the_routing_checks() -> None:
    """`rlbus up -c <preset>` never stops at the routing checks."""
    from configs import list_presets

    assert {"default", "smoke", "tools"} <= set(list_presets())
    for name in list_presets():
        assert routing_problems(load_config(name)) == [], name
