"""Process setup for the torch engine (``roles.inference.torch_backend``): torch's thread
count, the CUDA memory share inference may take, and the default stop tokens (the vLLM
backend uses those too)."""

from __future__ import annotations

from typing import Any

import torch

from roles.inference.capacity import on_cuda
from roles.lib.threads import torch_threads


def configure_torch_threads() -> int:
    """Set torch's intra-op threads from ``RLBUS_TORCH_THREADS`` (default 1)."""
    n = torch_threads()
    if n > 0 and torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def limit_gpu_memory(device: str, fraction: float | None) -> None:
    """Cap this process's CUDA caching allocator at ``fraction`` of the device's memory
    (``inference.gpu_memory_fraction``), so a trainer on the same GPU keeps the rest.
    A no-op off CUDA or without a fraction."""
    if fraction is None or not on_cuda(device):
        return
    # An index-less "cuda" is the current device (None), as the model's .to("cuda") is.
    torch.cuda.set_per_process_memory_fraction(float(fraction), torch.device(device).index)


def default_stop_ids(tokenizer: Any) -> list[int]:
    """The renderer's stop tokens (``<|end|>`` and eos), or eos for a template-less model."""
    try:
        from roles.lib.model.render import Renderer

        return list(Renderer(tokenizer).stop_token_ids)
    except Exception:  # noqa: BLE001 - no chat template: eos is all we know
        eos = getattr(tokenizer, "eos_token_id", None)
        return [eos] if eos is not None else []
