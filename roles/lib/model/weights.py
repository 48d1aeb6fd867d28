"""Weights as bytes: how the trainer hands a new policy to inference.

A state dict is serialised with safetensors (no pickle), deterministically (sorted
names, contiguous CPU tensors, fixed metadata), and named by its sha256 digest; the
receiver checks the digest before touching the model.

    b = state_dict_to_bytes(model); d = digest(b)      # trainer
    load_state_bytes(other_model, b, d)                # inference

Tied weights (the tiny model's lm_head is embed_tokens) are stored once: safetensors
refuses tensors that share storage, and the receiving model re-ties them by itself
because `load_state_dict` copies into its existing (already tied) parameters.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

# Fixed metadata: anything varying here (time, host) would change the digest.
_METADATA = {"format": "pt"}


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
    state = model.state_dict()
    tied = tied_keys(state)
    return tensors_to_bytes({name: t for name, t in state.items() if name not in tied})


def tensors_to_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    """Named tensors as deterministic safetensors bytes (sorted names, contiguous CPU
    tensors): a sharded trainer gathers its full state dict and serialises it here."""
    out = {name: tensors[name].detach().to("cpu").contiguous() for name in sorted(tensors)}
    return st_save(out, metadata=_METADATA)


def bytes_to_state_dict(b: bytes) -> dict[str, torch.Tensor]:
    """Inverse of `state_dict_to_bytes` (CPU tensors; tied copies absent)."""
    return st_load(b)


def digest(b: bytes) -> str:
    """Content address of a weights blob: "sha256:<hex>"."""
    return "sha256:" + hashlib.sha256(b).hexdigest()


def load_state_bytes(model: torch.nn.Module, b: bytes, expected_digest: str) -> None:
    """Verify `b` against `expected_digest`, then load it into `model` in place.

    Strict except for the model's own tied aliases, which are allowed to be missing
    (they were never sent) and come back through the tying itself.
    """
    actual = digest(b)
    if actual != expected_digest:
        raise WeightsDigestMismatch(expected_digest, actual)
    allowed_missing = set(tied_keys(model.state_dict()))
    result = model.load_state_dict(bytes_to_state_dict(b), strict=False)
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
