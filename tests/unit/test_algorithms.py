"""The built-in algorithms' formulas, the registry, and a custom algorithm by import path."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from roles.algorithm import BUILTINS, UnknownAlgorithm, create, resolve
from roles.algorithm.base import Algorithm
from roles.algorithm.samples import branch_views
from schemas import Branch, Message, SamplesScored, TaskRef, Trace
from schemas.arrays import pack_f32, pack_i32, pack_mask


def trace(reward: float, i: int = 0) -> Trace:
    msg = Message(id=0, role="assistant", content="x", token_ids=pack_i32([1, 2]),
                  sampled=pack_mask([1, 1]), logprobs=pack_f32([-0.1, -0.2]))  # fmt: skip
    return Trace(rollout_id=f"r{i}", env="e", task=TaskRef(index=0), group_id="g",
                 sample_index=i, messages=[msg], branches=[Branch(messages=[0])], reward=reward)  # fmt: skip


def group(*rewards: float) -> list[Trace]:
    return [trace(r, i) for i, r in enumerate(rewards)]


def test_grpo_subtracts_group_mean() -> None:
    """grpo: A = r - mean(r) over the group."""
    assert create("grpo").advantages(group(1, 0, 0, 1), None) == [0.5, -0.5, -0.5, 0.5]
    assert create("grpo").advantages(group(1, 0, 0, 0), None) == [0.75, -0.25, -0.25, -0.25]


def test_grpo_std_normalize_divides_by_population_std() -> None:
    """grpo std_normalize: A = (r - mean) / (std + 1e-6), std over the group (ddof=0)."""
    got = create("grpo", {"std_normalize": True}).advantages(group(1, 0, 0, 1), None)
    assert got == [0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), -0.5 / (0.5 + 1e-6), 0.5 / (0.5 + 1e-6)]


@pytest.mark.parametrize(
    ("name", "options"),
    [("grpo", {}), ("grpo", {"std_normalize": True}), ("max_rl", {}), ("rloo", {})],
)
def test_equal_rewards_give_exact_zeros(name: str, options: dict[str, bool]) -> None:
    """A group with equal rewards has exactly zero advantage (0.1 * 3 / 3 != 0.1 in floats)."""
    assert create(name, options).advantages(group(0.1, 0.1, 0.1), None) == [0.0, 0.0, 0.0]


def test_max_rl_normalizes_by_mean() -> None:
    """max_rl: A = (r - mean) / mean when mean > 0, else 0."""
    assert create("max_rl").advantages(group(1, 0, 0, 0), None) == [3.0, -1.0, -1.0, -1.0]
    assert create("max_rl").advantages(group(0.5, -0.5), None) == [0.0, 0.0]  # mean 0


def test_rloo_uses_leave_one_out_mean() -> None:
    """rloo: A_i = r_i - mean of the other rewards; a group of one gets 0."""
    assert create("rloo").advantages(group(1, 0, 0, 0), None) == [1.0, -1 / 3, -1 / 3, -1 / 3]
    assert create("rloo").advantages(group(1, 0), None) == [1.0, -1.0]
    assert create("rloo").advantages(group(0.7), None) == [0.0]


def test_sft_gives_unit_advantage_on_the_ce_channel() -> None:
    """sft: no baseline, advantage 1.0 for every trace, samples feed cross-entropy."""
    sft = create("sft")
    assert sft.advantages(group(0, 1, 0.3), None) == [1.0, 1.0, 1.0]
    assert sft.channel == "ce" and create("grpo").channel == "rl"


def flat_targets(algo: Algorithm, traces: list[Trace]) -> dict[str, list[list[float] | None]]:
    """Each trace's targets as plain lists, keyed by rollout id (refs: a fixed fake scorer)."""
    views = [branch_views(t) for t in traces]
    refs = {(t.rollout_id, 0): np.array([-1.0, -2.0], np.float32) for t in traces}
    out = {}
    for t, row in zip(traces, algo.targets(traces, views, None, refs), strict=True):
        (x,) = row
        out[t.rollout_id] = [
            None if v is None else np.broadcast_to(np.asarray(v, np.float64), (2,)).tolist()
            for v in (x.advantages, x.ce, x.ref_weights, x.ref_logprobs)
        ]
    return out


