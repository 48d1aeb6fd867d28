"""Load a model and tokenizer by path (or cached hub id): the tiny model and real models alike.

Everything goes through `AutoModelForCausalLM` / `AutoTokenizer`, so a role never needs
to know whether it runs the tiny CPU model or a real checkpoint. Nothing downloads by
default (`local_files_only=True`): a missing model is a `ModelNotFound`, not a hang on
the network.

    python -c "from roles.lib.model.loading import load_model; print(load_model('runs/x/model/initial'))"
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from roles.lib.model import REPO_ID

if TYPE_CHECKING:  # torch loads where a model or a device is asked for, not to read a tokenizer
    import torch

_DTYPES = {
    "float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16",
}  # fmt: skip
# The tokenizer classes ``PreTrainedTokenizerFast`` itself is (transformers 5 names it
# ``TokenizersBackend``): what ``AutoTokenizer`` would build for them, built without the
# model-config machinery it imports (and torch with it).
_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


class ModelNotFound(Exception):
    """No model at the given path (and downloading was not allowed)."""


def resolve_device(device: str = "auto") -> str:
    """Map "auto" to "cuda" when a GPU is visible, else "cpu"; pass anything else through."""
    if device == "auto":
        if not gpu_driver_present():
            return "cpu"  # torch could not see a GPU either: no need to import it to ask
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def gpu_driver_present() -> bool:
    """Whether this Linux machine has a GPU driver torch could use (NVIDIA's, ROCm's, or
    WSL's GPU bridge); without one ``torch.cuda.is_available()`` is False. Elsewhere
    (not Linux) it cannot tell, and says True, so that torch is asked."""
    if not Path("/proc").is_dir():
        return True
    return any(
        Path(p).exists() for p in ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd", "/dev/dxg")
    )


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """A dtype name ("float32", "bf16", ...) as a torch dtype; "auto" stays "auto"."""
    import torch

    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)} or 'auto'")
    resolved: torch.dtype = getattr(torch, _DTYPES[dtype])
    return resolved


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
    """The tokenizer saved with the model (a `PreTrainedTokenizerFast` for the tiny one),
    as `AutoTokenizer` builds it. A local model whose tokenizer is `PreTrainedTokenizerFast`
    itself (every model built here, many real ones) is loaded by that class directly:
    the same object, without `AutoTokenizer`'s import of torch (~3 s of a role's start)."""
    source = resolve_source(path_or_id, local_files_only=local_files_only)
    if _tokenizer_class(source) in _FAST_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(source, local_files_only=local_files_only)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source, local_files_only=local_files_only)


def _tokenizer_class(source: str) -> str | None:
    """``tokenizer_class`` of a local model's ``tokenizer_config.json`` (None: a hub id,
    no such file, or none named)."""
    try:
        config = json.loads((Path(source) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("tokenizer_class") if isinstance(config, dict) else None
    return name if isinstance(name, str) else None


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


def transformer_blocks(model: Any) -> list[Any]:
    """The model's repeated blocks, in order: the modules whose class the model names in
    ``_no_split_modules`` (``LlamaDecoderLayer``, ``Qwen3DecoderLayer``, ...), found
    through a LoRA wrapper too. What FSDP shards and ``compile_blocks`` compiles, one by one."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    base = getattr(model, "get_base_model", None)
    if not names and base is not None:
        names = set(getattr(base(), "_no_split_modules", None) or [])
    return [m for m in model.modules() if type(m).__name__ in names]


def compile_blocks(model: Any) -> int:
    """``torch.compile`` every transformer block in place (regional compilation: the
    blocks share one class, so one compile serves them all), with dynamic shapes, so a
    new batch or sequence size does not compile again. Returns the blocks compiled;
    raises when the model names none (an architecture this cannot find blocks in)."""
    blocks = transformer_blocks(model)
    if not blocks:
        raise ValueError(
            f"trainer.compile: no transformer blocks found in {type(model).__name__} "
            "(its _no_split_modules names none)"
        )
    for block in blocks:
        block.compile(dynamic=True)
    return len(blocks)
