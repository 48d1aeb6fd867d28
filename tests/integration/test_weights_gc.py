"""Weights garbage collection on a real nats-server: the trainer deletes old weights,
deletes are idempotent and give the disk back, and readers of a deleted version fail
clearly or move on to the newest, never hang."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.js.api import ObjectInfo
from structlog.testing import capture_logs

from bus.errors import BodyError
from bus.offload import BodyStore
from bus.reader import read_log
from bus.runtime import Bus, BusSettings
from bus.server import EmbeddedServer
from bus.subjects import Topic
from configs import RunConfig, load_config
from configs.paths import RunPaths
from roles.inference.role import InferenceRole
from roles.lib.model.loading import load_model
from roles.lib.model.tiny import build_tiny_model
from roles.lib.model.weights import digest, state_dict_to_bytes
from roles.trainer import retention
from schemas import ObjectRef, WeightsPublished
from tests.integration.test_trainer import start_role, stop_role, trainer_config, wait_for_version
from tests.samples import batch_for
from tests.unit.test_trainer_core import synthetic_batch

pytestmark = pytest.mark.nats

MB = 1024 * 1024


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("weights-gc") / "tiny", seed=0)


def stream_dir_bytes(server: EmbeddedServer, stream: str) -> int:
    """Bytes the server's file store holds on disk for ``stream``'s messages."""
    return sum(
        f.stat().st_blocks * 512
        for d in server.data_dir.rglob(stream)
        for f in (d / "msgs").glob("*.blk")
    )


# -- the rule ---------------------------------------------------------------------------


def test_retention_keeps_the_newest_and_the_initial_weights() -> None:
    assert retention.collectable(range(0, 11), newest=10, keep=3) == list(range(1, 8))
    # 12: not announced yet; stored versions count, not steps (a stride stores every 10th)
    assert retention.collectable([0, 5, 7, 9, 10, 12], newest=10, keep=3) == [5]
    assert retention.collectable([0, 10, 20, 30, 31], newest=31, keep=3) == [10]
    assert retention.collectable(range(0, 11), newest=10, keep=0) == []  # 0 = keep all
    assert retention.collectable(range(0, 3), newest=2, keep=4) == []
    assert retention.version_of_object("weights.v12") == 12
    assert retention.version_of_object("body.abc") is None
    assert retention.version_of_file(retention.file_name(7)) == 7


def test_which_versions_are_stored_and_a_snapshots_version_is_not_counted() -> None:
    """Every version with the object store; with "ipc" every 10th, a policy snapshot's and
    the last; a snapshot's version is neither collected nor one of the kept."""
    assert all(load_config("smoke").stores_weights(v) for v in range(1, 12))
    snapshot = 'orchestrator.models.frozen={kind="reference", policy_version=7}'
    cfg = load_config("smoke", ["trainer.weights_via=ipc", "max_steps=35", snapshot])
    assert [v for v in range(1, 40) if cfg.stores_weights(v)] == [7, 10, 20, 30, *range(35, 40)]
    cfg = load_config("smoke", ["trainer.keep_weights=2", snapshot])
    assert retention.collectable_in(cfg, [0, 5, 7, 10, 20, 30], newest=30) == [5, 10]


# -- the object store -------------------------------------------------------------------


async def test_delete_is_idempotent_and_gives_the_disk_back(
    bus: Bus, nats_server: EmbeddedServer
) -> None:
    """Deleting twice is no error; the stream's bytes drop and the file blocks it emptied
    go at once (no tombstone pins them until the server's periodic compaction)."""
    store = bus.objects
    for v in range(17):  # 8 MB file-store blocks: [v0-v3] [v4-v7] [v8-v11] [v12-v15] [v16]
        await store.put(retention.object_name(v), bytes([v]) * 2 * MB)
    await store.put("body.keep", b"b" * 1000)
    disk_before = stream_dir_bytes(nats_server, store.stream)
    assert await store.stored_bytes() > 34 * MB and disk_before > 34 * MB

    assert [await store.delete(retention.object_name(v)) for v in range(1, 16)] == [True] * 15
    assert await store.delete(retention.object_name(3)) is False  # already gone: no error
    assert await store.delete("never.stored") is False

    assert await store.names() == ["body.keep", "weights.v0", "weights.v16"]
    assert not await store.exists("weights.v3") and await store.exists("weights.v16")
    assert await store.stored_bytes() < 4.1 * MB
    info = await bus.js.stream_info(store.stream, subjects_filter=f"$O.{store.bucket}.M.>")
    assert len(info.state.subjects or {}) == 3, "a deleted object left a meta tombstone"
    # The three blocks between v0 and v16 held only deleted objects: gone from disk.
    assert stream_dir_bytes(nats_server, store.stream) < disk_before - 20 * MB
    with pytest.raises(BodyError, match="missing"):
        await store.get("weights.v3", "sha256:whatever")
    assert await store.get("weights.v16", await store.put("weights.v16", b"x")) == b"x"


