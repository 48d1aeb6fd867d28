"""Model library shared by the inference and trainer roles (not a role itself).

- `tokenizer`: the character tokenizer and chat template of the tiny model
- `tiny`: build the tiny Llama-style model from a seed (`rlbus model init`)
- `loading`: load any model/tokenizer directory with no network
- `weights`: weights <-> deterministic safetensors bytes with a sha256 digest
- `render`: token-in/token-out chat rendering for multi-turn episodes
- `shared_weights`, `broadcast`: weights device to device (``trainer.weights_via``
  "ipc" and "broadcast")
- here: ``serving_dtype``, the dtype inference holds weights in (the trainer's shared
  ring uses it too)

Submodules import torch/transformers; import them directly. This package itself imports
nothing heavy, so `import roles.lib.model` stays cheap, and `materialize_model` loads
torch only when it has a tiny model to build.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

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
    the roles that only need its path (the orchestrator, env servers, a scripted
    teacher) start without torch."""
    if path != "tiny":
        return Path(path)
    from configs.paths import RunPaths

    if tiny_model_built(built := RunPaths.at(run_dir).initial_model):
        return built
    from roles.lib.model.loading import ensure_tiny_model  # torch loads here

    sizes = cfg.model.tiny.model_dump(exclude={"init_seed"})
    return Path(ensure_tiny_model(run_dir, sizes, seed=cfg.model.tiny.init_seed))
