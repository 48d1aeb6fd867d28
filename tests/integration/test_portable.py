"""Portable runs: export a run from one server, import it into another, verify everything."""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest

from bus import codec
from bus.offload import sha256_digest
from bus.reader import read_log
from bus.runtime import Bus
from bus.server import EmbeddedServer
from bus.subjects import Topic
from configs import load_config
from configs.paths import RunPaths
from replay.portable import PortableError, export_run, import_run, locate_model_dir, read_archive
from replay.trainer import read_trainer_log, replay_run
from roles.lib.model import materialize_model
from roles.trainer.core import TrainerCore
from schemas import (
    EVENT_TYPES,
    BatchAssembled,
    Event,
    MetricsReported,
    ObjectRef,
    RunStarted,
    WeightsPublished,
    WeightsStored,
)
from tests.samples import every_event, sample
from tests.unit.test_trainer_core import synthetic_batch

pytestmark = pytest.mark.nats

WEIGHTS = bytes(range(256)) * 64  # stands in for weights.v3


async def all_events(bus: Bus, with_seq: bool = False) -> list:
    return [e async for e in read_log(bus, [(t, None) for t in Topic], EVENT_TYPES, with_seq=with_seq)]  # fmt: skip


def recorded_run(run: str) -> list[Event]:
    """Every event type, two older weights versions (collected or not, replay needs neither),
    plus a batch big enough to be offloaded to the object store."""
    big = BatchAssembled(
        run=run, event_id="e-big", step=4, policy_version=3, ts_ns=1,
        samples=[sample(f"big{i}", n=20_000) for i in range(10)],
    )  # fmt: skip
    return [*older_weights(run), *every_event(run), big]


def older_weights(run: str) -> list[WeightsPublished]:
    refs = [ObjectRef(kind="object", location=f"weights.v{v}", bucket=f"RLOBJ_{run}", size=1, digest="sha256:" + "0" * 64) for v in (1, 2)]  # fmt: skip
    return [WeightsPublished(run=run, event_id=f"e-w{i}", version=i, step=i, weights=r, ts_ns=1) for i, r in enumerate(refs, 1)]  # fmt: skip


@pytest.fixture
async def exported(bus: Bus, tmp_path: Path) -> AsyncIterator[tuple[Path, list[Event]]]:
    for name in ("weights.v1", "weights.v2", "weights.v3"):
        await bus.objects.put(name, WEIGHTS)
    await bus.publish_many(recorded_run(bus.run))
    events = await all_events(bus)  # as stored (the bus stamps its producer on unsigned events)
    run_dir = tmp_path / "src" / bus.run
    model = run_dir / "model" / "initial"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"tiny": true}')
    (model / "model.safetensors").write_bytes(b"not really weights")
    (run_dir / "config.toml").write_text(f'run = "{bus.run}"\nseed = 1\n')
    archive = tmp_path / "run.tar"
    seen: list[tuple[int, int | None]] = []
    manifest = await export_run(bus, archive, run_dir, model, on_progress=lambda *p: seen.append(p))
    assert manifest["stream"]["messages"] == len(events)
    # progress: the total (events + 2 objects) before the first write, all of it at the end
    assert seen[0] == (0, len(events) + 2) and seen[-1] == (len(events) + 2,) * 2
    assert not archive.with_name("run.tar.part").exists()
    # The initial and newest weights (both weights.v3 here) and the offloaded body; the
    # older published versions are left out: replay recomputes them.
    assert {n.rsplit(".", 1)[0] for n in manifest["objects"]} == {"weights", "body.e-big"}
    assert "weights.v3" in manifest["objects"]
    assert manifest["left_out"] == ["weights.v1", "weights.v2"]
    assert manifest["format"] == "rlbus-run/2" and manifest["log"] == ["log/000000.msgpack.gz"]
    yield archive, events
    await bus.js.delete_object_store(bus.objects.bucket)


@pytest.fixture
def second_server(tmp_path: Path) -> Iterator[EmbeddedServer]:
    server = EmbeddedServer(tmp_path / "machine2" / "nats").start()
    yield server
    server.stop()


