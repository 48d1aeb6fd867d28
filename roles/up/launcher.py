"""``rlbus up``: one machine, every role as its own process, a live view, a clean stop.

    rlbus up                       # the default preset
    rlbus up -c smoke --no-view    # the smoke preset with plain log lines

It refuses a run id that is live or already has data unless told ``--resume`` or
``--fresh`` (``roles/up/run_guard.py``). It starts an embedded nats-server under
``runs/<run>/nats`` (unless ``--nats-url``, or the run's embedded server is already
running there), on the port of the run's last launch when that is free, and restarts
it there if it dies,
builds the tiny model if that is the configured policy, writes the resolved config to
``runs/<run>/config.toml``, and starts each role with the same ``rlbus role ...``
command a user would type, placed on the machine's CPUs by the ``[cpus]`` plan
(``roles/up/cpu_plan.py``), logging to ``runs/<run>/logs/<role>.log``: each train env's
pool of env servers (and each eval-only env's, ``orchestrator.eval.env``) and the
policy's inference replicas at their ``replicas``, resized
while the run goes when elastic (``roles/up/pools.py``). A role that dies
is restarted (it resumes from its durable consumer; the log makes that safe). When the
orchestrator publishes ``run.stopped`` (or on Ctrl-C) every role gets SIGTERM and drains;
then ``summary.json`` and ``curves.png`` are written next to the logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import shutil
import sys
import time
from pathlib import Path

from bus.cluster import EmbeddedCluster, is_cluster_store
from bus.natsconf import Tls
from bus.server import EmbeddedServer
from configs import POLICY, RunConfig, dump_toml
from configs.paths import RunPaths
from roles.runtime.context import policy_model_dir
from roles.up.cpu_plan import Slot, available_cpus, cpu_plan, device_of
from roles.up.pools import env_replica, inference_replica, run_pools, served_envs
from roles.up.processes import RoleProcess, role_env, role_process
from roles.up.run_guard import (
    LOCK_FILE,
    Mode,
    RunLock,
    RunRefused,
    check_previous,
    delete_stream,
    previous_run,
    start_over,
    stream_exists,
)
from roles.up.supervisor import supervise


def role_commands(cfg: RunConfig) -> list[tuple[str, list[str]]]:
    """(process name, ``rlbus role`` arguments) of every role process the config needs at
    the start (each pool at its ``replicas``)."""
    o = cfg.orchestrator
    specs: list[tuple[str, list[str]]] = [
        ("orchestrator", ["orchestrator"]),
        ("trainer", ["trainer"]),
    ]
    for i in range(cfg.inference.replicas):
        specs.append((inference_replica(i), ["inference", "--model", POLICY]))
    for key, model in o.models.items():
        kind = "teacher" if model.kind == "teacher" else "inference"
        specs.append((f"{kind}-{key}", [kind, "--model", key]))
    # Each train env's pool, then each eval-only env's (`orchestrator.eval.env` entries
    # that name no train env: only evaluated, so only started when the run evaluates).
    for env in served_envs(cfg):
        for i in range(env.servers):  # a pool: `env-<id>`, `env-<id>-1`, ...
            specs.append((env_replica(env.id, i), ["env", "--env", env.id]))
    for a in started_algorithms(cfg):
        specs.append((f"algorithm-{a}", ["algorithm", "--name", a]))
    if cfg.monitor.sinks:
        specs.append(("monitor", ["monitor"]))
    if cfg.gateway.enabled:
        specs.append(("gateway", ["gateway"]))
    # The lake and its trace index written as the run goes (stopped last: it ends with the
    # run's last events), so `rlbus trace` and `rlbus sql` after the run sync nothing.
    if lake_missing() is None:
        specs.append(("lake", ["lake"]))
    return specs


def started_algorithms(cfg: RunConfig) -> list[str]:
    """The ids of the algorithm workers ``rlbus up`` starts: the run's, then the warm
    start's others."""
    o = cfg.orchestrator
    algorithms = [a.id for a in o.algorithms]
    if o.warmup.steps > 0:
        algorithms += [a for a in o.warmup.algorithms if a not in algorithms]
    return algorithms


def run_durables(cfg: RunConfig) -> dict[str, list[str]]:
    """The durable consumers each role kind of the run owns (``bus.auth``: no other kind
    may create, fetch, ack or delete them): the trainer's, each served env's, each
    started algorithm worker's (attached workers name theirs at run time)."""
    from bus.subjects import durable_name

    return {
        "trainer": [durable_name("trainer")],
        "env": [durable_name("env", e.key) for e in served_envs(cfg)],
        "algorithm": [durable_name("algorithm", a) for a in started_algorithms(cfg)],
    }


def lake_missing() -> str | None:
    """The table library the lake role lacks here, if any (a trimmed install, e.g. a GPU
    image with only torch and the bus): the run trains without it, and ``rlbus sql`` or
    ``rlbus trace`` syncs the tables later where the libraries are."""
    for module in ("polars", "pyarrow"):
        if importlib.util.find_spec(module) is None:
            return module
    return None


