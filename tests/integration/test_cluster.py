"""A real three-node JetStream cluster on loopback, and TLS on a real server.

The cluster: it starts with a meta leader, a run's stream gets three replicas, a
publish with the stream's leader killed mid-run still lands once (retried with the same
id), and the dead node restarts on its ports and store and catches up. TLS: a server
with a certificate this test creates serves clients that check it against the test's
CA, and refuses plain ones."""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bus.auth import TLS_CA_ENV
from bus.cluster import EmbeddedCluster
from bus.errors import ServerUnreachable
from bus.natsconf import Tls
from bus.reader import read_log
from bus.runtime import Bus, BusSettings
from bus.server import EmbeddedServer
from bus.subjects import Topic
from schemas import EVENT_TYPES, RunStopped


async def test_cluster_survives_the_stream_leader(tmp_path: Path) -> None:
    with EmbeddedCluster(tmp_path / "c", 3) as cluster:
        assert cluster.url.count(",") == 2
        bus = await Bus.connect(cluster.url, "r3", "test", settings=BusSettings(replicas=3))
        try:
            await bus.ensure_run()
            info = await bus.js.stream_info(bus.stream)
            assert info.config.num_replicas == 3 and info.cluster is not None
            obj = await bus.js.stream_info(bus.objects.stream)
            assert obj.config.num_replicas == 3
            await bus.publish(RunStopped(run="r3", reason="before"))
            leader = cluster.node_named(info.cluster.leader or "")
            assert leader.proc is not None
            leader.proc.kill()
            leader.proc.wait()
            # the same event twice: one copy, whichever node acks it
            after = RunStopped(run="r3", reason="after")
            await bus.publish(after)
            await bus.publish(after)
            await leader.restart()
            assert cluster.alive
            events = [e async for e in read_log(bus, [(Topic.RUN_STOPPED, None)], EVENT_TYPES)]
            assert [e.reason for e in events] == ["before", "after"]
            for _ in range(100):  # the restarted node catches up and serves as a replica
                info = await bus.js.stream_info(bus.stream)
                peers = {r.name: r for r in info.cluster.replicas or []}  # type: ignore[union-attr]
                back = peers.get(leader.name)
                if info.cluster.leader == leader.name or (back and back.current):  # type: ignore[union-attr]
                    break
                await asyncio.sleep(0.2)
            else:
                pytest.fail(f"{leader.name} never caught up: {info.cluster}")
        finally:
            await bus.close()


def _certificates(directory: Path) -> Tls:
    """A CA and a server certificate for 127.0.0.1 signed by it (PEM files)."""
    now = dt.datetime.now(dt.UTC)

    def cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: str, signer: ec.EllipticCurvePrivateKey, ca: bool) -> x509.Certificate:  # fmt: skip
        b = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=1))
            .not_valid_after(now + dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
            b = b.add_extension(san, critical=False)
        return b.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    files = {
        "ca.pem": cert("rlbus test CA", ca_key, "rlbus test CA", ca_key, ca=True),
        "server.pem": cert("127.0.0.1", key, "rlbus test CA", ca_key, ca=False),
    }
    for name, c in files.items():
        (directory / name).write_bytes(c.public_bytes(serialization.Encoding.PEM))
    (directory / "server.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return Tls(str(directory / "server.pem"), str(directory / "server.key"), str(directory / "ca.pem"))  # fmt: skip


async def test_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tls = _certificates(tmp_path)
    with EmbeddedServer(tmp_path / "nats", tls=tls) as server:
        assert server.url.startswith("tls://127.0.0.1:")
        with pytest.raises(ServerUnreachable):  # no CA: the certificate is unknown
            await Bus.connect(server.url, "t", "test", connect_timeout_s=3)
        plain = server.url.replace("tls://", "nats://")
        with pytest.raises(ServerUnreachable):  # no TLS at all
            await Bus.connect(plain, "t", "test", connect_timeout_s=3)
        monkeypatch.setenv(TLS_CA_ENV, tls.ca or "")
        bus = await Bus.connect(server.url, "t", "test")
        try:
            await bus.ensure_stream()
            ack = await bus.publish(RunStopped(run="t", reason="tls"))
            assert ack.seq == 1
        finally:
            await bus.close()
