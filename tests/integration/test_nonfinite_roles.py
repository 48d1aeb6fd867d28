"""Nothing non-finite is trained: the trainer role on a real nats-server, and 2 ranks.

A batch with a NaN advantage is dead-lettered (``Rejected``) and counted as a step that
trained nothing (its version is the previous weights); a step whose loss overflows is
not applied; the run trains on, and a replay of the recorded batches reaches the same
metrics and weights. On 2 ranks the same decisions are taken on every rank. An
inference replica refuses announced weights holding a NaN and keeps serving its own.
"""

from __future__ import annotations

import asyncio
import math
import shutil
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from bus.errors import Rejected
from bus.runtime import Bus
from bus.server import EmbeddedServer
from bus.subjects import Topic
from configs import load_config
from replay.diff import StepRecord
from replay.trainer import replay_steps
from roles.lib.model.loading import load_model
from roles.lib.model.tiny import build_tiny_model
from roles.lib.model.weights import state_dict_to_bytes
from roles.trainer.core import TrainerCore
from roles.trainer.group import make_trainer, start_ranks
from schemas import BatchAssembled, DeadLettered, MetricsReported, ObjectRef, WeightsPublished
from schemas.arrays import f32, mask, pack_f32, pack_mask
from tests.integration.test_inference import running_role
from tests.integration.test_trainer import (
    read_all,
    start_role,
    stop_role,
    trainer_config,
    wait_for_version,
)
from tests.samples import batch_for
from tests.unit.test_trainer_core import synthetic_batch


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("nonfinite-roles") / "tiny", seed=0)


def nan_advantage(batch: BatchAssembled, index: int) -> BatchAssembled:
    """``batch`` with a NaN advantage on the first trained token of sample ``index``."""
    sample = batch.samples[index]
    values = f32(sample.advantages).copy()
    values[int(np.argmax(mask(sample.mask)))] = np.nan
    samples = list(batch.samples)
    samples[index] = msgspec.structs.replace(sample, advantages=pack_f32(values.tolist()))
    return msgspec.structs.replace(batch, samples=samples)


def overflowing(batch: BatchAssembled) -> BatchAssembled:
    """Finite everywhere (it passes ``Sample.problem``), but its ce loss overflows to inf."""
    samples = []
    for s in batch.samples:
        m = mask(s.mask)
        weights = np.where(m > 0, np.float32(3e38), np.float32(0.0))
        samples.append(
            msgspec.structs.replace(s, sft_mask=pack_mask(m.tolist()), ce_weights=pack_f32(weights.tolist()))
        )  # fmt: skip
    return msgspec.structs.replace(batch, samples=samples)


def four_batches(run: str) -> list[BatchAssembled]:
    """Good, NaN advantage (refused), good, overflowing (not applied)."""
    batches = [synthetic_batch(run, s, n_samples=2) for s in range(1, 5)]
    return [batches[0], nan_advantage(batches[1], 1), batches[2], overflowing(batches[3])]


@pytest.mark.nats
async def test_a_nan_batch_is_dead_lettered_and_the_trainer_trains_on(
    nats_server: EmbeddedServer, bus: Bus, tiny_dir: Path, tmp_path: Path
) -> None:
    cfg = trainer_config(tiny_dir, tmp_path)
    batches = four_batches(bus.run)
    with capture_logs() as logs:
        role, task = await start_role(cfg, nats_server.url, bus.run)
        try:
            await bus.publish_many(batches)
            await wait_for_version(bus, 4, timeout_s=30)
        finally:
            await stop_role(role, task)

    (dead,) = await read_all(bus, Topic.DEAD_LETTERED, (DeadLettered,))
    assert dead.role == "trainer" and dead.error_type == "Rejected" and dead.deliveries == 1
    assert "batch step 2 sample 1" in dead.error and "advantages holds a non-finite" in dead.error
    assert dead.causation_id == batches[1].event_id

    weights = await read_all(bus, Topic.WEIGHTS_PUBLISHED, (WeightsPublished,))
    assert [w.version for w in weights] == [1, 2, 3, 4]
    v1, v2, v3, v4 = (w.weights.digest for w in weights)
    assert v2 == v1 and v3 != v2 and v4 == v3  # steps 2 and 4 trained nothing

    metrics = {m.step: m.values for m in await read_all(bus, Topic.METRICS_REPORTED, (MetricsReported,))}  # fmt: skip
    assert metrics[2]["refused_batch"] == 1.0 and "loss" not in metrics[2]
    assert metrics[3]["loss_tokens"] > 0 and "nonfinite_step" not in metrics[3]
    assert metrics[4]["nonfinite_step"] == 1.0
    events = {e["event"]: e for e in logs}
    assert events["trainer.batch_refused"]["step"] == 2
    assert events["trainer.nonfinite_step"]["log_level"] == "warning"
    assert events["trainer.nonfinite_step"]["step"] == 4

    # A replay of the recorded batches steps over the same batches: same metrics, digests.
    recorded = {w.step: StepRecord(w.step, metrics[w.step], w.weights.digest) for w in weights}
    replayed = replay_steps(TrainerCore(cfg, tiny_dir), batches, recorded)
    assert replayed.ok and [r.step for r in replayed.steps] == [1, 2, 3, 4], replayed.divergence

    # So does a trainer that lost its checkpoints: its catch-up over the log recomputes
    # every recorded digest (no trainer.replay_diverged) and adds nothing to the log.
    shutil.rmtree(tmp_path / bus.run / "checkpoints")
    with capture_logs() as logs:
        role, task = await start_role(cfg, nats_server.url, bus.run)
        await stop_role(role, task)
    assert role.core.step == 4
    assert not [e for e in logs if e["event"] == "trainer.replay_diverged"]
    assert len(await read_all(bus, Topic.WEIGHTS_PUBLISHED, (WeightsPublished,))) == 4
    assert len(await read_all(bus, Topic.DEAD_LETTERED, (DeadLettered,))) == 1


