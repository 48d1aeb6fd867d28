"""Weights shared on one device between two processes (``trainer.weights_via = "ipc"``).

The trainer keeps a ring of ``RING_SLOTS`` flat buffers in the serving dtype on its own
device and writes version v into slot ``v % RING_SLOTS`` (a device-side cast and copy of
every tensor); inference maps the ring once and copies a slot out into a staging buffer
of its own (one device-to-device copy), then into its model between two decode steps.
No host round trip, no serialisation: on CUDA the ring is shared through CUDA IPC (the
handle ``torch.multiprocessing`` uses, carried as JSON, never pickled); on the CPU it is
a file under /dev/shm that both processes map (the same code, so CPU tests run it).

Integrity without a host copy: ``device_digest`` hashes the buffer's bytes on the device
with integer arithmetic (exact, so the trainer's and the reader's figures agree on any
device) and only 16 hex digits reach the host. The reader hashes what it copied: a
slot the trainer overwrote meanwhile (a reader more than ``RING_SLOTS - 1`` versions
behind), another layout, or a ring that is gone is refused, never served.

    ring = WeightsRing.create(Layout.of(model.state_dict()), torch.bfloat16, device, folder)
    ref = ring.write(version, model.state_dict())    # ObjectRef(kind="ipc", ...)
    reader = SharedReader(Layout.of(other.state_dict()), device)
    staged = reader.read(ref)                         # verified flat copy, or raises
    reader.load_into(other, staged)                   # one fused copy into the model

The layout is the state dict's order with tied aliases dropped (``weights.tied_keys``):
a name's tensor is a view of the flat buffer at a fixed offset, and ``Layout.fingerprint``
(names and shapes) must match on both sides.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch

from roles.lib.model.weights import WeightsDigestMismatch, tied_keys
from schemas import IPC_KIND, ObjectRef

RING_SLOTS = 3  # a reader may lag two versions behind the trainer before a slot is reused
PAD = 4096  # elements: each slot starts aligned and hashes as whole rows of ROW words
ROW = 1024  # int32 words hashed per row by ``device_digest``
_P = (1 << 31) - 1  # the digest's modulus (a prime)
_CHUNK_ROWS = 4096  # rows widened to int64 at a time (32 MB), bounding the digest's memory


@dataclass(frozen=True)
class Layout:
    """Where each named tensor lives in a flat buffer of ``numel`` elements."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    numel: int  # padded to a multiple of PAD

    @classmethod
    def of(cls, state: Mapping[str, torch.Tensor]) -> Layout:
        """The layout of ``state`` (a model's state dict), its tied aliases dropped."""
        tied = tied_keys(dict(state))
        names, shapes, offsets, at = [], [], [], 0
        for name, t in state.items():
            if name in tied:
                continue
            names.append(name)
            shapes.append(tuple(t.shape))
            offsets.append(at)
            at += t.numel()
        return cls(tuple(names), tuple(shapes), tuple(offsets), -(-max(at, 1) // PAD) * PAD)

    def fingerprint(self) -> str:
        text = ";".join(f"{n}:{list(s)}" for n, s in zip(self.names, self.shapes, strict=True))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Each named tensor as a view of ``flat`` (one slot)."""
        out = {}
        for name, shape, at in zip(self.names, self.shapes, self.offsets, strict=True):
            n = 1
            for d in shape:
                n *= d
            out[name] = flat[at : at + n].view(shape)
        return out


# -- the digest ----------------------------------------------------------------------------

_MULTIPLIERS: dict[tuple[str, int], torch.Tensor] = {}


def _multipliers(device: torch.device, seed: int) -> torch.Tensor:
    """ROW fixed multipliers in [1, 65521] (int64 on ``device``), one set per seed."""
    key = (str(device), seed)
    if key not in _MULTIPLIERS:
        i = torch.arange(ROW, dtype=torch.int64, device=device)
        _MULTIPLIERS[key] = (i * 2654435761 + seed * 40503 + 12345) % 65521 + 1
    return _MULTIPLIERS[key]


def _lane(words: torch.Tensor, seed: int) -> torch.Tensor:
    """One 31-bit lane: each row of ROW words is a weighted sum mod P, then the row
    hashes are hashed the same way, ROW at a time, down to one value (on the device).
    Bounds: a word < 2^32, a multiplier < 2^17, ROW = 2^10 terms: every sum < 2^59."""
    m = _multipliers(words.device, seed)
    rows = words.view(-1, ROW)
    parts = []
    for at in range(0, rows.shape[0], _CHUNK_ROWS):
        x = rows[at : at + _CHUNK_ROWS].to(torch.int64) & 0xFFFFFFFF
        parts.append((x * m).sum(1) % _P)
    h = torch.cat(parts)
    level = 1
    while h.numel() > 1:
        h = torch.nn.functional.pad(h, (0, -h.numel() % ROW)).view(-1, ROW)
        h = (h * _multipliers(words.device, seed + 7 * level)).sum(1) % _P
        level += 1
    return h


def device_digest(flat: torch.Tensor) -> str:
    """A 62-bit content hash of ``flat``'s bytes, computed where it lives:
    "dev:<dtype>:<hex>" (the dtype says what to hash to check it again: ``state_digest``).

    Integer arithmetic only, so equal bytes give equal digests on any device; it tells
    a torn, stale or foreign buffer from the one announced (it is a checksum against
    accidents and bugs, not a signature). ``flat.nbytes`` must be a multiple of 4 * ROW.
    """
    words = flat.reshape(-1).view(torch.int32)
    lanes = torch.stack([_lane(words, 1), _lane(words, 3)]).reshape(-1).tolist()
    return f"dev:{_dtype_name(flat.dtype)}:{lanes[0]:08x}{lanes[1]:08x}"


def state_digest(state: Mapping[str, torch.Tensor], digest_like: str) -> str:
    """The device digest ``state`` would have in a ring of the dtype ``digest_like``
    (a recorded "dev:<dtype>:..." digest) names: replay checks a shared version with it."""
    layout = Layout.of(state)
    flat = torch.zeros(layout.numel, dtype=_dtype(digest_like.split(":")[1]))
    _fill(layout, flat, state)
    return device_digest(flat)


def _fill(layout: Layout, flat: torch.Tensor, state: Mapping[str, torch.Tensor]) -> None:
    """Cast and copy ``state`` into ``flat`` at the layout's places."""
    views = layout.views(flat)
    with torch.no_grad():
        torch._foreach_copy_(
            [views[n] for n in layout.names], [state[n].detach() for n in layout.names]
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- the ring (trainer side) -----------------------------------------------------------------


class Location(msgspec.Struct, frozen=True):
    """What ``ObjectRef.location`` says for ``kind == "ipc"`` (JSON)."""

    handle: str  # "file:<path>" (CPU) or "cuda:<json of the IPC handle>"
    slot: int
    slots: int
    numel: int  # per slot
    dtype: str  # torch dtype name, e.g. "bfloat16"
    layout: str  # Layout.fingerprint()


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"shared weights: unknown dtype {name!r}")
    return dtype


class WeightsRing:
    """The trainer's ring of serving-dtype buffers, shared with readers on its device."""

    def __init__(self, layout: Layout, buffer: torch.Tensor, handle: str, slots: int) -> None:
        self.layout, self.buffer, self.handle, self.slots = layout, buffer, handle, slots
        self.path = Path(handle[len("file:") :]) if handle.startswith("file:") else None

    @classmethod
    def create(
        cls,
        layout: Layout,
        dtype: torch.dtype,
        device: torch.device,
        folder: Path,
        slots: int = RING_SLOTS,
    ) -> WeightsRing:
        """A new ring: device memory exported through CUDA IPC, or (CPU) a file under
        ``folder`` (the run's /dev/shm folder) mapped shared."""
        n = layout.numel * slots
        if device.type == "cuda":
            buffer = torch.zeros(n, dtype=dtype, device=device)
            handle = "cuda:" + _export_cuda(buffer)
            _EXPORTED[handle] = buffer
            return cls(layout, buffer, handle, slots)
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"ring-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
        with open(path, "wb") as f:
            f.truncate(n * torch.empty((), dtype=dtype).element_size())  # zero-filled
        buffer = torch.from_file(str(path), shared=True, size=n, dtype=dtype)
        return cls(layout, buffer, f"file:{path.resolve()}", slots)

    def slot(self, i: int) -> torch.Tensor:
        return self.buffer[i * self.layout.numel : (i + 1) * self.layout.numel]

    def write(self, version: int, state: Mapping[str, torch.Tensor]) -> ObjectRef:
        """Cast and copy ``state`` into version's slot; its reference (digest included)."""
        i = version % self.slots
        flat = self.slot(i)
        _fill(self.layout, flat, state)
        location = Location(
            handle=self.handle,
            slot=i,
            slots=self.slots,
            numel=self.layout.numel,
            dtype=_dtype_name(flat.dtype),
            layout=self.layout.fingerprint(),
        )
        return ObjectRef(
            kind=IPC_KIND,
            location=msgspec.json.encode(location).decode(),
            size=flat.nbytes,
            digest=device_digest(flat),  # (its .tolist() waits for the copies)
        )

    def close(self) -> None:
        """Remove the CPU ring's file (readers that mapped it keep their mapping)."""
        _EXPORTED.pop(self.handle, None)
        if self.path is not None:
            self.path.unlink(missing_ok=True)


# Rings this process exported, by handle: CUDA cannot open an IPC handle in the process
# that made it, so a reader here (one-process tests, benchmarks) uses the tensor itself.
_EXPORTED: dict[str, torch.Tensor] = {}


def _export_cuda(buffer: torch.Tensor) -> str:
    """The CUDA IPC handle of ``buffer``'s storage, as JSON (what torch.multiprocessing
    sends, minus the pickled classes): bytes in hex."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    (_cls, size, stride, offset, _storage_cls, _dtype_, device, handle, size_bytes,
     offset_bytes, _grad, ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    return msgspec.json.encode({
        "size": list(size), "stride": list(stride), "offset": offset, "device": device,
        "handle": handle.hex(), "size_bytes": size_bytes, "offset_bytes": offset_bytes,
        "ref_handle": ref_handle.hex(), "ref_offset": ref_offset,
        "event_handle": event_handle.hex() if event_handle else "", "event_sync": event_sync,
    }).decode()  # fmt: skip


def _import_cuda(text: str, dtype: torch.dtype) -> torch.Tensor:
    """The tensor another process exported with ``_export_cuda``."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    h = msgspec.json.decode(text)
    return rebuild_cuda_tensor(  # type: ignore[no-any-return]
        torch.Tensor, torch.Size(h["size"]), tuple(h["stride"]), h["offset"],
        torch.storage.TypedStorage, dtype, h["device"], bytes.fromhex(h["handle"]),
        h["size_bytes"], h["offset_bytes"], False, bytes.fromhex(h["ref_handle"]),
        h["ref_offset"], bytes.fromhex(h["event_handle"]) or None, h["event_sync"],
    )  # fmt: skip


# -- the reader (inference side) -----------------------------------------------------------


class SharedReader:
    """Copies announced versions out of a trainer's ring into one staging buffer.

    The ring last opened is kept mapped (a restarted trainer announces a new handle,
    which replaces it). ``read`` returns the staging buffer, verified: the caller copies
    it into its model (``load_into``) before the next ``read``.
    """

    def __init__(self, layout: Layout, device: torch.device) -> None:
        self.layout, self.device = layout, device
        self._ring: tuple[str, torch.Tensor] | None = None
        self._staging: torch.Tensor | None = None
        self._pairs: tuple[int, list[torch.Tensor], list[torch.Tensor]] | None = None

    def read(self, ref: ObjectRef) -> torch.Tensor:
        if ref.kind != IPC_KIND:
            raise ValueError(f"not a shared-weights reference: kind {ref.kind!r}")
        loc = msgspec.json.decode(ref.location, type=Location)
        if loc.layout != self.layout.fingerprint() or loc.numel != self.layout.numel:
            raise ValueError(
                f"shared weights of another model: layout {loc.layout}, this model's is "
                f"{self.layout.fingerprint()}"
            )
        if not 0 <= loc.slot < loc.slots:
            raise ValueError(f"shared weights: slot {loc.slot} of {loc.slots}")
        dtype = _dtype(loc.dtype)
        ring = self._open(loc, dtype)
        source = ring[loc.slot * loc.numel : (loc.slot + 1) * loc.numel]
        staging = self.staging(dtype)
        staging.copy_(source)
        actual = device_digest(staging)
        if actual != ref.digest:
            raise WeightsDigestMismatch(ref.digest, actual)
        return staging

    def staging(self, dtype: torch.dtype | str) -> torch.Tensor:
        """The staging buffer (one, reused), in ``dtype``: what ``load_into`` copies from."""
        dtype = _dtype(dtype) if isinstance(dtype, str) else dtype
        if self._staging is None or self._staging.dtype != dtype:
            self._staging = torch.empty(self.layout.numel, dtype=dtype, device=self.device)
            self._pairs = None
        return self._staging

    def _open(self, loc: Location, dtype: torch.dtype) -> torch.Tensor:
        if self._ring is not None and self._ring[0] == loc.handle:
            return self._ring[1]
        self._ring = None  # (a restarted trainer's ring replaces the old one)
        n = loc.numel * loc.slots
        if loc.handle.startswith("file:"):
            path = loc.handle[len("file:") :]
            if not Path(path).is_file():
                raise FileNotFoundError(f"shared weights ring {path} is gone")
            ring = torch.from_file(path, shared=True, size=n, dtype=dtype)
        elif loc.handle in _EXPORTED:
            ring = _EXPORTED[loc.handle]
        elif loc.handle.startswith("cuda:"):
            ring = _import_cuda(loc.handle[len("cuda:") :], dtype)
            if ring.numel() < n:
                raise ValueError(f"shared weights ring holds {ring.numel()} of {n} elements")
        else:
            raise ValueError(f"shared weights: unknown handle {loc.handle[:20]!r}")
        self._ring = (loc.handle, ring)
        return ring

    def bind(self, model: torch.nn.Module, staged: torch.Tensor) -> None:
        """Pair ``model``'s tensors with their views of ``staged`` for ``load_into`` (once
        per staging buffer): a few milliseconds of Python that a swap need not pause for,
        so the engine does it while it stages, beside the decode loop."""
        key = staged.data_ptr()
        if self._pairs is None or self._pairs[0] != key:
            own = model.state_dict()
            views = self.layout.views(staged)
            names = self.layout.names
            self._pairs = (key, [own[n] for n in names], [views[n] for n in names])

    def load_into(self, model: torch.nn.Module, staged: torch.Tensor) -> None:
        """Copy ``staged`` into ``model``'s parameters in place, one fused copy (tied
        aliases follow their source; casts to the model's dtype as ``copy_`` does)."""
        self.bind(model, staged)
        assert self._pairs is not None
        _, dst, src = self._pairs
        with torch.no_grad():
            torch._foreach_copy_(dst, src)