async def test_rewriting_the_initial_weights_frees_the_disk_behind_them(
    nats_server: EmbeddedServer, bus: Bus
) -> None:
    """The trainer's pattern (store v, delete v - 4) with the initial weights at the head
    of the stream: the file store keeps the emptied blocks until its periodic compaction,
    unless the initial weights are rewritten now and then (what the trainer does)."""
    on_disk = {}
    for rewrite_every in (0, 8):
        store = BodyStore(bus.js, f"{bus.objects.bucket}_{rewrite_every}")
        initial = await store.put("weights.v0", b"0" * 2 * MB)
        for v in range(1, 41):
            await store.put(retention.object_name(v), bytes([v]) * 2 * MB)
            if v > 4:
                await store.delete(retention.object_name(v - 4))
                if rewrite_every and v % rewrite_every == 0:
                    assert await store.rewrite("weights.v0") == 2 * MB
        assert await store.stored_bytes() < 11 * MB  # v0 and the newest four, either way
        assert await store.get("weights.v0", initial) == b"0" * 2 * MB
        on_disk[rewrite_every] = stream_dir_bytes(nats_server, store.stream)
        await bus.js.delete_object_store(store.bucket)
    assert on_disk[0] > 60 * MB, "the file store now frees blocks behind a live head"
    assert on_disk[8] < 30 * MB


class _DeletedUnderTheRead(BodyStore):
    """A store whose object is deleted right after a read looked it up (the race between
    an inference replica loading a version and the trainer collecting it)."""

    async def _info(self, name: str) -> ObjectInfo:
        info = await super()._info(name)
        if not getattr(self, "_deleted", False):
            self._deleted = True
            await self.delete(name)
        return info


async def test_a_read_of_an_object_deleted_under_it_fails_instead_of_hanging(bus: Bus) -> None:
    """nats-py's get waits forever for purged chunks; our read notices and says why."""
    await bus.objects.put("weights.v1", b"w" * MB)
    store = _DeletedUnderTheRead(bus.js, bus.objects.bucket, read_stall_s=0.3)
    async with asyncio.timeout(10):
        with pytest.raises(BodyError, match="deleted while being read"):
            await store.read("weights.v1")


# -- the trainer ------------------------------------------------------------------------


