"""`rlbus nats config`: one nats-server configuration per host of a real cluster, which
the stock binary accepts (``nats-server -t``), and the run's credentials beside them;
the embedded server's monitoring endpoint is off unless asked for."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

from bus.natsconf import server_conf
from bus.server import find_binary


def test_cluster_config_files(tmp_path: Path) -> None:
    hosts = ["nats-a", "nats-b", "nats-c"]
    args = [
        sys.executable,
        "-m",
        "roles.cli",
        "nats",
        "config",
        "--run",
        "R",
        "--out",
        str(tmp_path),
        "--config",
        "smoke",
    ]
    hosts_args = [x for h in hosts for x in ("--host", h)]
    result = subprocess.run([*args, *hosts_args], capture_output=True, text=True)  # the real CLI
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert "--nats-url nats://nats-a:4222,nats://nats-b:4222,nats://nats-c:4222" in output
    routes = [f"nats-route://{h}:6222" for h in hosts]
    for host in hosts:
        path = tmp_path / f"{host}.conf"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds passwords
        conf = json.loads(path.read_text())
        assert conf["server_name"] == host and conf["cluster"]["routes"] == routes
        users = {u["user"]: u for u in conf["authorization"]["users"]}
        assert "R.env" in users and "R.reader" in users
        # --config: the env servers own their durable, and are denied the trainer's
        env = users["R.env"]["permissions"]["publish"]
        assert "$JS.API.CONSUMER.MSG.NEXT.RL_R.env-reverse-text" in env["allow"]
        assert "$JS.API.CONSUMER.MSG.NEXT.RL_R.trainer" in env["deny"]
        assert "http" not in conf  # no monitoring endpoint
        check = subprocess.run(
            [find_binary(), "-t", "-c", str(path)], capture_output=True, text=True
        )
        assert check.returncode == 0, check.stderr + check.stdout
    assert (tmp_path / "R-admin" / "launcher.creds").exists()
    assert not (tmp_path / "R" / "launcher.creds").exists()
    creds = json.loads((tmp_path / "R" / "env.creds").read_text())
    assert creds["user"] == "R.env" and creds["password"] not in output


def test_monitoring_is_loopback_and_only_when_asked() -> None:
    plain = server_conf(name="n", host="127.0.0.1", port=-1, store_dir="/s")
    assert "http" not in plain and "authorization" not in plain
    watched = server_conf(name="n", host="127.0.0.1", port=-1, store_dir="/s", monitor_port=8222)
    assert watched["http"] == "127.0.0.1:8222"
