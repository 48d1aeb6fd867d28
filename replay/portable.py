"""Portable runs: a whole run in one file, loadable on another machine.

    rlbus export <run> run.tar                 # or run.tar.gz
    rlbus import run.tar [--data-dir D] [--run NEW]

The archive is a tar with a ``manifest.json`` (format, run, counts, and the sha256 of
every other member), the run's stream as gzip-compressed msgpack chunks
(``log/NNNNNN.msgpack.gz``: every stored message with its subject, headers, data and
original sequence and storage time; the log compresses about 10x), the objects of the
run's object store that replay and import need (``objects/NNNNNN``: offloaded bodies,
the initial weights, and the newest published weights, which an imported run's
inference loads; older published weights are left out and listed as ``left_out``:
replay recomputes them), ``config.toml`` and the initial model directory (``model/``,
tokenizer and config included). Format ``rlbus-run/1`` archives (uncompressed log
chunks, every object) still import. Import verifies every member against the manifest *before* writing anything
(a tampered or truncated archive is a ``PortableError`` naming the member), recreates the
objects (checking their digests), republishes every message in order with its headers
(new sequences: ``seq_map`` maps old to new), and restores config and model under
``<data_dir>/<run>/``. With ``--run NEW`` every event is decoded and re-encoded with the
new run id (subjects, ``run`` fields, object-store references).

Export streams: each log chunk and object goes into ``<out>.part`` as it is read (memory
holds one at a time), renamed to ``<out>`` once the manifest is written. Both directions
take ``on_progress(done, total)``, in messages and objects, for ``rlbus export|import``.

``locate_model_dir`` finds a run's initial weights on this machine for trainer replay.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import json
import os
import re
import tarfile
import time
from pathlib import Path
from typing import Any

import msgspec

from bus import codec
from bus.errors import STORE_ERRORS, BusError, DecodeError
from bus.offload import BodyStore, sha256_digest
from bus.reader import LogReader, Progress, StoredMsg, read_log
from bus.runtime import Bus
from bus.subjects import (
    Topic,
    declared_schema,
    kind_of_bucket,
    moved_subject,
    objects_bucket,
    stream_subjects,
    topic_of_subject,
)
from configs.paths import RunPaths
from schemas import EVENT_TYPES, Event, ObjectRef, RunStarted, WeightsPublished, WeightsStored

FORMAT = "rlbus-run/2"  # /2: gzip-compressed log members, only the weights replay needs
READABLE = ("rlbus-run/1", FORMAT)  # formats import reads
LOG_CHUNK = 5000  # messages per log member
LOG_GZIP_LEVEL = 6  # 9 compresses the log 4% more in 14x the time
MANIFEST = "manifest.json"


class PortableError(Exception):
    """An archive that is not a run, does not match its manifest, or cannot be loaded."""


class LogRecord(msgspec.Struct, frozen=True):
    seq: int
    subject: str
    headers: dict[str, str]
    data: bytes
    stored_ns: int


_records = msgspec.msgpack.Decoder(list[LogRecord])


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- export -----------------------------------------------------------------------------


def log_record(msg: StoredMsg) -> LogRecord:
    """One stored message as the archive keeps it."""
    meta = msg.metadata
    stamp = meta.timestamp.timestamp() if meta.timestamp else 0.0
    return LogRecord(meta.sequence.stream, msg.subject, dict(msg.headers or {}),
                     bytes(msg.data), int(stamp * 1e9))  # fmt: skip


async def object_names(
    bus: Bus, leave_out: frozenset[str] = frozenset()
) -> list[tuple[BodyStore, str]]:
    """(store, name) of the (not deleted) objects of the run's object stores but
    ``leave_out``, sorted by store, then name."""
    out = []
    for store in await bus.object_stores():  # only those that exist: never creates one
        out += [(store, name) for name in await store.names() if name not in leave_out]
    return out


async def read_object(store: BodyStore, name: str) -> bytes | None:
    """An object's bytes; None if it was deleted since listed (a live run's trainer
    collects old weights)."""
    try:
        return await store.read(name)
    except BusError:
        if await store.exists(name):
            raise
        return None


async def unneeded_weights(bus: Bus) -> frozenset[str]:
    """Published weights objects that neither replay nor an imported run needs.

    Replay recomputes every version from the initial weights (``run.started``, kept) and
    the batches; an imported run's inference loads the newest stored version (kept).
    Every other object of ``weights.published`` or ``weights.stored`` is left out.
    """
    keep: set[str] = set()
    published: dict[int, str] = {}
    topics = [(Topic.RUN_STARTED, None), (Topic.WEIGHTS_PUBLISHED, None),
              (Topic.WEIGHTS_STORED, None)]  # fmt: skip
    async for event in read_log(bus, topics, (RunStarted, WeightsPublished, WeightsStored)):
        if isinstance(event, RunStarted):
            if (ref := event.initial_weights) is not None and ref.kind == "object":
                keep.add(ref.location)
        elif event.weights.kind == "object":
            published.setdefault(event.version, event.weights.location)
    if published:
        keep.add(published[max(published)])
    return frozenset(set(published.values()) - keep)


async def export_run(
    bus: Bus, out: Path, run_dir: Path, model_dir: Path | None, all_weights: bool = False,
    on_progress: Progress | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Write ``bus.run`` (stream, objects, config, model) to ``out``; returns the manifest.

    Only the weights replay and import need go in (``unneeded_weights``), unless
    ``all_weights``: a default run publishes 500 versions, ~80% of an archive with all.
    The log is written chunk by chunk as it is read, each object as it is read (memory
    holds one chunk or one object); ``on_progress(done, total)`` counts the messages
    and objects written (compressing the log is most of the time).
    """
    left_out = frozenset() if all_weights else await unneeded_weights(bus)
    names = await object_names(bus, left_out)
    done = messages = 0

    def report() -> None:
        if on_progress is not None:
            on_progress(done, messages + len(names))

    def counted(read: int, total: int | None) -> None:
        nonlocal messages
        messages = total or 0
        if read == 0:  # the total, before the first chunk takes its time
            report()

    archive = ArchiveWriter(out, bus.run)
    try:
        chunk: list[LogRecord] = []
        async for msg in LogReader(bus, idle_timeout_s=10.0, on_progress=counted).messages():
            chunk.append(log_record(msg))
            if len(chunk) == LOG_CHUNK:
                await asyncio.to_thread(archive.add_log, chunk)
                done, chunk = done + len(chunk), []
                report()
        if chunk:
            await asyncio.to_thread(archive.add_log, chunk)
            done += len(chunk)
            report()
        for store, name in names:
            if (data := await read_object(store, name)) is not None:
                await asyncio.to_thread(archive.add_object, store.bucket, name, data)
            done += 1
            report()
        return await asyncio.to_thread(archive.close, run_dir, model_dir, sorted(left_out))
    except BaseException:
        archive.abort()
        raise