async def test_trainer_keeps_only_the_newest_weights_and_collects_after_a_restart(
    nats_server: EmbeddedServer,
    bus: Bus,
    tiny_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """keep_weights=2: after step 5 only v4, v5 and the initial v0 are stored (v0 moved
    to the stream's tail, same bytes). A restart with keep_weights=1 collects what the
    earlier process left (an object, a weights file), and deleting a version someone
    else already deleted is no error."""
    monkeypatch.setattr(retention, "REWRITE_INITIAL_EVERY", 2)
    batches = [synthetic_batch(bus.run, s) for s in range(1, 7)]
    initial = await bus.objects.put("weights.v0", b"initial weights")  # the orchestrator's
    obs = await bus.objects.store()
    first_copy = (await obs.get_info("weights.v0")).nuid
    cfg = trainer_config(tiny_dir, tmp_path, "trainer.keep_weights=2")
    role, task = await start_role(cfg, nats_server.url, bus.run)
    try:
        await bus.publish_many(batches[:5])
        await wait_for_version(bus, 5)
        await _until_names(bus, ["weights.v0", "weights.v4", "weights.v5"])
    finally:
        await stop_role(role, task)
    with pytest.raises(BodyError, match="missing"):
        await bus.objects.get("weights.v1", "sha256:whatever")
    assert (await obs.get_info("weights.v0")).nuid != first_copy  # rewritten after 2 deletes
    assert await bus.objects.get("weights.v0", initial) == b"initial weights"

    # Left behind by an earlier process: an object and a file of weights over 200 MB.
    await bus.objects.put("weights.v2", b"stale")
    stale_file = RunPaths.at(tmp_path / bus.run).weights / retention.file_name(3)
    stale_file.parent.mkdir(parents=True, exist_ok=True)
    stale_file.write_bytes(b"stale")
    cfg = trainer_config(tiny_dir, tmp_path, "trainer.keep_weights=1")
    role, task = await start_role(cfg, nats_server.url, bus.run)
    try:
        assert await bus.objects.names("weights.") == ["weights.v0", "weights.v5"]
        assert not stale_file.exists()
        await bus.objects.delete("weights.v5")  # e.g. a delete that timed out but happened
        await bus.publish(batches[5])
        await wait_for_version(bus, 6)
        await _until_names(bus, ["weights.v0", "weights.v6"])
    finally:
        await stop_role(role, task)  # re-raises if the role failed


async def test_keep_weights_zero_keeps_every_version(
    nats_server: EmbeddedServer, bus: Bus, tiny_dir: Path, tmp_path: Path
) -> None:
    cfg = trainer_config(tiny_dir, tmp_path, "trainer.keep_weights=0")
    role, task = await start_role(cfg, nats_server.url, bus.run)
    try:
        await bus.publish_many([synthetic_batch(bus.run, s) for s in range(1, 4)])
        await wait_for_version(bus, 3)
    finally:
        await stop_role(role, task)
    assert await bus.objects.names("weights.") == ["weights.v1", "weights.v2", "weights.v3"]


async def _until_names(bus: Bus, expected: list[str], timeout_s: float = 20.0) -> None:
    """Until the stored weights are ``expected`` (collection runs right after the publish)."""
    async with asyncio.timeout(timeout_s):
        while (names := await bus.objects.names("weights.")) != expected:
            await asyncio.sleep(0.05)
    assert names == expected


# -- inference --------------------------------------------------------------------------


async def test_inference_skips_a_collected_version_to_the_newest(
    nats_server: EmbeddedServer, bus: Bus, tiny_dir: Path, tmp_path: Path
) -> None:
    """A version collected before a replica loaded it is superseded: the newest is loaded,
    nothing is rejected. Weights missing with nothing newer are rejected, promptly."""
    cfg: RunConfig = trainer_config(tiny_dir, tmp_path, "inference.device=cpu")
    weights = state_dict_to_bytes(load_model(tiny_dir))
    rbus = await Bus.connect(nats_server.url, run=bus.run, producer="inf", settings=BusSettings())
    role = InferenceRole(rbus, "inf-gc", cfg, run_dir=tmp_path / bus.run)
    await role.setup()  # no follower: the test hands it announcements itself
    try:
        assert role.backend is not None and role.backend.policy_version == 0
        v1, v2 = [await _announce(bus, v, weights) for v in (1, 2)]
        await bus.objects.delete("weights.v1")  # collected before the replica got to it
        with capture_logs() as logs:
            async with asyncio.timeout(30):
                assert await role._apply_weights(v1) is True
        assert role.backend.policy_version == 2 and role.weights_rejected == 0
        assert [e["newest"] for e in logs if e["event"] == "weights.superseded"] == [2]

        gone = ObjectRef(kind="path", location=str(tmp_path / "v3.safetensors"), digest=v2.weights.digest)  # fmt: skip
        v3 = WeightsPublished(run=bus.run, version=3, step=3, weights=gone)
        await bus.publish(batch_for(bus.run, 3))
        await bus.publish(v3)
        async with asyncio.timeout(30):
            assert await role._apply_weights(v3) is False
        assert role.backend.policy_version == 2 and role.weights_rejected == 1
        assert "No such file" in (role.last_weights_error or "")
    finally:
        await role.teardown()
        await rbus.close()


async def _announce(bus: Bus, version: int, data: bytes) -> WeightsPublished:
    name = retention.object_name(version)
    digest = await bus.objects.put(name, data)
    ref = ObjectRef(kind="object", location=name, bucket=bus.objects.bucket, size=len(data), digest=digest)  # fmt: skip
    event = WeightsPublished(run=bus.run, version=version, step=version, weights=ref)
    await bus.publish(batch_for(bus.run, version))  # as a trainer step follows its batch
    await bus.publish(event)
    return event


# -- weights as files (trainer.weights_via) ----------------------------------------------


@pytest.mark.parametrize("via", ["shm", "path"])
async def test_weights_via_a_file_is_announced_by_kind_and_collected(
    nats_server: EmbeddedServer,
    bus: Bus,
    tiny_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    via: str,
) -> None:
    """``shm`` and ``path`` weights skip the object store: each announcement names its
    kind and a file holding exactly the announced bytes, in ``/dev/shm/rlbus/<run>`` or
    ``trainer.weights_dir/<run>``, and old files are deleted like old objects."""
    import configs.paths

    monkeypatch.setattr(configs.paths, "SHM_WEIGHTS_ROOT", tmp_path / "shm")  # hermetic
    folder = (tmp_path / "shm" if via == "shm" else tmp_path / "shared") / bus.run
    cfg = trainer_config(
        tiny_dir, tmp_path, f"trainer.weights_via={via}", "trainer.keep_weights=1",
        f"trainer.weights_dir={tmp_path / 'shared'}",
    )  # fmt: skip
    role, task = await start_role(cfg, nats_server.url, bus.run)
    try:
        await bus.publish_many([synthetic_batch(bus.run, s) for s in range(1, 4)])
        await wait_for_version(bus, 3)
        async with asyncio.timeout(20):  # collection runs right after the announcement
            while sorted(p.name for p in folder.iterdir()) != [retention.file_name(3)]:
                await asyncio.sleep(0.05)
    finally:
        await stop_role(role, task)
    announced = [e async for e in read_log(bus, [(Topic.WEIGHTS_PUBLISHED, None)], (WeightsPublished,))]  # fmt: skip
    assert [(w.version, w.weights.kind) for w in announced] == [(1, via), (2, via), (3, via)]
    newest = announced[-1].weights
    assert Path(newest.location) == (folder / retention.file_name(3)).resolve()
    data = await asyncio.to_thread(Path(newest.location).read_bytes)
    assert digest(data) == newest.digest
    assert await bus.objects.names("weights.") == []  # nothing went to the object store
