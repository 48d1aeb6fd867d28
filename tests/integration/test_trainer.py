"""The trainer role on a real nats-server: weights per batch, idempotence, gaps, crash/resume."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import pytest
import torch
from structlog.testing import capture_logs

from bus.reader import read_log
from bus.registry import list_roles
from bus.runtime import Bus, BusSettings
from bus.server import EmbeddedServer
from bus.subjects import Topic, subject
from configs import RunConfig, dump_toml, load_config
from roles.lib.model.loading import load_model
from roles.lib.model.shared_weights import Layout, SharedReader
from roles.lib.model.tiny import build_tiny_model
from roles.lib.model.weights import load_state_bytes
from roles.runtime.context import RoleContext
from roles.runtime.role import serve_role
from roles.trainer.core import TrainerCore, latest_checkpoint
from roles.trainer.role import TrainerRole
from schemas import DeadLettered, MetricsReported, WeightsPublished, WeightsStored
from tests.unit.test_trainer_core import synthetic_batch

pytestmark = pytest.mark.nats


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("trainer-int") / "tiny", seed=0)


def trainer_config(tiny_dir: Path, data_dir: Path, *extra: str) -> RunConfig:
    return load_config(
        "smoke",
        [f"model.path={tiny_dir}", "trainer.checkpoint_interval=2", f"bus.data_dir={data_dir}",
         "trainer.device=cpu", *extra],
    )  # fmt: skip


async def read_all(bus: Bus, topic: Topic, types: tuple[type, ...]) -> list[Any]:
    """Every event of ``topic`` on the run's stream, in order."""
    return [e async for e in read_log(bus, [(topic, None)], types)]


async def wait_for_version(bus: Bus, version: int, timeout_s: float = 60.0) -> None:
    """Until the newest WeightsPublished on the stream has at least ``version``."""
    async with asyncio.timeout(timeout_s):
        while True:
            try:
                msg = await bus.js.get_last_msg(
                    bus.stream, subject(bus.run, Topic.WEIGHTS_PUBLISHED)
                )
                event = await bus.decode_msg(msg, (WeightsPublished,))
                if event.version >= version:
                    return
            except nats.js.errors.NotFoundError:
                pass
            await asyncio.sleep(0.05)


def reference_digests(cfg: RunConfig, tiny_dir: Path, batches: list[Any]) -> list[str]:
    """Weights digest after each batch of an uninterrupted in-process TrainerCore."""
    core = TrainerCore(cfg, tiny_dir)
    out = []
    for batch in batches:
        core.train_step(batch)
        out.append(core.weights_digest())
    return out


async def start_role(cfg: RunConfig, url: str, run: str) -> tuple[TrainerRole, asyncio.Task[None]]:
    """Serve a TrainerRole in this process; returns once it has caught up and consumes."""
    ctx = RoleContext(run=run, url=url, cfg=cfg, instance="trainer-test")
    role = TrainerRole(await ctx.connect(), ctx)
    task = asyncio.create_task(serve_role(role, install_signals=False))
    async with asyncio.timeout(60):
        while not role.consumers:  # serve_role sets them once setup (catch-up) is done
            if task.done():
                await task  # re-raise its error
            await asyncio.sleep(0.05)
    return role, task


async def stop_role(role: TrainerRole, task: asyncio.Task[None]) -> None:
    """Stop the role and wait for it; a role that failed re-raises its error here."""
    role.request_stop()
    await asyncio.wait_for(task, 60)