class ArchiveWriter:
    """An archive written member by member, the manifest last (``export_run``).

    It writes ``<out>.part`` and renames it to ``out`` once complete: an export that fails
    or is interrupted leaves no file that looks like an archive. A plain tar (its log
    members are compressed already), gzip for ``.gz``/``.tgz``.
    """

    def __init__(self, out: Path, run: str) -> None:
        self.out, self.run = out, run
        self.part = out.with_name(out.name + ".part")
        self.manifest: dict[str, Any] = {
            "format": FORMAT, "run": run, "exported_ns": time.time_ns(), "members": {},
            "stream": {"subjects": stream_subjects(run), "messages": 0, "first_seq": 0,
                       "last_seq": 0},
            "counts": {}, "objects": {}, "log": [], "model": [], "config": None,
            "left_out": [],  # weights objects not exported (replay recomputes them)
        }  # fmt: skip
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.name.endswith((".gz", ".tgz")):
            self.tar = tarfile.open(self.part, "w:gz", compresslevel=LOG_GZIP_LEVEL)
        else:
            self.tar = tarfile.open(self.part, "w")

    def add_log(self, records: list[LogRecord]) -> None:
        """The next log member: up to ``LOG_CHUNK`` messages, in stream order."""
        m, stream = self.manifest, self.manifest["stream"]
        name = f"log/{len(m['log']):06d}.msgpack.gz"
        self._add(name, gzip.compress(msgspec.msgpack.encode(records), LOG_GZIP_LEVEL, mtime=0))
        m["log"].append(name)
        stream["first_seq"] = stream["first_seq"] or records[0].seq
        stream["last_seq"] = records[-1].seq
        stream["messages"] += len(records)
        for r in records:
            topic = topic_of_subject(self.run, r.subject).value
            m["counts"][topic] = m["counts"].get(topic, 0) + 1

    def add_object(self, bucket: str, name: str, data: bytes) -> None:
        member = f"objects/{len(self.manifest['objects']):06d}"  # object names are not paths
        self._add(member, data)
        self.manifest["objects"][name] = {
            "member": member, "digest": sha256_digest(data), "bucket": bucket,
        }  # fmt: skip

    def close(self, run_dir: Path, model_dir: Path | None, left_out: list[str]) -> dict[str, Any]:
        """Config, model and manifest, then the rename; returns the manifest."""
        m = self.manifest
        m["left_out"] = left_out
        if (config := RunPaths.at(run_dir).config).is_file():
            self._add("config.toml", config.read_bytes())
            m["config"] = "config.toml"
        if model_dir is not None and model_dir.is_dir():
            for f in sorted(p for p in model_dir.iterdir() if p.is_file()):
                self._add(f"model/{f.name}", f.read_bytes())
                m["model"].append(f"model/{f.name}")
        self._add(MANIFEST, json.dumps(m, indent=1, sort_keys=True).encode())
        self.tar.close()
        os.replace(self.part, self.out)
        return m

    def abort(self) -> None:
        """Close and delete the unfinished archive."""
        try:
            self.tar.close()
        finally:
            self.part.unlink(missing_ok=True)

    def _add(self, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
        self.tar.addfile(info, io.BytesIO(data))
        if name != MANIFEST:  # the manifest is the root of trust, not a member of itself
            self.manifest["members"][name] = {"size": len(data), "sha256": _sha(data)}


# -- import -----------------------------------------------------------------------------


def read_archive(path: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """(manifest, members) of an archive, every member checked against the manifest."""
    try:
        with tarfile.open(path, "r:*") as tar:
            members = {
                m.name: tar.extractfile(m).read()  # type: ignore[union-attr]
                for m in tar.getmembers()
                if m.isfile()
            }
    except (tarfile.TarError, OSError, EOFError) as e:
        raise PortableError(f"{path}: not a readable run archive: {e}") from e
    if MANIFEST not in members:
        raise PortableError(f"{path}: no {MANIFEST}: not an rlbus run archive")
    manifest = json.loads(members.pop(MANIFEST))
    if manifest.get("format") not in READABLE:
        raise PortableError(
            f"{path}: format {manifest.get('format')!r}, this rlbus reads {', '.join(READABLE)} "
            "(an archive from a newer rlbus?)"
        )
    expected = manifest["members"]
    for name in sorted(set(members) - set(expected)):
        raise PortableError(f"{path}: member {name!r} is not in the manifest (tampered archive?)")
    for name, want in expected.items():
        if name not in members:
            raise PortableError(f"{path}: member {name!r} is missing (truncated archive?)")
        got = _sha(members[name])
        if got != want["sha256"] or len(members[name]) != want["size"]:
            raise PortableError(
                f"{path}: member {name!r} does not match the manifest: sha256 {got}, "
                f"expected {want['sha256']} (corrupted or tampered archive)"
            )
    return manifest, members


def moved_bucket(bucket: str, old_run: str, new_run: str) -> str:
    """The object store of run ``new_run`` that holds what ``bucket`` of ``old_run``
    held: the same kind's (``bus.subjects.objects_bucket``)."""
    try:
        return objects_bucket(new_run, kind_of_bucket(old_run, bucket))
    except ValueError as e:
        raise PortableError(str(e)) from e


def renamed(event: Event, new_run: str) -> Event:
    """``event`` as if recorded in run ``new_run`` (object references follow the run, each
    to the same kind's object store)."""
    changes: dict[str, Any] = {"run": new_run}

    def bucket(ref: ObjectRef) -> str:
        return moved_bucket(ref.bucket or objects_bucket(event.run), event.run, new_run)

    if isinstance(event, RunStarted):
        changes["config"] = {**event.config, "run": new_run}
        ref = event.initial_weights
        if ref is not None and ref.kind == "object":
            changes["initial_weights"] = msgspec.structs.replace(ref, bucket=bucket(ref))
    elif isinstance(event, WeightsPublished | WeightsStored) and event.weights.kind == "object":
        changes["weights"] = msgspec.structs.replace(event.weights, bucket=bucket(event.weights))
    return msgspec.structs.replace(event, **changes)


async def import_run(
    path: Path, bus: Bus, run_dir: Path, manifest: dict[str, Any], members: dict[str, bytes],
    on_progress: Progress | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Load a verified archive (``read_archive``) into run ``bus.run``; a summary back.

    ``on_progress(done, total)`` counts the objects stored and messages published."""
    old = manifest["run"]
    state = await bus.stream_state()
    if state is not None and state.messages:
        raise PortableError(f"run {bus.run!r} already exists with {state.messages} messages")
    await bus.ensure_stream()
    records = [r for name in manifest["log"] for r in log_records(name, members[name])]
    total = len(manifest["objects"]) + len(records)
    bodies: dict[str, bytes] = {}
    for name, obj in manifest["objects"].items():
        data = members[obj["member"]]
        # (an archive written before the stores per kind names none: the shared one)
        target = moved_bucket(obj.get("bucket", objects_bucket(old)), old, bus.run)
        digest = await bus.bodies(target).put(name, data)
        if digest != obj["digest"]:
            raise PortableError(f"object {name}: stored {digest}, expected {obj['digest']}")
        bodies[name] = data
        if on_progress is not None:
            on_progress(len(bodies), total)
    prepared = [await _prepared(r, bus, old, bodies) for r in records]
    acks = []
    for i in range(0, len(prepared), 1000):
        acks += await bus.publish_raw(prepared[i : i + 1000])
        if on_progress is not None:
            on_progress(len(bodies) + len(acks), total)
    seq_map = {r.seq: a.seq for r, a in zip(records, acks, strict=True)}
    await asyncio.to_thread(restore_files, run_dir, bus.run, manifest, members)
    return {
        "run": bus.run, "from_run": old, "messages": len(records), "objects": len(bodies),
        "duplicates": sum(1 for a in acks if a.duplicate), "model_files": len(manifest["model"]),
        "seq_map": seq_map,
    }  # fmt: skip


def log_records(name: str, data: bytes) -> list[LogRecord]:
    """The messages of one log member (``.msgpack.gz`` since format 2, ``.msgpack`` before)."""
    if name.endswith(".gz"):
        data = gzip.decompress(data)
    return _records.decode(data)


def restore_files(
    run_dir: Path, run: str, manifest: dict[str, Any], members: dict[str, bytes]
) -> None:
    """``config.toml`` and ``model/initial/`` under the run's directory."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if manifest.get("config"):
        text = members[manifest["config"]].decode()
        if run != manifest["run"]:
            text = re.sub(r'(?m)^run = ".*"$', f'run = "{run}"', text)
        RunPaths.at(run_dir).config.write_text(text)
    model = RunPaths.at(run_dir).initial_model
    for name in manifest["model"]:
        model.mkdir(parents=True, exist_ok=True)
        (model / Path(name).name).write_bytes(members[name])


async def _prepared(
    r: LogRecord, bus: Bus, old: str, bodies: dict[str, bytes]
) -> tuple[str, bytes, dict[str, str]]:
    if bus.run == old:
        return r.subject, r.data, dict(r.headers)
    payload = r.data
    try:
        if r.headers.get(codec.H_BODY) == "ref":
            payload = bodies[codec.decode_ref(payload).name]
        event = codec.decode(payload, EVENT_TYPES, r.headers.get(codec.H_SCHEMA))
    except (DecodeError, KeyError) as e:
        raise PortableError(f"message {r.seq} ({r.subject}) cannot be renamed: {e}") from e
    if declared_schema(r.subject) not in (None, type(event)):
        # An event of another type than its subject declares stays where it was, as it
        # was: every reader refuses it there (bus.subjects.check_schema), as in the
        # original run; renamed, it would move to its own type's subject and be believed.
        return moved_subject(r.subject, old, bus.run), r.data, dict(r.headers)
    return await bus.prepare(renamed(event, bus.run))


# -- the initial model on this machine ------------------------------------------------------


def model_digest(model_dir: Path, ref: ObjectRef) -> str | None:
    """The digest of ``model_dir``'s weights computed as ``run.started`` recorded it."""
    files = sorted(model_dir.glob("*.safetensors"))
    if ref.kind == "object":  # the object is the raw bytes of the single weights file
        return sha256_digest(files[0].read_bytes()) if len(files) == 1 else None
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return "sha256:" + h.hexdigest() if files else None


async def locate_model_dir(bus: Bus, started: RunStarted, cfg: Any, run_dir: Path) -> Path:
    """The run's initial model directory here, its weights matching the recorded digest.

    Tries the recorded ``model_path``, then ``<run_dir>/model/initial`` (where import
    restores it); failing both, restores the weights from the object store
    (``weights.v0``) into ``<run_dir>/model/initial`` (its config and tokenizer rebuilt
    first for the tiny model). Never uses weights whose digest differs.
    """
    ref = started.initial_weights
    target = RunPaths.at(run_dir).initial_model
    found, looked = await asyncio.to_thread(_find_local, [Path(started.model_path), target], ref)
    if found is not None:
        return found
    if ref is not None and ref.kind == "object":
        try:
            data = await bus.bodies(ref.bucket).get(ref.location, ref.digest)
        except STORE_ERRORS as e:
            looked.append(f"object {ref.location} ({e})")
        else:
            if await asyncio.to_thread(_restore_weights, target, cfg, run_dir, data):
                return target
            looked.append(f"{target}: no config or tokenizer to put the weights in")
    want = ref.digest if ref is not None else "?"
    raise PortableError(f"initial weights {want} not found: looked at " + "; ".join(looked))


def _find_local(candidates: list[Path], ref: ObjectRef | None) -> tuple[Path | None, list[str]]:
    looked = []
    for candidate in candidates:
        if not (candidate / "config.json").is_file():
            looked.append(f"{candidate} (missing)")
            continue
        found = None if ref is None else model_digest(candidate, ref)
        if ref is None or found == ref.digest:
            return candidate, looked
        looked.append(f"{candidate} (weights {found})")
    return None, looked


def _restore_weights(target: Path, cfg: Any, run_dir: Path, data: bytes) -> bool:
    if not (target / "config.json").is_file() and cfg.model.path == "tiny":
        from roles.lib.model import materialize_model  # config, tokenizer, weights

        materialize_model(cfg, "tiny", run_dir)
    if not (target / "config.json").is_file():
        return False
    for old in target.glob("*.safetensors"):
        old.unlink()
    (target / "model.safetensors").write_bytes(data)
    return True
