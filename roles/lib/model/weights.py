"""Weights as bytes: how the trainer hands a new policy to inference.

A state dict is serialised with safetensors (no pickle), deterministically (sorted
names, contiguous CPU tensors, fixed metadata), and named by its sha256 digest; the
receiver checks the digest before touching the model.

    b = state_dict_to_bytes(model); d = digest(b)      # trainer
    load_state_bytes(other_model, b, d)                # inference

Tied weights (the tiny model's lm_head is embed_tokens) are stored once: safetensors
refuses tensors that share storage, and the receiving model re-ties them by itself
because `load_state_dict` copies into its existing (already tied) parameters.

A blob is a whole model, or, in a LoRA run, the trainer's adapters
(`adapter_to_bytes`): their metadata says so and gives the scale, so whoever receives
weights asks `state_to_load` what to copy into its model (the blob's tensors, or the
adapted layers' merged weights, `roles.lib.model.lora`) without knowing the run's config.
An adapter blob holds each adapted module's ``<module>.lora_A`` and ``.lora_B`` and the
scale as one more tensor, ``lora_scale``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from roles.lib.model import lora

# Fixed metadata: anything varying here (time, host) would change the digest.
_METADATA = {"format": "pt"}
# The tensor that makes a blob an adapter blob: the factor of B @ A (float64, 0-dim).
SCALE_TENSOR = "lora_scale"


class WeightsDigestMismatch(Exception):
    """The bytes received are not the weights that were announced."""

    def __init__(self, expected: str, actual: str) -> None:
        super().__init__(f"weights digest mismatch: expected {expected}, got {actual}")
        self.expected = expected
        self.actual = actual


def _alias_key(t: torch.Tensor) -> tuple:
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())


def tied_keys(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Map each state-dict key that aliases an earlier key to the key it aliases.

    "Earlier" is module order (embed_tokens before lm_head), so the embedding is the
    copy that is kept.
    """
    first: dict[tuple, str] = {}
    tied: dict[str, str] = {}
    for name, t in state.items():
        key = _alias_key(t)
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    return tied


def state_dict_to_bytes(model: torch.nn.Module) -> bytes:
    """The model's weights as deterministic safetensors bytes, tied copies dropped."""
    return tensors_to_bytes(untied_state(model))


def untied_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict without the tied copies (what ``state_dict_to_bytes`` writes)."""
    state = model.state_dict()
    tied = tied_keys(state)
    return {name: t for name, t in state.items() if name not in tied}


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """Named tensors as deterministic safetensors bytes (sorted names, contiguous CPU
    tensors): a sharded trainer gathers its full state dict and serialises it here."""
    out = {name: tensors[name].detach().to("cpu").contiguous() for name in sorted(tensors)}
    return st_save(out, metadata=_METADATA)


def adapter_to_bytes(adapters: dict[str, torch.Tensor], scale: float) -> bytes:
    """LoRA adapters (``lora.adapter_state``) as a blob that says it is one: beside them,
    their scale as a tensor ``SCALE_TENSOR`` (a tensor, not metadata: safetensors writes
    more than one metadata key in no fixed order, and the digest must not vary)."""
    return tensors_to_bytes(adapter_tensors(adapters, scale))


def adapter_tensors(adapters: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
    """What ``adapter_to_bytes`` writes: the adapters and their scale as a tensor."""
    return {**adapters, SCALE_TENSOR: torch.tensor(float(scale), dtype=torch.float64)}


def header_of(b: bytes) -> dict[str, Any]:
    """A safetensors blob's header (8 bytes of length, then JSON), read alone."""
    n = int.from_bytes(b[:8], "little")
    if len(b) < 8 + n:
        raise ValueError(f"not safetensors bytes: a header of {n} bytes in {len(b)}")
    header: dict[str, Any] = json.loads(b[8 : 8 + n])
    return header


def adapter_scale(b: bytes) -> float | None:
    """The scale of an adapter blob; None for a whole model's weights."""
    entry = header_of(b).get(SCALE_TENSOR)
    if entry is None:
        return None
    start, end = entry["data_offsets"]
    data = 8 + int.from_bytes(b[:8], "little")
    return float(np.frombuffer(b[data + start : data + end], dtype="<f8")[0])