def placed_weights_via(cfg: RunConfig) -> RunConfig:
    """``cfg`` with ``trainer.weights_via = "auto"`` placed as ``rlbus up`` places the run:
    "ipc" when the trainer (one rank) and the torch inference replicas share one CUDA
    device on this host, so each version is a device-to-device copy (on an H200 with the
    ``gpu`` preset: publish -> live 26-44 ms median, 100-142 ms at most, where the host
    path took 1.8 s median); otherwise unchanged (the object store). A role started by
    hand keeps "auto": where it runs is not known. LoRA adapters travel as bytes."""
    t = cfg.trainer
    if t.weights_via != "auto" or t.lora is not None or t.world_size != 1:
        return cfg
    trainer, inference = device_of(cfg, "trainer"), device_of(cfg, "inference")
    if trainer != inference or not trainer.startswith("cuda"):  # (vLLM: "cuda (vllm)")
        return cfg
    return cfg.model_copy(update={"trainer": t.model_copy(update={"weights_via": "ipc"})})


def describe_weights(cfg: RunConfig) -> str:
    """How the trainer's versions reach inference (``rlbus up`` prints it)."""
    t, inf = cfg.trainer, cfg.inference
    via: str = t.weights_via
    if via == "auto":
        via = "the object store (a file past 200 MB)"
    elif via == "ipc":
        via = f"ipc (a shared device ring; every {t.store_weights_every}th version also stored)"
    elif via == "broadcast":
        via = (f"broadcast (torch.distributed from {t.broadcast_host}; every "
               f"{t.store_weights_every}th version also stored)")  # fmt: skip
    swap = "drain" if inf.backend == "vllm" else inf.swap
    return f"weights: via {via}, swapped {swap.replace('_', '-')}"


def process_names(cfg: RunConfig) -> list[str]:
    """Every role process the run may have: those started, and each pool's replicas up
    to its maximum (the CPU plan keeps room for them)."""
    names = [name for name, _ in role_commands(cfg)]
    names += [inference_replica(i) for i in range(cfg.inference.replicas, cfg.inference.pool[1])]
    for env in cfg.orchestrator.train.env:  # (an eval-only env's pool is static)
        names += [env_replica(env.id, i) for i in range(env.replicas, env.pool[1])]
    return names


def role_specs(
    cfg: RunConfig, paths: RunPaths, url: str, plan: dict[str, Slot] | None = None
) -> list[RoleProcess]:
    """Every role process the config needs at the start, placed by the CPU ``plan``
    (default: this run's on this machine)."""
    plan = run_cpu_plan(cfg) if plan is None else plan
    return [
        placed(role_process(name, args, paths, url, sandbox=cfg.bus.sandbox), plan)
        for name, args in role_commands(cfg)
    ]


def run_cpu_plan(cfg: RunConfig) -> dict[str, Slot]:
    """This run's CPU plan on this machine (``roles.up.cpu_plan``)."""
    return cpu_plan(cfg, process_names(cfg), available_cpus())


def placed(r: RoleProcess, plan: dict[str, Slot]) -> RoleProcess:
    """``r`` with its plan slot's environment (a name outside the plan: one thread)."""
    r.env |= plan.get(r.name, Slot(None, 1)).env()
    return r


def role_devices(cfg: RunConfig, roles: list[RoleProcess]) -> dict[str, str]:
    """The device of each role that runs a model, resolved as the role resolves it
    (``trainer.device``, ``inference.device``: "auto" is cuda when torch sees a GPU)."""
    served = device_of(cfg, "inference")
    return {
        r.name: device_of(cfg, "trainer") if r.name == "trainer" else served
        for r in roles
        if r.name == "trainer" or r.name.startswith("inference-")
    }


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())


def launch(
    cfg: RunConfig,
    nats_url: str | None = None,
    live_view: bool = True,
    mode: Mode = "new",
    json_lines: bool = False,
) -> int:
    """Run the whole thing; returns the process exit code. ``mode`` says what to do with
    an earlier launch of the same run id (``roles.up.run_guard``); ``json_lines``: the
    launcher's log lines as JSON (``rlbus up --json``; ``log_as_json``)."""
    run = cfg.run or new_run_id()
    cfg.run = run
    paths = RunPaths.of(cfg)  # cfg.bus.data_dir is settled by the command
    try:
        with RunLock(paths):  # before anything of the run is touched
            previous = previous_run(paths)
            check_previous(paths, mode, previous, cfg.max_steps)
            if mode == "fresh" and previous is not None:
                start_over(paths)
            return _launch_locked(cfg, paths, nats_url, live_view, mode, json_lines)
    except RunRefused as e:
        print(f"rlbus up: {e}", file=sys.stderr)
        if [p.name for p in paths.dir.iterdir()] == [LOCK_FILE]:
            shutil.rmtree(paths.dir)  # a refused new id leaves nothing behind
        return 2


def log_as_json(live_view: bool, json_lines: bool, stdout_tty: bool) -> bool:
    """Whether the launcher's log lines on stderr are JSON: asked for (``--json``), or
    ``--no-view`` on a pipe (a program reads them: the e2e tests read ``role.started``).
    Otherwise a person reads them, live view or not: plain lines (``bus.log``). Either
    way ``logs/launcher.log`` holds them as JSON."""
    return json_lines or (not live_view and not stdout_tty)