@settings(max_examples=150, deadline=None)
@given(
    rewards=st.lists(st.floats(-10, 10, allow_nan=False, width=32), min_size=1, max_size=12),
    data=st.data(),
)
def test_stateless_builtins_ignore_group_order(rewards: list[float], data: st.DataObject) -> None:
    """Permuting a group gives every trace exactly the same targets (arrival order is noise)."""
    traces = group(*rewards)
    shuffled = data.draw(st.permutations(traces))
    algos = [create(n) for n in BUILTINS if not BUILTINS[n].stateful]
    assert {a.name for a in algos} == set(BUILTINS) - {"rae"}
    for algo in [*algos, create("grpo", {"std_normalize": True})]:
        assert flat_targets(algo, shuffled) == flat_targets(algo, traces), algo


def test_unknown_name_lists_builtins() -> None:
    """A typo fails with an error that lists the built-in names."""
    with pytest.raises(UnknownAlgorithm, match="unknown algorithm 'gpro'") as err:
        resolve("gpro")
    for name in ("grpo", "max_rl", "rloo", "sft"):
        assert name in str(err.value)


def test_bad_import_paths_are_unknown_algorithms() -> None:
    """A missing module, a missing attribute or a non-Algorithm fail with a named error."""
    with pytest.raises(UnknownAlgorithm, match="cannot import"):
        resolve("no_such_pkg.algos:X")
    with pytest.raises(UnknownAlgorithm, match="has no 'Nope'"):
        resolve("examples.my_algo:Nope")
    with pytest.raises(UnknownAlgorithm, match="not a subclass"):
        resolve("examples.my_algo:math")


def test_bad_options_name_the_algorithm() -> None:
    """An unknown option fails at creation, naming the algorithm and the option."""
    with pytest.raises(ValueError, match="'grpo'.*std_normalise"):
        create("grpo", {"std_normalise": True})
    with pytest.raises(ValueError, match="'rloo'"):
        create("rloo", {"beta": 1})


def test_custom_stateful_algorithm_by_import_path() -> None:
    """examples/my_algo.py loads by import path; its baseline is a fold over scored events."""
    algo = create("examples.my_algo:RunningBaseline", {"prior": 0.25})
    assert isinstance(algo, Algorithm) and algo.stateful
    state = algo.initial_state()
    assert algo.advantages(group(1, 0), state) == [0.75, -0.25]
    for rewards in ([1.0, 1.0], [0.0, 1.0, 1.0]):
        scored = SamplesScored(run="r", algorithm="running", env="e", group_id="g", request_id="q",
                               task_index=0, step=0, samples=[], rewards=rewards)  # fmt: skip
        state = algo.fold(state, scored)
    assert algo.advantages(group(1, 0), state) == [1 - 0.8, 0 - 0.8]


def test_worker_resolves_algorithm_ids_from_the_config() -> None:
    """An id in orchestrator.algorithms maps to its registered name + options; others are names."""
    from configs import load_config
    from configs.orchestrator import AlgorithmConfig

    cfg = load_config("smoke")
    cfg.orchestrator.algorithms.append(
        AlgorithmConfig(id="norm", name="grpo", options={"std_normalize": True})
    )
    assert cfg.orchestrator.algorithm_spec("norm") == ("grpo", {"std_normalize": True})
    assert cfg.orchestrator.algorithm_spec("sft") == (
        "sft",
        {},
    )  # warm start: a registered name, no options
    assert create(*cfg.orchestrator.algorithm_spec("norm")).advantages(group(1, 0), None) == [
        0.5 / (0.5 + 1e-6),
        -0.5 / (0.5 + 1e-6),
    ]