async def test_export_import_round_trip(
    exported: tuple[Path, list[Event]], second_server: EmbeddedServer, tmp_path: Path
) -> None:
    """Every event decodes equal on the other server, the offloaded body and objects
    round-trip by digest, and the config and model directory are restored."""
    archive, events = exported
    run = events[0].run
    manifest, members = read_archive(archive)
    dest = tmp_path / "machine2" / run
    bus = await Bus.connect(second_server.url, run=run, producer="")
    seen: list[tuple[int, int | None]] = []
    try:
        summary = await import_run(archive, bus, dest, manifest, members, lambda *p: seen.append(p))
        assert summary["messages"] == len(events) and summary["objects"] == 2
        assert seen[0] == (1, len(events) + 2) and seen[-1] == (len(events) + 2,) * 2
        assert sorted(summary["seq_map"]) == list(range(1, len(events) + 1))
        back = await all_events(bus)
        assert back == events  # decoded equal, in order (sequences are not part of events)
        assert await bus.objects.get("weights.v3", sha256_digest(WEIGHTS)) == WEIGHTS
        assert not await bus.objects.exists("weights.v1")
        raw = await bus.js.get_msg(bus.stream, summary["seq_map"][len(events)])
        assert (raw.headers or {}).get(codec.H_BODY) == "ref", "the big batch stays offloaded"
    finally:
        await bus.js.delete_stream(bus.stream)
        await bus.close()
    assert (dest / "config.toml").read_text().startswith(f'run = "{run}"')
    assert (dest / "model" / "initial" / "model.safetensors").read_bytes() == b"not really weights"


async def test_import_under_a_new_run_id(
    exported: tuple[Path, list[Event]], second_server: EmbeddedServer, tmp_path: Path
) -> None:
    """``--run NEW`` re-keys subjects, run fields and object references, nothing else."""
    archive, events = exported
    manifest, members = read_archive(archive)
    bus = await Bus.connect(second_server.url, run="renamed", producer="")
    try:
        await import_run(archive, bus, tmp_path / "renamed", manifest, members)
        back = await all_events(bus)
    finally:
        await bus.js.delete_stream(bus.stream)
        await bus.close()
    assert len(back) == len(events) and {e.run for e in back} == {"renamed"}
    for old, new in zip(events, back, strict=True):
        assert msgspec.structs.replace(new, run=old.run, **_refs(old)) == old
    started = next(e for e in back if isinstance(e, RunStarted))
    assert started.initial_weights is not None and started.initial_weights.bucket == "RLOBJ_renamed"
    assert (tmp_path / "renamed" / "config.toml").read_text().startswith('run = "renamed"')


def _refs(old: Event) -> dict:
    """The fields a rename rewrites besides ``run``, as they were."""
    if isinstance(old, RunStarted):
        return {"config": old.config, "initial_weights": old.initial_weights}
    if isinstance(old, WeightsPublished | WeightsStored):
        return {"weights": old.weights}
    return {}