def adapters_of(b: bytes) -> tuple[dict[str, torch.Tensor], float] | None:
    """An adapter blob's (adapters, scale); None for a whole model's weights."""
    factor = adapter_scale(b)
    if factor is None:
        return None
    tensors = bytes_to_state_dict(b)
    tensors.pop(SCALE_TENSOR)
    return tensors, factor


def verified(b: bytes, expected_digest: str) -> bytes:
    """``b`` once its digest is the announced one (else ``WeightsDigestMismatch``)."""
    actual = digest(b)
    if actual != expected_digest:
        raise WeightsDigestMismatch(expected_digest, actual)
    return b


def state_to_load(model: torch.nn.Module, b: bytes) -> dict[str, torch.Tensor]:
    """What to copy into ``model`` to serve blob ``b``: its tensors (a whole model), or
    the merged weights of the layers an adapter blob adapts (from the model's base
    weights, ``lora.base_weights``)."""
    adapter = adapters_of(b)
    if adapter is None:
        return bytes_to_state_dict(b)
    tensors, factor = adapter
    keys = [f"{m}.weight" for m in lora.adapted_modules(tensors)]
    return lora.merge(lora.base_weights(model, keys), tensors, factor)


def bytes_to_state_dict(b: bytes) -> dict[str, torch.Tensor]:
    """Inverse of `state_dict_to_bytes` (CPU tensors; tied copies absent)."""
    return st_load(b)


def digest(b: bytes) -> str:
    """Content address of a weights blob: "sha256:<hex>"."""
    return "sha256:" + hashlib.sha256(b).hexdigest()


def model_dir_tensors(
    model_dir: str | Path, keys: list[str] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face model directory's safetensors files (CPU; only
    ``keys`` when given): the base weights an adapter is merged into off the model."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                if keys is None or name in keys:
                    out[name] = f.get_tensor(name)
    return out


def merged_with(base_dir: str | Path, b: bytes, *, whole: bool) -> dict[str, torch.Tensor]:
    """Adapter blob ``b`` merged into the base model at ``base_dir``: the adapted layers
    (``whole``: the whole model, the rest as the base has it). A whole model's blob is
    its tensors as they are."""
    adapter = adapters_of(b)
    if adapter is None:
        return bytes_to_state_dict(b)
    tensors, factor = adapter
    keys = [f"{m}.weight" for m in lora.adapted_modules(tensors)]
    base = model_dir_tensors(base_dir, None if whole else keys)
    return {**(base if whole else {}), **lora.merge(base, tensors, factor)}


def write_checkpoint_model(checkpoint: Path, base_dir: Path, out: Path) -> None:
    """A trainer checkpoint as a loadable model directory at ``out``: the config and
    tokenizer files of its run's initial model ``base_dir`` (not its weights or their
    index), and the checkpoint's weights (a LoRA checkpoint's adapters merged into the
    base's: ``merged_with``)."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    for f in base_dir.iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy2(f, out / f.name)
    data = (checkpoint / "model.safetensors").read_bytes()
    if adapter_scale(data) is None:
        shutil.copy2(checkpoint / "model.safetensors", out / "model.safetensors")
    else:
        write_atomic(out / "model.safetensors",
                     tensors_to_bytes(merged_with(base_dir, data, whole=True)))  # fmt: skip


def load_state_bytes(model: torch.nn.Module, b: bytes, expected_digest: str) -> None:
    """Verify `b` against `expected_digest`, then load it into `model` in place.

    Strict except for the model's own tied aliases, which are allowed to be missing
    (they were never sent) and come back through the tying itself; an adapter blob
    loads its merged layers only (``state_to_load``).
    """
    state = state_to_load(model, verified(b, expected_digest))
    partial = adapter_scale(b) is not None
    allowed_missing = set(model.state_dict()) if partial else set(tied_keys(model.state_dict()))
    result = model.load_state_dict(state, strict=False)
    missing = set(result.missing_keys) - allowed_missing
    if missing or result.unexpected_keys:
        raise RuntimeError(
            f"weights do not match the model: missing {sorted(missing)}, "
            f"unexpected {sorted(result.unexpected_keys)}"
        )


def write_atomic(path: Path, data: bytes) -> None:
    """Write a weights file so a reader sees the old file or the whole new one, never a
    part (a temporary file beside it, synced, then renamed over it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
