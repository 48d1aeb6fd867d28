"""``rlbus up``: one machine, every role as its own process, a live view, a clean stop.

    rlbus up                       # the default preset
    rlbus up -c smoke --no-view    # the smoke preset with plain log lines

It starts an embedded nats-server under ``runs/<run>/nats`` (unless ``--nats-url``, or
the run's embedded server is already running there),
builds the tiny model if that is the configured policy, writes the resolved config to
``runs/<run>/config.toml``, and starts each role with the same ``rlbus role ...``
command a user would type, logging to ``runs/<run>/logs/<role>.log``. A role that dies
is restarted (it resumes from its durable consumer; the log makes that safe). When the
orchestrator publishes ``run.stopped`` (or on Ctrl-C) every role gets SIGTERM and drains;
then ``summary.json`` and ``curves.png`` are written next to the logs.
"""

from __future__ import annotations

import asyncio
import sys
import time

from configs import RunConfig, dump_toml
from configs.paths import RunPaths
from roles.runtime.context import policy_model_dir
from roles.up.processes import RoleProcess, role_process
from roles.up.supervisor import supervise


def role_specs(cfg: RunConfig, paths: RunPaths, url: str) -> list[RoleProcess]:
    """Every role process the config needs."""
    o = cfg.orchestrator
    specs: list[tuple[str, list[str]]] = [
        ("orchestrator", ["orchestrator"]),
        ("trainer", ["trainer"]),
    ]
    for i in range(cfg.inference.replicas):
        specs.append((f"inference-policy-{i}", ["inference", "--model", "policy"]))
    for key, model in o.models.items():
        kind = "teacher" if model.kind == "teacher" else "inference"
        specs.append((f"{kind}-{key}", [kind, "--model", key]))
    for env in o.train.env:
        specs.append((f"env-{env.id}", ["env", "--env", env.id]))
    algorithms = [a.id for a in o.algorithms]
    if o.warmup.steps > 0:
        algorithms += [a for a in o.warmup.algorithms if a not in algorithms]
    for a in algorithms:
        specs.append((f"algorithm-{a}", ["algorithm", "--name", a]))
    return [role_process(name, args, paths, url) for name, args in specs]


def new_run_id() -> str:
    return time.strftime("run-%Y%m%d-%H%M%S", time.gmtime())


def launch(cfg: RunConfig, nats_url: str | None = None, live_view: bool = True) -> int:
    """Run the whole thing; returns the process exit code."""
    from bus.log import configure
    from bus.server import reachable_server

    run = cfg.run or new_run_id()
    cfg.run = run
    paths = RunPaths.of(cfg)  # cfg.bus.data_dir is settled by the command
    paths.logs.mkdir(parents=True, exist_ok=True)
    live = live_view and sys.stdout.isatty()
    # With the live view on a terminal, routine lines would scroll it away: warnings only.
    configure(run=run, role="launcher", json=not live, level="WARNING" if live else "INFO")
    paths.config.write_text(dump_toml(cfg))
    # --nats-url or bus.url, else the run's own embedded server (started unless running).
    with reachable_server(
        paths.nats, nats_url or cfg.bus.url, start="always", url_env=False
    ) as url:
        assert url is not None
        policy_model_dir(cfg, run)  # build the tiny model once, before roles race to it
        roles = role_specs(cfg, paths, url)
        return asyncio.run(supervise(cfg, paths, url, roles, live_view))