async def test_tampered_member_is_detected(
    exported: tuple[Path, list[Event]], tmp_path: Path
) -> None:
    """A member changed after export fails the import with its name, before anything is written."""
    archive, _ = exported
    tampered = tmp_path / "tampered.tar"
    with tarfile.open(archive) as src, tarfile.open(tampered, "w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read()  # type: ignore[union-attr]
            if m.name == "objects/000000":
                data = data[:-1] + bytes([data[-1] ^ 1])
            dst.addfile(m, io.BytesIO(data))
    with pytest.raises(PortableError, match=r"objects/000000.*does not match the manifest"):
        read_archive(tampered)
    truncated = tmp_path / "truncated.tar"
    with tarfile.open(archive) as src, tarfile.open(truncated, "w") as dst:
        for m in src.getmembers():
            if not m.name.startswith("log/"):
                dst.addfile(m, src.extractfile(m))
    with pytest.raises(PortableError, match=r"log/000000.msgpack.*missing"):
        read_archive(truncated)


async def test_all_weights_and_format_1_archives_still_import(
    bus: Bus, exported: tuple[Path, list[Event]], second_server: EmbeddedServer, tmp_path: Path
) -> None:
    """``all_weights`` exports every version; an archive of format 1 (uncompressed log
    members, written before compaction) imports as before; an unknown format fails clearly."""
    archive, events = exported
    everything = tmp_path / "all.tar"
    manifest = await export_run(bus, everything, tmp_path / "src" / bus.run, None, all_weights=True)
    bodies = {n for n in manifest["objects"] if n.startswith("body.")}
    assert [b.rsplit(".", 1)[0] for b in bodies] == ["body.e-big"]
    assert set(manifest["objects"]) - bodies == {"weights.v1", "weights.v2", "weights.v3"}
    assert manifest["left_out"] == [] and everything.stat().st_size > archive.stat().st_size

    old = tmp_path / "format1.tar"
    rewrite_archive(everything, old, format_1)
    manifest, members = read_archive(old)
    assert manifest["format"] == "rlbus-run/1" and manifest["log"] == ["log/000000.msgpack"]
    other = await Bus.connect(second_server.url, run=bus.run, producer="")
    try:
        summary = await import_run(old, other, tmp_path / "machine2" / bus.run, manifest, members)
        assert summary["objects"] == 4 and await all_events(other) == events
    finally:
        await other.js.delete_stream(other.stream)
        await other.js.delete_object_store(other.objects.bucket)
        await other.close()

    future = tmp_path / "future.tar"
    rewrite_archive(archive, future, lambda m, ms: ({**m, "format": "rlbus-run/9"}, ms))
    with pytest.raises(PortableError, match=r"format 'rlbus-run/9', this rlbus reads rlbus-run/1"):
        read_archive(future)


def format_1(manifest: dict, members: dict[str, bytes]) -> tuple[dict, dict[str, bytes]]:
    """An archive as ``rlbus export`` wrote it before format 2 (plain log members)."""
    plain = {n.removesuffix(".gz"): gzip.decompress(d) for n, d in members.items() if n.endswith(".gz")}  # fmt: skip
    rest = {n: d for n, d in members.items() if not n.endswith(".gz")}
    manifest = {k: v for k, v in manifest.items() if k != "left_out"}
    return {**manifest, "format": "rlbus-run/1", "log": sorted(plain)}, {**rest, **plain}


def rewrite_archive(src: Path, out: Path, change) -> None:  # noqa: ANN001
    """``src`` with its manifest and members changed by ``change``, re-signed."""
    manifest, members = change(*read_archive(src))
    manifest["members"] = {n: {"size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in members.items()}  # fmt: skip
    with tarfile.open(out, "w") as tar:
        for name, data in [*members.items(), ("manifest.json", json.dumps(manifest).encode())]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


async def test_an_imported_compact_archive_replays_bit_for_bit(
    bus: Bus, second_server: EmbeddedServer, tmp_path: Path
) -> None:
    """A trained run exported without its model dir and without the published weights it
    no longer needs: on the other machine replay restores the initial weights from the
    archive's weights.v0 and reproduces every recorded step."""
    cfg = load_config("smoke", ["trainer.device=cpu"])  # model.path = "tiny"
    src = tmp_path / "src" / bus.run
    model_dir = await asyncio.to_thread(materialize_model, cfg, "tiny", src)
    (initial,) = model_dir.glob("*.safetensors")
    events: list[Event] = [RunStarted(
        run=bus.run, config=cfg.model_dump(mode="json"), seed=cfg.seed,
        model_path="/not/on/this/machine", initial_weights=await _stored(bus, 0, initial.read_bytes()),
    )]  # fmt: skip
    core = TrainerCore(cfg, model_dir, device="cpu")
    for step in (1, 2, 3):
        batch = synthetic_batch(bus.run, step)
        metrics = await asyncio.to_thread(core.train_step, batch)
        ref = await _stored(bus, step, core.weights_bytes())
        events += [
            batch,
            WeightsPublished(run=bus.run, version=step, step=step, weights=ref, batch_id=batch.event_id),
            MetricsReported(run=bus.run, role="trainer", step=step, values=metrics, policy_version=step),
        ]  # fmt: skip
    await bus.publish_many(events)
    archive = tmp_path / "run.tar"
    manifest = await export_run(bus, archive, src, None)  # like `rlbus export --no-model`
    assert set(manifest["objects"]) == {"weights.v0", "weights.v3"}
    assert manifest["left_out"] == ["weights.v1", "weights.v2"]

    dest = tmp_path / "machine2" / bus.run
    other = await Bus.connect(second_server.url, run=bus.run, producer="")
    try:
        await import_run(archive, other, dest, *read_archive(archive))
        log = await read_trainer_log(other)
        found = await locate_model_dir(other, log.started, log.config(), dest)
    finally:
        await other.js.delete_stream(other.stream)
        await other.js.delete_object_store(other.objects.bucket)
        await other.close()
    assert found == RunPaths.at(dest).initial_model  # restored from the archive's weights.v0
    result = await asyncio.to_thread(replay_run, log, found)
    assert result.ok and [s.step for s in result.steps] == [1, 2, 3], result.divergence


async def _stored(bus: Bus, version: int, data: bytes) -> ObjectRef:
    name = f"weights.v{version}"
    digest = await bus.objects.put(name, data)
    return ObjectRef(kind="object", location=name, bucket=bus.objects.bucket, size=len(data), digest=digest)  # fmt: skip