def test_two_ranks_refuse_and_drop_the_same_steps(tiny_dir: Path) -> None:
    """Rank 0 refuses the NaN batch before any rank trains it and the other rank steps
    over it too (step 3 would be a gap there otherwise); the overflowing step is dropped
    on both ranks (the gathered weights are unchanged), and step 5 trains on both."""
    cfg = load_config(
        "smoke",
        ["trainer.seq_len=256", "trainer.lr=1e-3", "trainer.device=cpu",
         "trainer.micro_batch_size=1", "trainer.world_size=2"],
    )  # fmt: skip
    batches = [*four_batches("ranks-nonfinite"), synthetic_batch("ranks-nonfinite", 5, 2)]
    core = make_trainer(cfg, tiny_dir, start_ranks(cfg, tiny_dir))
    try:
        digests, found = [], []
        for batch in batches:
            try:
                found.append(core.train_step(batch))
            except Rejected:
                found.append(core.refuse_step(batch))
            digests.append(core.weights_digest())
    finally:
        core.close()
    assert found[1]["refused_batch"] == 1.0 and found[3]["nonfinite_step"] == 1.0
    assert all("nonfinite_step" not in found[i] for i in (0, 2, 4))
    assert digests[1] == digests[0] and digests[3] == digests[2]
    assert len({digests[0], digests[2], digests[4]}) == 3
    assert core.step == 5


async def publish_weights(bus: Bus, version: int, data: bytes) -> None:
    name = f"weights.v{version}"
    stored = await bus.objects.put(name, data)
    ref = ObjectRef(kind="object", location=name, bucket=bus.objects.bucket, size=len(data), digest=stored)  # fmt: skip
    await bus.publish(batch_for(bus.run, version))  # as a trainer step follows its batch
    await bus.publish(WeightsPublished(run=bus.run, version=version, step=version, weights=ref))


@pytest.mark.nats
async def test_inference_refuses_nan_weights_and_keeps_serving(
    nats_server: EmbeddedServer, bus: Bus, tiny_dir: Path, tmp_path: Path
) -> None:
    """v1 holds a NaN (its digest is right): refused at once, naming the tensor; v0
    keeps serving; a finite v2 is loaded after it."""
    cfg = load_config(
        "smoke", [f"model.path={tiny_dir}", "inference.device=cpu", "inference.batch_window_ms=5"]
    )
    model = load_model(tiny_dir)
    with torch.no_grad():
        model.model.norm.weight[0] = math.nan
    poisoned = state_dict_to_bytes(model)
    with torch.no_grad():
        model.model.norm.weight[0] = 1.0
    finite = state_dict_to_bytes(model)
    with capture_logs() as logs:
        async with running_role(nats_server, bus.run, cfg, tmp_path, "inf-nan") as role:
            await publish_weights(bus, 1, poisoned)
            async with asyncio.timeout(20):
                while role.weights_rejected == 0:
                    await asyncio.sleep(0.05)
            assert role.backend is not None and role.backend.policy_version == 0
            await publish_weights(bus, 2, finite)
            async with asyncio.timeout(20):
                while role.backend.policy_version != 2:
                    await asyncio.sleep(0.05)
    (refused,) = [e for e in logs if e["event"] == "weights.refused"]
    assert refused["log_level"] == "error" and refused["version"] == 1
    assert refused["tensor"] == "model.norm.weight"
    assert not [e for e in logs if e["event"] == "weights.fetch_retry"]
