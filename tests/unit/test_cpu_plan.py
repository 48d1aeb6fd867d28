"""The CPU plan of ``rlbus up`` (``roles.up.cpu_plan``): who runs where, with how many threads."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from configs import ConfigError, load_config
from roles.up.cpu_plan import CPUS_ENV, THREADS_ENV, Slot, cpu_plan, plan_problems
from roles.up.launcher import process_names, role_specs
from roles.up.preflight import cpu_problems

DEFAULT = ["orchestrator", "trainer", "inference-policy-0", "env-reverse-text", "algorithm-grpo"]


def test_two_cores_pin_nothing_and_three_split_compute_from_light_roles() -> None:
    # Two compute roles on two CPUs leave none for the light roles: nothing is pinned.
    assert set(cpu_plan(load_config("default"), DEFAULT, [0, 1]).values()) == {Slot(None, 1)}
    plan = cpu_plan(load_config("default"), DEFAULT, [0, 1, 2])
    assert plan["trainer"] == Slot((0,), 1)
    assert plan["inference-policy-0"] == Slot((1,), 1)
    for light in ("orchestrator", "env-reverse-text", "algorithm-grpo"):
        assert plan[light] == Slot((2,), 1)


CPU_ONLY = ["trainer.device=cpu", "inference.device=cpu"]


def test_many_cores_give_compute_roles_slices_and_keep_a_few_for_the_light_roles() -> None:
    plan = cpu_plan(load_config("default", CPU_ONLY), DEFAULT, list(range(16)))
    trainer, inference = plan["trainer"], plan["inference-policy-0"]
    assert trainer.cpus is not None and inference.cpus is not None
    assert not set(trainer.cpus) & set(inference.cpus)
    assert trainer.threads == len(trainer.cpus) and inference.threads == len(inference.cpus)
    light = plan["env-reverse-text"].cpus
    assert light is not None and not set(light) & (set(trainer.cpus) | set(inference.cpus))
    assert len(trainer.cpus) + len(inference.cpus) + len(light) == 16 and len(light) == 3
    assert plan["env-reverse-text"].threads == 1


def test_compute_roles_on_a_gpu_leave_their_cpus_to_the_light_roles() -> None:
    # The gpu preset on 16 CPUs: the trainer and inference feed the GPU from 3 each (not
    # 7 and 6), and the env servers, algorithm workers and orchestrator get the other 10.
    plan = cpu_plan(load_config("gpu"), DEFAULT, list(range(16)))
    assert plan["trainer"] == Slot((0, 1, 2), 3)
    assert plan["inference-policy-0"] == Slot((3, 4, 5), 3)
    for light in ("orchestrator", "env-reverse-text", "algorithm-grpo"):
        assert plan[light] == Slot(tuple(range(6, 16)), 1)
    # Only the role on the GPU gives CPUs up; one on the CPU keeps its share.
    mixed = cpu_plan(load_config("gpu", ["inference.device=cpu"]), DEFAULT, list(range(16)))
    assert mixed["trainer"] == Slot((0, 1, 2), 3)
    assert mixed["inference-policy-0"].cpus == (3, 4, 5, 6, 7, 8)
    assert mixed["orchestrator"].cpus == tuple(range(9, 16))


def test_trainer_ranks_share_their_slice_and_too_few_cores_pin_nothing() -> None:
    cfg = load_config("default", ["trainer.world_size=2", *CPU_ONLY])
    plan = cpu_plan(cfg, DEFAULT, list(range(7)))  # 6 for compute, 1 for the light roles
    assert plan["trainer"].cpus is not None and len(plan["trainer"].cpus) == 4
    assert plan["trainer"].threads == 2  # 4 CPUs over 2 ranks
    # 3 compute processes (2 ranks + inference) on 3 CPUs: no affinity at all.
    assert set(cpu_plan(cfg, DEFAULT, [0, 1, 2]).values()) == {Slot(None, 1)}


def test_elastic_pools_are_planned_at_their_maximum() -> None:
    cfg = load_config(
        "default", ["inference.min_replicas=1", "inference.max_replicas=2", *CPU_ONLY]
    )
    names = process_names(cfg)
    assert "inference-policy-1" in names
    plan = cpu_plan(cfg, names, list(range(8)))
    a, b = plan["inference-policy-0"].cpus, plan["inference-policy-1"].cpus
    assert a and b and not set(a) & set(b)


def test_overrides_by_kind_and_name_and_off() -> None:
    cfg = load_config(
        "default",
        ["cpus.roles.inference.threads=2", "cpus.roles.trainer.cpus=[0,1]",
         "cpus.roles.env-reverse-text.cpus=[1]"],
    )  # fmt: skip
    plan = cpu_plan(cfg, DEFAULT, [0, 1, 2])
    assert plan["inference-policy-0"] == Slot((1,), 2)
    assert plan["trainer"] == Slot((0, 1), 2)
    assert plan["env-reverse-text"] == Slot((1,), 1)
    off = cpu_plan(load_config("default", ["cpus.plan=off"]), DEFAULT, [0, 1])
    assert set(off.values()) == {Slot(None, 1)}


def test_bad_overrides_name_their_key_before_anything_starts() -> None:
    cfg = load_config("default", ["cpus.roles.trainr.threads=1", "cpus.roles.trainer.cpus=[7]"])
    problems = plan_problems(cfg, process_names(cfg), [0, 1])
    assert any(p.startswith("`cpus.roles.trainr`") for p in problems)
    assert any(p.startswith("`cpus.roles.trainer.cpus`") and "[7]" in p for p in problems)
    assert cpu_problems(load_config("default")) == []
    with pytest.raises(ConfigError, match="cpus.roles.bogus"):
        load_config("default", ["cpus.roles.bogus.threads=0"])


def test_role_processes_carry_their_placement(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from configs.paths import RunPaths

    cfg = load_config("default")
    plan = {n: Slot((0,), 1) if n == "trainer" else Slot(None, 1) for n in process_names(cfg)}
    roles = {r.name: r for r in role_specs(cfg, RunPaths(tmp_path, "p"), "nats://x", plan)}
    assert roles["trainer"].env[CPUS_ENV] == "0" and roles["trainer"].env[THREADS_ENV] == "1"
    assert roles["trainer"].env["OMP_NUM_THREADS"] == "1"
    assert CPUS_ENV not in roles["orchestrator"].env


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_a_role_process_pins_itself_to_its_cpus() -> None:
    cpu = min(os.sched_getaffinity(0))
    code = (
        "import os; from roles.up.cpu_plan import apply_cpus; apply_cpus(); "
        "print(sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=os.environ | {CPUS_ENV: str(cpu)},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert out.stdout.strip() == f"[{cpu}]"
