"""Portable runs: export a run from one server, import it into another, verify everything."""

from __future__ import annotations

import io
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
from replay.portable import PortableError, export_run, import_run, read_archive
from schemas import EVENT_TYPES, BatchAssembled, Event, RunStarted, WeightsPublished
from tests.samples import every_event, sample

pytestmark = pytest.mark.nats

WEIGHTS = bytes(range(256)) * 64  # stands in for weights.v3


async def all_events(bus: Bus, with_seq: bool = False) -> list:
    return [e async for e in read_log(bus, [(t, None) for t in Topic], EVENT_TYPES, with_seq=with_seq)]  # fmt: skip


def recorded_run(run: str) -> list[Event]:
    """Every event type, plus a batch big enough to be offloaded to the object store."""
    big = BatchAssembled(
        run=run, event_id="e-big", step=4, policy_version=3, ts_ns=1,
        samples=[sample(f"big{i}", n=20_000) for i in range(10)],
    )  # fmt: skip
    return [*every_event(run), big]


@pytest.fixture
async def exported(bus: Bus, tmp_path: Path) -> AsyncIterator[tuple[Path, list[Event]]]:
    await bus.objects.put("weights.v3", WEIGHTS)
    await bus.publish_many(recorded_run(bus.run))
    events = await all_events(bus)  # as stored (the bus stamps its producer on unsigned events)
    run_dir = tmp_path / "src" / bus.run
    model = run_dir / "model" / "initial"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"tiny": true}')
    (model / "model.safetensors").write_bytes(b"not really weights")
    (run_dir / "config.toml").write_text(f'run = "{bus.run}"\nseed = 1\n')
    archive = tmp_path / "run.tar"
    manifest = await export_run(bus, archive, run_dir, model)
    assert manifest["stream"]["messages"] == len(events)
    assert set(manifest["objects"]) == {"weights.v3", "body.e-big"}
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
    try:
        summary = await import_run(archive, bus, dest, manifest, members)
        assert summary["messages"] == len(events) and summary["objects"] == 2
        assert sorted(summary["seq_map"]) == list(range(1, len(events) + 1))
        back = await all_events(bus)
        assert back == events  # decoded equal, in order (sequences are not part of events)
        assert await bus.objects.get("weights.v3", sha256_digest(WEIGHTS)) == WEIGHTS
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
    if isinstance(old, WeightsPublished):
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
