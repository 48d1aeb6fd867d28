"""Which CPUs and how many threads each role process of ``rlbus up`` gets (``[cpus]``).

rlbus's point is overlap: inference generates step s+1 while the trainer trains step s.
On a small machine that only happens when the two do not fight over the same cores, and
when no process runs more BLAS threads than it has cores (oversubscribed threads spin and
wait for each other). So the launcher plans placement before it starts anything:

- the **compute roles** (``bus.kinds.Role.compute``: the trainer, counted once per rank on the CPU, and every
  inference replica the run may have, up to its pool's maximum) get disjoint slices of
  the CPUs this process may use, in proportion to their ranks; each gets as many torch
  threads as its slice has CPUs (a trainer's slice is divided among its ranks);
- the **light roles** (orchestrator, env servers, algorithm workers, the scripted
  teacher, the monitor) run one thread each on CPUs kept for them (one in four of those
  the compute roles leave, at least one);
- a compute role on a GPU gets at most ``GPU_ROLE_CPUS`` CPUs (per trainer rank): its
  work is on the device, and the light roles get the rest. On one H200 with the
  ``gpu`` preset (``benchmarks/gpu_bench.py``), the proportional plan gave the trainer
  and inference 13 of the 16 CPUs, where each used 0.6-0.7 of one, and left 3 to the env
  server, both algorithm workers, the orchestrator and the teacher;
- a machine with no CPU to spare beyond one per compute process (2 cores, one trainer
  and one inference replica) gets no affinity at all, one thread per process. Measured
  on 2 cores (``benchmarks/overlap_bench.py``, 9 interleaved pairs): pinning inference to
  one core and the trainer to the other was 5% slower on average (0.199 vs 0.189 s per
  step; it won 4 pairs by 2-10% and lost 5 by 3-32%): the light roles (~0.5 core: the
  env server, nats-server, the orchestrator) then preempt a pinned role that cannot move
  to the other core while it idles;
- ``cpus.roles`` overrides any of it, by role kind (``trainer``, ``inference``, ``env``)
  or process name (``inference-policy-1``); the name wins.

A process learns its placement from its environment: ``RLBUS_CPUS`` (a CPU list the
role pins itself to at start, ``apply_cpus``), ``RLBUS_TORCH_THREADS`` and the BLAS
libraries' own variables. The same variables place a role started by hand
(``RLBUS_CPUS=3 RLBUS_TORCH_THREADS=1 rlbus role env ...``).

    plan = cpu_plan(cfg, ["trainer", "inference-policy-0", "env-reverse-text"], [0, 1])
    plan["trainer"]            # Slot(cpus=None, threads=1): 2 cores, nothing pinned
    role.env |= plan["trainer"].env()
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from bus.kinds import ROLES, role_of_process
from configs.models import RunConfig
from roles.lib.threads import THREADS_ENV

CPUS_ENV = "RLBUS_CPUS"
# Thread pools that would otherwise size themselves to every core of the machine.
BLAS_ENVS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
# CPUs a compute role on a GPU gets (per trainer rank): the thread that launches its
# kernels, the host work around them (packing, decoding, the bus) and one to spare.
GPU_ROLE_CPUS = 3


@dataclass(frozen=True)
class Slot:
    cpus: tuple[int, ...] | None  # None: no affinity (every CPU the launcher may use)
    threads: int

    def env(self) -> dict[str, str]:
        """The environment that gives a role process this placement."""
        out = {THREADS_ENV: str(self.threads)} | {k: str(self.threads) for k in BLAS_ENVS}
        out["TOKENIZERS_PARALLELISM"] = "false"  # its Rayon pool would take every core
        if self.cpus is not None:
            out[CPUS_ENV] = ",".join(map(str, self.cpus))
        return out

    def describe(self) -> str:
        where = "any cpu" if self.cpus is None else "cpu " + ",".join(map(str, self.cpus))
        return f"{where} x{self.threads}"


def computes(name: str) -> bool:
    """Whether process ``name`` runs a compute role (``bus.kinds.Role.compute``)."""
    role = ROLES.get(role_of_process(name))
    return role is not None and role.compute


def available_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux: no affinity, only a count
        return list(range(os.cpu_count() or 1))


def cpu_plan(cfg: RunConfig, names: list[str], cpus: list[int]) -> dict[str, Slot]:
    """A slot for every process name (see the module docstring)."""
    plan = {n: Slot(None, 1) for n in names}
    if cfg.cpus.plan == "auto":
        plan |= _auto(cfg, names, cpus)
    return {n: _override(cfg, n, slot) for n, slot in plan.items()}


def device_of(cfg: RunConfig, name: str) -> str:
    """The device compute process ``name`` (the trainer, else an inference replica) runs
    its model on, resolved as the role resolves it (``trainer.device``,
    ``inference.device``: "auto" is cuda when torch sees a GPU; vLLM serves on CUDA)."""
    from roles.lib.model.loading import resolve_device

    if name == "trainer":
        return resolve_device(cfg.trainer.device)
    if cfg.inference.backend == "vllm":
        return "cuda (vllm)"
    return resolve_device(cfg.inference.device)


def on_gpu(cfg: RunConfig, name: str) -> bool:
    """Whether compute process ``name`` runs on a GPU."""
    return device_of(cfg, name) != "cpu"


def _auto(cfg: RunConfig, names: list[str], cpus: list[int]) -> dict[str, Slot]:
    ranks = cfg.trainer.world_size
    weights = {n: ranks if n == "trainer" else 1 for n in names if computes(n)}
    total = sum(weights.values())
    if not weights or total >= len(cpus):
        return {}  # no CPU would be left for the light roles: let the scheduler place all
    spare = len(cpus) - total
    light = cpus[len(cpus) - max(1, spare // 4) :]  # one CPU of 4 spare for the light roles
    compute = cpus[: len(cpus) - len(light)]
    # Proportional shares; what rounding leaves goes to the trainer, then in name order.
    shares = {n: len(compute) * w // total for n, w in weights.items()}
    left = len(compute) - sum(shares.values())
    for n in sorted(weights, key=lambda n: (n != "trainer", n)):
        if left <= 0:
            break
        shares[n] += 1
        left -= 1
    # A role on a GPU feeds it from a few host threads; what it does not need goes to
    # the light roles, whose env servers then bound the rollout rate.
    for n in shares:
        if on_gpu(cfg, n):
            shares[n] = min(shares[n], GPU_ROLE_CPUS * weights[n])
    used = sum(shares.values())
    compute, light = cpus[:used], cpus[used:]
    plan: dict[str, Slot] = {}
    start = 0
    for n in sorted(weights, key=lambda n: (n != "trainer", n)):
        mine = tuple(compute[start : start + shares[n]])
        start += shares[n]
        plan[n] = Slot(mine, max(1, len(mine) // weights[n]))
    for n in names:
        if n not in plan:
            plan[n] = Slot(tuple(light) if light else None, 1)
    return plan


def _override(cfg: RunConfig, name: str, slot: Slot) -> Slot:
    for key in (role_of_process(name), name):  # the name wins over the kind
        o = cfg.cpus.roles.get(key)
        if o is None:
            continue
        cpus = tuple(o.cpus) if o.cpus is not None else slot.cpus
        threads = slot.threads
        if o.threads is not None:
            threads = o.threads
        elif o.cpus:  # new CPUs, no thread count: one thread per CPU (per trainer rank)
            ranks = cfg.trainer.world_size if name == "trainer" else 1
            threads = max(1, len(o.cpus) // ranks)
        slot = Slot(cpus, threads)
    return slot


def plan_problems(cfg: RunConfig, names: list[str], cpus: list[int]) -> list[str]:
    """What is wrong with ``cpus.roles`` for this run and machine, one line each."""
    known = set(names) | {role_of_process(n) for n in names}
    problems = []
    for key, o in cfg.cpus.roles.items():
        if key not in known:
            problems.append(
                f"`cpus.roles.{key}`: this run has no role of that kind or name "
                f"(kinds: {', '.join(sorted({role_of_process(n) for n in names}))})"
            )
        bad = sorted(set(o.cpus or ()) - set(cpus))
        if bad:
            problems.append(
                f"`cpus.roles.{key}.cpus`: CPU {bad} is not available here "
                f"(this process may use {','.join(map(str, cpus))})"
            )
    return problems


def apply_cpus() -> tuple[int, ...] | None:
    """Pin this process to ``$RLBUS_CPUS`` (at a role's start, before torch makes its
    threads: they inherit the mask). Returns the CPUs, None when unset or unsupported."""
    spec = os.environ.get(CPUS_ENV, "").strip()
    if not spec or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = tuple(int(c) for c in spec.split(","))
    os.sched_setaffinity(0, cpus)
    return cpus
