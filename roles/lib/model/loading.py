"""Load a model and tokenizer by path (or cached hub id): the tiny model and real models alike.

Everything goes through `AutoModelForCausalLM` / `AutoTokenizer`, so a role never needs
to know whether it runs the tiny CPU model or a real checkpoint. Nothing downloads by
default (`local_files_only=True`): a missing model is a `ModelNotFound`, not a hang on
the network.

    python -c "from roles.lib.model.loading import load_model; print(load_model('runs/x/model/initial'))"
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from roles.lib.model import REPO_ID

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class ModelNotFound(Exception):
    """No model at the given path (and downloading was not allowed)."""


def resolve_device(device: str = "auto") -> str:
    """Map "auto" to "cuda" when a GPU is visible, else "cpu"; pass anything else through."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """A dtype name ("float32", "bf16", ...) as a torch dtype; "auto" stays "auto"."""
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)} or 'auto'")
    return _DTYPES[dtype]


def _in_hub_cache(repo_id: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def resolve_source(path_or_id: str | Path, *, local_files_only: bool = True) -> str:
    """What to hand to `from_pretrained`: an existing directory, or a hub id.

    With `local_files_only`, a hub id is accepted only if it is already in the local
    Hugging Face cache; otherwise `ModelNotFound` names what was looked for.
    """
    path = Path(path_or_id).expanduser()
    if path.exists():
        return str(path)
    text = str(path_or_id)
    if not REPO_ID.match(text):
        raise ModelNotFound(f"model path does not exist: {text}")
    if local_files_only and not _in_hub_cache(text):
        raise ModelNotFound(
            f"model not found: {text} is neither a local directory nor in the Hugging Face "
            "cache (local_files_only=True, so nothing was downloaded)"
        )
    return text


def load_tokenizer(path_or_id: str | Path, *, local_files_only: bool = True) -> Any:
    """The tokenizer saved with the model (a `PreTrainedTokenizerFast` for the tiny one)."""
    from transformers import AutoTokenizer

    source = resolve_source(path_or_id, local_files_only=local_files_only)
    return AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)


def load_model(
    path_or_id: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    local_files_only: bool = True,
) -> Any:
    """A causal LM in eval mode on `device` (which may be "auto")."""
    from transformers import AutoModelForCausalLM

    source = resolve_source(path_or_id, local_files_only=local_files_only)
    model: Any = AutoModelForCausalLM.from_pretrained(
        source, dtype=resolve_dtype(dtype), local_files_only=local_files_only
    )
    return model.to(resolve_device(device)).eval()
