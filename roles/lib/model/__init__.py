"""Model library shared by the inference and trainer roles (not a role itself).

- `tokenizer`: the character tokenizer and chat template of the tiny model
- `tiny`: build the tiny Llama-style model from a seed (`rlbus model init`)
- `families`: models of real families (Qwen3, Llama) built here: a BPE tokenizer, a chat
  template, random weights
- `loading`: load any model/tokenizer directory with no network; its transformer blocks
  (FSDP's units, and what ``trainer.compile`` compiles)
- `weights`: weights <-> deterministic safetensors bytes with a sha256 digest (a whole
  model, or LoRA adapters merged where they serve)
- `lora`: LoRA adapters (``trainer.lora``, the peft library) and their merge
- `render`: token-in/token-out chat rendering for multi-turn episodes
- `shared_weights`, `broadcast`: weights device to device (``trainer.weights_via``
  "ipc" and "broadcast")
- here: ``serving_dtype``, the dtype inference holds weights in (the trainer's shared
  ring uses it too)
- here: ``materialize_model`` and ``ensure_tiny_model``, a run's initial model directory
  (a tiny model built once per machine, then copied from ``model_cache_dir()``)

Submodules import torch/transformers; import them directly. This package itself imports
nothing heavy, so `import roles.lib.model` stays cheap, and `materialize_model` loads
torch only when it has a tiny model to build.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

# A Hugging Face repo id ("name" or "org/name"), as opposed to a filesystem path (here,
# torch-free, so that ``rlbus up``'s pre-flight checks use the rule the loader uses).
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# The files a finished tiny model directory has (the build writes them to a temporary
# directory renamed into place, so their presence means the build completed).
TINY_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")

if TYPE_CHECKING:
    from configs import RunConfig


def serving_dtype(dtype: str, device: str, served: str = "auto") -> str:
    """The dtype inference holds the weights in: ``served`` (``inference.dtype``) when it
    names one; else ``dtype`` off CUDA, and on CUDA bfloat16, or float16 when ``dtype``
    asks for it.

    The trainer keeps float32 master weights (``model.dtype = "float32"``); a float32
    copy on the GPU would double inference's memory and slow every step, while the
    logprobs the trainer compares against are computed in float32 either way.
    """
    if served != "auto":
        return served
    if not device.startswith("cuda"):
        return dtype
    return "float16" if dtype in ("float16", "fp16") else "bfloat16"


def tiny_model_built(directory: Path) -> bool:
    """Whether ``directory`` holds a finished tiny model (``TINY_MODEL_FILES``)."""
    return all((directory / name).exists() for name in TINY_MODEL_FILES)


def materialize_model(cfg: RunConfig, path: str, run_dir: Path) -> Path:
    """A loadable model directory: ``"tiny"`` builds (once) the run's tiny model under
    ``run_dir``; anything else is a local directory or hub id, returned as it is. Once
    built (``rlbus up`` builds it before any role starts), nothing heavy is imported:
    a role that only needs its path (the orchestrator) starts without torch."""
    if path != "tiny":
        return Path(path)
    sizes = cfg.model.tiny.model_dump(exclude={"init_seed"})
    return ensure_tiny_model(run_dir, sizes, seed=cfg.model.tiny.init_seed)


# The modules whose code decides a tiny model's bytes (with the versions of torch,
# transformers and tokenizers, part of a cached build's key).
_KEY_PACKAGES = ("torch", "transformers", "tokenizers")
_BUILDERS = ("tiny.py", "families.py", "tokenizer.py")


def model_cache_dir() -> Path:
    """Where built tiny models are kept for the next run that asks for the same one:
    $RLBUS_CACHE_DIR, else $XDG_CACHE_HOME/rlbus, else ~/.cache/rlbus."""
    if root := os.environ.get("RLBUS_CACHE_DIR"):
        return Path(root) / "models"
    xdg = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg) / "rlbus" / "models"


def _build_key(sizes: dict[str, Any], seed: int) -> str:
    """What a build's bytes depend on: its sizes and seed, the builders' code, and the
    versions of ``_KEY_PACKAGES`` (read from their metadata: nothing imported)."""
    here = Path(__file__).parent
    h = hashlib.sha256(json.dumps([sizes, seed], sort_keys=True).encode())
    for name in _BUILDERS:
        h.update((here / name).read_bytes())
    for package in _KEY_PACKAGES:
        h.update(metadata.version(package).encode())
    return h.hexdigest()[:24]


def ensure_tiny_model(
    run_dir: str | Path, tiny_cfg_kwargs: dict[str, Any] | None, seed: int
) -> Path:
    """`<run_dir>/model/initial`, building the tiny model there first if it is absent.

    The same build (``_build_key``) is made once per machine: kept under
    ``model_cache_dir()`` and copied from there (a build is deterministic, so the copy
    is the bytes a build would write; torch is not even imported). The files go to a temporary sibling directory
    renamed into place, so a crash mid-build never leaves a half-written model that
    later runs would trust.
    """
    from configs.paths import RunPaths

    target = RunPaths.at(run_dir).initial_model
    if tiny_model_built(target):
        return target
    sizes = dict(tiny_cfg_kwargs or {})
    cached = model_cache_dir() / f"tiny-{_build_key(sizes, seed)}"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".initial-", dir=target.parent))
    tmp.chmod(target.parent.stat().st_mode & 0o777)  # mkdtemp's 0700 would stay on the model
    try:
        if tiny_model_built(cached):
            _copy_files(cached, tmp)
        else:
            _build(tmp, sizes, seed)
            _keep(tmp, cached)
        if tiny_model_built(target):
            return target  # another process finished first (same seed, same bytes): keep theirs
        if target.exists():  # a stale partial directory from an older crash
            shutil.rmtree(target)
        tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return target


def _build(folder: Path, sizes: dict[str, Any], seed: int) -> None:
    from roles.lib.model.families import build_family_model  # torch loads here
    from roles.lib.model.tiny import build_tiny_model

    sizes = dict(sizes)
    arch = sizes.pop("arch", "char")
    vocab_size = sizes.pop("vocab_size", None)
    if arch == "char":
        build_tiny_model(folder, seed=seed, **sizes)
    else:
        build_family_model(folder, arch, seed=seed, vocab_size=vocab_size, **sizes)


def _copy_files(src: Path, dst: Path) -> None:
    """Each file of ``src`` into ``dst``: new files, so with the umask's mode."""
    for f in src.iterdir():
        shutil.copyfile(f, dst / f.name)


def _keep(built: Path, cached: Path) -> None:
    """A copy of ``built`` at ``cached`` (best effort: a cache that cannot be written
    only means the next run builds again)."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=cached.parent))
        try:
            _copy_files(built, tmp)
            tmp.rename(cached)  # fails if another process kept the same build first
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass
