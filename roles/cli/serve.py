"""``rlbus serve``: a model behind an OpenAI-compatible endpoint, for any OpenAI client.

    rlbus serve --model my-qwen3               # prints: base_url=http://127.0.0.1:8000/v1 api_key=...
    rlbus serve --model my-qwen3 --port 0 gateway.max_tokens=64

It starts what a run would for this (a NATS server on the run's store unless
``--nats-url`` names one, one inference replica of ``policy`` on ``--model``, and the
gateway role, ``roles.gateway``), waits until the endpoint answers ``GET /v1/models``
with the run's key, prints one line ``base_url=... api_key=...`` and serves until
Ctrl-C or SIGTERM (then stops its roles). The config is ``-c`` (default ``smoke``) with
the overrides; ``rlbus up``'s checks run first (the model, its chat template).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import typer

from roles.cli.common import fail, run_option


def serve(
    overrides: list[str] = typer.Argument(None, help="Config overrides, dotted: gateway.max_tokens=64"),
    model: Path | None = typer.Option(None, "--model", "-m", help="Model directory (default: the config's model.path)."),
    port: int = typer.Option(8000, "--port", "-p", help="Port (0: any free one)."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind (loopback by default)."),
    config: str = typer.Option("smoke", "--config", "-c", help="Preset name or TOML file."),
    run: str | None = run_option(None, "Run id (default: a new one)."),
    nats_url: str | None = typer.Option(None, "--nats-url", help="Use this NATS server."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds to wait for the endpoint."),
) -> None:  # fmt: skip
    """Serve a model through an OpenAI-compatible endpoint (inference + the gateway)."""
    from bus.server import reachable_server
    from configs import ConfigError
    from configs.paths import RunPaths
    from roles.cli.rollout import load_cfg
    from roles.up import preflight
    from roles.up.rollout import write_config

    more = [
        *(overrides or []),
        f"gateway.port={port}",
        f"gateway.host={host}",
        "gateway.enabled=true",
    ]
    if model is not None:
        more.append(f"model.path={model}")
    cfg = load_cfg(config, more)
    cfg.run = run or cfg.run or time.strftime("serve-%Y%m%d-%H%M%S", time.gmtime())
    try:
        preflight.check(cfg)
    except ConfigError as e:
        fail(f"config error: {e}")
    paths = RunPaths.of(cfg)
    config_path = write_config(cfg, paths)
    with reachable_server(paths.nats, nats_url, start="always", identity="launcher") as url:
        assert url is not None
        code = asyncio.run(_serve(cfg, paths, url, config_path, timeout))
    raise typer.Exit(code)


async def _serve(cfg: Any, paths: Any, url: str, config_path: Path, timeout_s: float) -> int:
    from bus.runtime import Bus
    from roles.gateway.role import run_api_key
    from roles.runtime.context import bus_settings, policy_model_dir
    from roles.up.processes import role_process
    from roles.up.rollout import stop_roles

    await asyncio.to_thread(policy_model_dir, cfg, paths.run)  # (the tiny model: built once)
    bus = await Bus.connect(url, run=paths.run, producer="cli-serve", settings=bus_settings(cfg))
    await bus.ensure_stream()
    roles = [
        role_process("inference-policy-0", ["inference", "--model", "policy"], paths, url,
                     config_path, sandbox=cfg.bus.sandbox),
        role_process("gateway", ["gateway"], paths, url, config_path, sandbox=cfg.bus.sandbox),
    ]  # fmt: skip
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        for r in roles:
            r.start()
        base_url = await _endpoint(bus, paths, roles, timeout_s)
        if base_url is None:
            return 1
        typer.echo(f"base_url={base_url} api_key={run_api_key(paths)}", nl=True)
        while not stop.is_set():
            if dead := [r.name for r in roles if r.proc is not None and r.proc.poll() is not None]:
                typer.echo(f"serve: {', '.join(dead)} exited; see {paths.log(dead[0])}", err=True)
                return 1
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
        return 0
    finally:
        await stop_roles(roles)
        await bus.close()


async def _endpoint(bus: Any, paths: Any, roles: list[Any], timeout_s: float) -> str | None:
    """The gateway's base URL once ``GET /v1/models`` lists ``policy`` (the gateway
    answers with the run's key, the heartbeat says where it bound, the inference replica
    is live), or None (said why) when a role died or time ran out."""
    from roles.gateway.role import run_api_key

    deadline = time.monotonic() + timeout_s
    waiting = "the gateway's heartbeat"
    while time.monotonic() < deadline:
        if dead := [r.name for r in roles if r.proc is not None and r.proc.poll() is not None]:
            typer.echo(
                f"serve: {dead[0]} exited while starting; see {paths.log(dead[0])}", err=True
            )
            return None
        beats = [hb for hb in await bus.live_roles() if hb.role == "gateway"]
        base = next((hb.info.get("base_url") for hb in beats if hb.info.get("base_url")), None)
        if base:
            waiting = f"{base}/models to list policy (its inference replica to start)"
            if await asyncio.to_thread(_answers, base, run_api_key(paths)):
                return base
        await asyncio.sleep(0.5)
    typer.echo(f"serve: gave up after {timeout_s:g} s waiting for {waiting}", err=True)
    return None


def _answers(base_url: str, key: str) -> bool:
    req = urllib.request.Request(f"{base_url}/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status == 200 and "policy" in [m["id"] for m in json.loads(r.read())["data"]]
    except OSError:
        return False