def _launch_locked(
    cfg: RunConfig,
    paths: RunPaths,
    nats_url: str | None,
    live_view: bool,
    mode: Mode,
    json_lines: bool = False,
) -> int:
    from bus.log import configure
    from bus.server import running_server_url

    run = paths.run
    paths.logs.mkdir(parents=True, exist_ok=True)
    live = live_view and sys.stdout.isatty()
    # With the live view on a terminal, routine lines would scroll it away: warnings only
    # there (every line still goes to logs/launcher.log).
    configure(
        run=run, role="launcher", json=log_as_json(live_view, json_lines, sys.stdout.isatty()),
        level="WARNING" if live else "INFO", json_file=paths.log("launcher"),
    )  # fmt: skip
    # --nats-url or bus.url, else the run's own embedded server(s) (started unless
    # running), with authentication on. Only servers this launcher started are watched
    # and restarted when they die.
    given = nats_url or cfg.bus.url
    # Said at once: torch's import (devices, the tiny model) takes seconds before the
    # view has anything to show.
    print(f"rlbus up: run {run}: starting the server, the model and the roles", flush=True)
    with contextlib.ExitStack() as stack:
        servers: list[EmbeddedServer] = []
        url = given or running_server_url(paths.nats)
        if url is None:
            started = embedded_servers(cfg, paths)
            stack.enter_context(started)  # starts it (its __enter__ returns it)
            servers = started.nodes if isinstance(started, EmbeddedCluster) else [started]
            url = started.url
        stack.enter_context(launcher_identity(cfg, paths))
        if given:  # the run's stream lives on that server, not under the run directory
            asyncio.run(_check_given_server(url, run, mode))
        with_weights = placed_weights_via(cfg)
        if with_weights is not cfg:
            print('weights: trainer.weights_via = "auto" placed as "ipc" (one GPU)', flush=True)
            cfg = with_weights
        paths.config.write_text(dump_toml(cfg))
        policy_model_dir(cfg, run)  # build the tiny model once, before roles race to it
        plan = run_cpu_plan(cfg)
        roles = role_specs(cfg, paths, url, plan)
        devices = role_devices(cfg, roles)
        print("devices: " + ", ".join(f"{name} {dev}" for name, dev in devices.items()), flush=True)
        print(describe_weights(cfg), flush=True)
        if (missing := lake_missing()) is not None:
            print(f"lake: not started (no module {missing}); `rlbus sql` syncs it later", flush=True)  # fmt: skip
        print(
            "cpus: " + ", ".join(f"{r.name} {plan[r.name].describe()}" for r in roles), flush=True
        )
        if len(servers) > 1:
            print(f"nats cluster: {len(servers)} nodes, {cfg.bus.resolved_replicas()} replicas", flush=True)  # fmt: skip
        pools = run_pools(
            cfg, roles,
            lambda name, args: placed(role_process(name, args, paths, url, sandbox=cfg.bus.sandbox), plan),
        )  # fmt: skip
        return asyncio.run(supervise(cfg, paths, url, roles, live_view, servers, pools))


def embedded_servers(cfg: RunConfig, paths: RunPaths) -> EmbeddedServer | EmbeddedCluster:
    """The run's own server, or cluster (``bus.cluster`` nodes; a resumed run: the nodes
    its store has), with the run's identities as its only users (``bus.auth``)."""
    from bus.auth import RunAuth

    users = RunAuth.ensure(paths.auth, paths.run).declare(run_durables(cfg)).users()
    b = cfg.bus
    tls = Tls(b.tls_cert, b.tls_key, b.tls_ca) if b.tls_cert and b.tls_key else None
    if b.cluster > 1 or is_cluster_store(paths.nats):
        return EmbeddedCluster(paths.nats, b.cluster, users=users, tls=tls)
    return EmbeddedServer.for_run(paths.nats, users=users, tls=tls, monitor_port=b.monitor_port)


def launcher_identity(cfg: RunConfig, paths: RunPaths) -> contextlib.AbstractContextManager[None]:
    """The launcher's own connections use the run's ``launcher`` identity (when it has
    credentials) and its CA; roles inherit the CA (``role_env`` gives each its identity)."""
    from bus.auth import TLS_CA_ENV, env_set

    env = role_env(paths, "launcher")
    if cfg.bus.tls_ca:
        env[TLS_CA_ENV] = str(Path(cfg.bus.tls_ca).absolute())
    return env_set(env)


async def _check_given_server(url: str, run: str, mode: Mode) -> None:
    """On a given server the local directory cannot tell whether the run exists: its
    stream can."""
    exists = await stream_exists(url, run)
    if exists and mode == "new":
        raise RunRefused(
            f"run {run!r} already exists on {url}; --resume continues it, "
            "--fresh deletes it and starts over, or pick another --run"
        )
    if exists and mode == "fresh":
        await delete_stream(url, run)