async def test_trainer_publishes_weights_per_batch_and_resumes(
    nats_server: EmbeddedServer, bus: Bus, tiny_dir: Path, tmp_path: Path
) -> None:
    """One WeightsPublished per step (version == step, loadable, digest-checked); a duplicate step is
    not retrained; a restarted role catches up from its checkpoint and the log, continuing the fold."""
    cfg = trainer_config(tiny_dir, tmp_path)
    batches = [synthetic_batch(bus.run, s, phase="sft" if s == 1 else "rl") for s in range(1, 5)]
    duplicate = msgspec.structs.replace(batches[1], event_id="another-id-for-step-2")
    expected = reference_digests(cfg, tiny_dir, batches)

    # Batch bodies go to the object store, as large real batches do.
    offloading = await Bus.connect(
        nats_server.url,
        run=bus.run,
        producer="test",
        settings=BusSettings(offload_threshold_bytes=1024),
    )
    role, task = await start_role(cfg, nats_server.url, bus.run)
    try:
        await offloading.publish_many([batches[0], batches[1], duplicate, batches[2]])
        await wait_for_version(bus, 3)
    finally:
        await stop_role(role, task)
    checkpoint = latest_checkpoint(tmp_path / bus.run)
    assert checkpoint is not None and checkpoint.name == "step-00000003"  # saved on stop
    (hb,) = await list_roles(bus.js, bus.run)
    assert hb.policy_version == 3 and hb.status == "stopped"

    await offloading.publish(batches[3])
    await offloading.close()
    last = await bus.js.get_last_msg(bus.stream, subject(bus.run, Topic.BATCH_ASSEMBLED))
    assert last.headers is not None and last.headers["Rl-Body"] == "ref"
    role, task = await start_role(cfg, nats_server.url, bus.run)
    try:
        await wait_for_version(bus, 4)
    finally:
        await stop_role(role, task)

    weights = await read_all(bus, Topic.WEIGHTS_PUBLISHED, (WeightsPublished,))
    assert [w.version for w in weights] == [1, 2, 3, 4]
    assert [w.step for w in weights] == [1, 2, 3, 4]
    assert [w.batch_id for w in weights] == [b.event_id for b in batches]
    assert [w.weights.digest for w in weights] == expected
    model = load_model(tiny_dir)
    for w in (weights[0], weights[-1]):
        assert w.weights.kind == "object" and w.weights.bucket == bus.objects.bucket
        data = await bus.objects.get(w.weights.location, w.weights.digest)
        assert len(data) == w.weights.size
        load_state_bytes(model, data, w.weights.digest)

    metrics = await read_all(bus, Topic.METRICS_REPORTED, (MetricsReported,))
    assert [(m.role, m.step, m.policy_version) for m in metrics] == [
        ("trainer", s, s) for s in (1, 2, 3, 4)
    ]
    assert all({"loss", "grad_norm", "entropy", "lr", "wait_s"} <= m.values.keys() for m in metrics)
    assert metrics[0].values["ce_tokens"] > 0 and metrics[1].values["rl_tokens"] > 0
    # Steps 1-3 came through the durable consumer, step 4 through the restart's catch-up.
    assert all(m.values["wait_s"] > 0 for m in metrics[:3]) and metrics[3].values["wait_s"] == 0


async def test_a_gap_in_steps_is_dead_lettered_not_skipped(
    nats_server: EmbeddedServer, bus: Bus, tiny_dir: Path, tmp_path: Path
) -> None:
    """Step 3 arriving after step 1 is retried then dead-lettered; the trainer never jumps ahead."""
    cfg = trainer_config(tiny_dir, tmp_path, "bus.max_deliver=2", "bus.nak_delay_s=0.1")
    role, task = await start_role(cfg, nats_server.url, bus.run)
    try:
        await bus.publish_many([synthetic_batch(bus.run, 1, 2), synthetic_batch(bus.run, 3, 2)])
        async with asyncio.timeout(30):
            while not (dead := await read_all(bus, Topic.DEAD_LETTERED, (DeadLettered,))):
                await asyncio.sleep(0.2)
    finally:
        await stop_role(role, task)
    assert dead[0].role == "trainer" and dead[0].error_type == "BatchGap"
    assert "step 2 is missing" in dead[0].error
    weights = await read_all(bus, Topic.WEIGHTS_PUBLISHED, (WeightsPublished,))
    assert [w.version for w in weights] == [1]


def start_trainer_process(
    url: str, run: str, cfg_path: Path, log_path: Path
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-c", "from roles.cli import main; main()", "role", "trainer",
           "--run", run, "--nats-url", url, "--config", str(cfg_path)]  # fmt: skip
    env = {**os.environ, "RLBUS_TORCH_THREADS": "1"}
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=log, env=env)


async def stop_process(proc: subprocess.Popen[bytes], sig: int, timeout_s: float = 60) -> int:
    """Send ``sig`` and wait; a process that does not exit in time is killed (never left behind)."""
    proc.send_signal(sig)
    try:
        return await asyncio.to_thread(proc.wait, timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        await asyncio.to_thread(proc.wait, 30)
        raise AssertionError(
            f"trainer pid {proc.pid} ignored signal {sig} for {timeout_s}s"
        ) from None


@pytest.mark.e2e
async def test_trainer_process_killed_mid_run_resumes_without_retraining_or_skipping(
    nats_server: EmbeddedServer, bus: Bus, tiny_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL after ~3 of the batches, restart: exactly one WeightsPublished per step and every
    digest equals an uninterrupted in-process TrainerCore's (nothing trained twice or skipped)."""
    cfg = load_config(
        "smoke",
        [
            f"model.path={tiny_dir}",
            "trainer.checkpoint_interval=2",
            f"bus.data_dir={tmp_path}",
            "trainer.device=cpu",
        ],  # fmt: skip
    )
    cfg_path = tmp_path / "run.toml"
    cfg_path.write_text(dump_toml(cfg))
    batches = [synthetic_batch(bus.run, s, n_samples=32) for s in range(1, 7)]
    expected = reference_digests(cfg, tiny_dir, batches)
    logs = [tmp_path / "trainer-1.log", tmp_path / "trainer-2.log"]

    first = start_trainer_process(nats_server.url, bus.run, cfg_path, logs[0])
    try:
        async with asyncio.timeout(120):  # its durable consumer exists once it heartbeats
            while not [h for h in await list_roles(bus.js, bus.run) if h.role == "trainer"]:
                assert first.poll() is None, logs[0].read_text()
                await asyncio.sleep(0.2)
        await bus.publish_many(batches[:4])
        await wait_for_version(bus, 3, timeout_s=120)
    finally:
        await stop_process(first, signal.SIGKILL)
    assert first.returncode == -signal.SIGKILL

    await bus.publish_many(batches[4:])
    second = start_trainer_process(nats_server.url, bus.run, cfg_path, logs[1])
    try:
        await wait_for_version(bus, 6, timeout_s=120)
        # SIGTERM once it serves, between heartbeats: bus.registry.Heartbeat.stop can hang
        # when its cancel lands on an in-flight beat (Python 3.11 wait_for swallows it).
        async with asyncio.timeout(60):
            while "role.started" not in logs[1].read_text():
                await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)
    finally:
        code = await stop_process(second, signal.SIGTERM)
    log = logs[1].read_text()
    assert code == 0, log
    assert "replay_diverged" not in log

    weights = await read_all(bus, Topic.WEIGHTS_PUBLISHED, (WeightsPublished,))
    assert sorted(w.version for w in weights) == [1, 2, 3, 4, 5, 6]
    assert {w.version: w.weights.digest for w in weights} == dict(enumerate(expected, start=1))
    final = max(weights, key=lambda w: w.version).weights
    assert (await bus.objects.get(final.location, final.digest)) is not None
    checkpoint = latest_checkpoint(tmp_path / bus.run)
    assert checkpoint is not None and checkpoint.name == "step-00000006"


async def test_weights_shared_on_the_device_are_announced_and_every_nth_stored_after(
    nats_server: EmbeddedServer, bus: Bus, tiny_dir: Path, tmp_path: Path
) -> None:
    """``trainer.weights_via = "ipc"``: every version is announced at once with its ring
    slot (``device``, a device digest); every ``store_weights_every``-th version's bytes
    are stored after its announcement (``weights.stored``, while the next step trains),
    the last version's in its announcement. A replica's copy out of the ring is the
    trainer's weights. A trainer restarted from scratch recomputes every version into a
    new ring with the recorded device digests (no ``trainer.replay_diverged``), and its
    catch-up stores a version the stride (now 2) stores that was never stored."""
    first = trainer_config(tiny_dir, tmp_path, "trainer.weights_via=ipc",
                           "trainer.store_weights_every=3", "max_steps=4")  # fmt: skip
    batches = [synthetic_batch(bus.run, s, phase="sft" if s == 1 else "rl") for s in range(1, 5)]
    expected = reference_digests(first, tiny_dir, batches)
    reference = TrainerCore(first, tiny_dir)
    for batch in batches[:3]:
        reference.train_step(batch)
    role, task = await start_role(first, nats_server.url, bus.run)
    try:
        await bus.publish_many(batches[:3])
        await wait_for_version(bus, 3)
        (v3,) = [w for w in await read_all(bus, Topic.WEIGHTS_PUBLISHED, (WeightsPublished,)) if w.version == 3]  # fmt: skip
        replica = load_model(tiny_dir)
        reader = SharedReader(Layout.of(replica.state_dict()), torch.device("cpu"))
        assert v3.device is not None
        reader.load_into(replica, reader.read(v3.device))
        own = reference.model.state_dict()
        assert all(torch.equal(t, own[k]) for k, t in replica.state_dict().items())
    finally:
        await stop_role(role, task)  # waits for the store in flight
    stored = await read_all(bus, Topic.WEIGHTS_STORED, (WeightsStored,))
    assert [(w.version, w.weights.digest) for w in stored] == [(3, expected[2])]
    shutil.rmtree(tmp_path / bus.run / "checkpoints")  # back to the initial weights
    second = trainer_config(tiny_dir, tmp_path, "trainer.weights_via=ipc",
                            "trainer.store_weights_every=2", "max_steps=4")  # fmt: skip
    with capture_logs() as logs:
        role, task = await start_role(second, nats_server.url, bus.run)
        try:
            await bus.publish(batches[3])
            await wait_for_version(bus, 4)
        finally:
            await stop_role(role, task)
    assert not [e for e in logs if e["event"] == "trainer.replay_diverged"]
    weights = await read_all(bus, Topic.WEIGHTS_PUBLISHED, (WeightsPublished,))
    assert [w.version for w in weights] == [1, 2, 3, 4]
    assert all(w.device is not None and w.device.digest.startswith("dev:") for w in weights)
    assert [w.weights.kind for w in weights] == ["ipc", "ipc", "ipc", "object"]
    assert weights[-1].weights.digest == expected[3]
    stored = await read_all(bus, Topic.WEIGHTS_STORED, (WeightsStored,))
    assert [(w.version, w.weights.digest) for w in stored] == [(3, expected[2]), (2, expected[1])]
    for w in stored:  # the bytes are there, and they are the announced version's
        assert w.causation_id == weights[w.version - 1].event_id
        assert await bus.objects.get(w.weights.location, w.weights.digest) is not None


async def test_a_store_after_the_announcement_that_fails_never_stops_training(
    nats_server: EmbeddedServer,
    bus: Bus,
    tiny_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The store of a version announced on the device fails with an error nobody expected
    (a full host, a device error): it is logged, the version stays device-only, and every
    later step trains, is announced and checkpointed as usual."""
    cfg = trainer_config(tiny_dir, tmp_path, "trainer.weights_via=ipc",
                         "trainer.store_weights_every=2", "max_steps=4")  # fmt: skip
    store = TrainerRole._store_weights

    async def failing(self: TrainerRole, version: int, *args: Any, **kwargs: Any) -> Any:
        if version == 2:
            raise RuntimeError("no space left for v2")
        return await store(self, version, *args, **kwargs)

    monkeypatch.setattr(TrainerRole, "_store_weights", failing)
    batches = [synthetic_batch(bus.run, s, phase="sft" if s == 1 else "rl") for s in range(1, 5)]
    role, task = await start_role(cfg, nats_server.url, bus.run)
    try:
        await bus.publish_many(batches)
        await wait_for_version(bus, 4)
    finally:
        await stop_role(role, task)
    weights = await read_all(bus, Topic.WEIGHTS_PUBLISHED, (WeightsPublished,))
    assert [(w.version, w.weights.kind) for w in weights] == [
        (1, "ipc"),
        (2, "ipc"),
        (3, "ipc"),
        (4, "object"),
    ]
    assert await read_all(bus, Topic.WEIGHTS_STORED, (WeightsStored,)) == []
    checkpoint = latest_checkpoint(tmp_path / bus.run)
    assert checkpoint is not None and checkpoint.name == "step-00000004"
