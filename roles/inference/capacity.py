"""Which models the torch engine runs, in which dtype, and how many rows its KV cache
holds: arithmetic on a model's config and the run's, no torch, so ``rlbus up`` can refuse a config before any role starts
(``roles.up.preflight``) with the very rules the engine applies at load
(``roles.inference.engine``, ``roles.inference.model_runner``).

    shape = ModelShape.of(json.loads(Path("m/config.json").read_text()))
    shape.unsupported()                       # None, or why the engine cannot run it
    plan_slots(64, 256, shape.kv_bytes_per_token(4), 2 << 30)   # rows that fit
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type values whose decoder layers the engine computes exactly (the test suite checks
# llama and qwen3 against transformers' own forward, and a mistral sliding window).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Every matrix product runs over a multiple of this many rows: the CPU's GEMM computes a
# row with other instructions when the row count is not a multiple of 4 (below 4 on one
# thread, 5-7 and 9-11 on two), which moves its result in the last bits.
ROW_BLOCK = 4

# Attention always spans a multiple of this many cache columns (the cache is that wide
# too): the CPU's SDPA kernel and vectorised softmax round a row differently when its
# length is not a multiple of their blocks, and a row's numbers must not depend on how
# long the other rows of its batch are.
COLUMN_BLOCK = 16

CPU_KV_BYTES = 2 << 30  # the KV budget on the CPU when `inference.kv_cache_gb` is unset


DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def on_cuda(device: str) -> bool:
    """Whether a resolved device string ("cpu", "cuda", "cuda:1", ...) is a CUDA GPU."""
    return device.startswith("cuda")


def round_up(n: int, block: int = COLUMN_BLOCK) -> int:
    return -(-n // block) * block


class KVCacheTooSmall(ValueError):
    """The KV budget holds fewer than ``ROW_BLOCK`` slots of ``max_len`` positions."""


def plan_slots(max_batch_size: int, max_len: int, bytes_per_token: int, budget: int) -> int:
    """How many rows may be live at once: ``max_batch_size``, or fewer when the budget
    does not hold that many slots of ``max_len`` positions (slots come in multiples of
    ``ROW_BLOCK``, the step's row padding); ``KVCacheTooSmall`` if it holds not one block."""
    per_slot = max_len * bytes_per_token
    fit = budget // per_slot
    rows = min(max_batch_size, fit)
    if round_up(rows, ROW_BLOCK) > fit:
        rows = fit // ROW_BLOCK * ROW_BLOCK
    if rows < 1:
        raise KVCacheTooSmall(
            f"the KV cache budget ({budget / 2**30:.3f} GiB) holds fewer than {ROW_BLOCK} "
            f"sequences of {max_len} tokens ({per_slot / 2**30:.3f} GiB each): raise "
            "`inference.kv_cache_gb` (or `inference.gpu_memory_fraction`), or lower "
            "`inference.max_model_len`"
        )
    return rows


@dataclass(frozen=True)
class ModelShape:
    """What the engine needs to know of a model, read from its config."""

    model_type: str
    layers: int
    kv_heads: int
    head_dim: int
    max_positions: int

    @classmethod
    def of(cls, config: dict[str, Any]) -> ModelShape | None:
        """The shape in a ``config.json`` (as a dict), or None if it does not say."""
        try:
            heads = int(config["num_attention_heads"])
            return cls(
                model_type=str(config["model_type"]),
                layers=int(config["num_hidden_layers"]),
                kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or int(config["hidden_size"]) // heads),
                max_positions=int(config["max_position_embeddings"]),
            )
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            return None

    def unsupported(self) -> str | None:
        """Why the torch engine cannot run this model, or None."""
        if self.model_type in SUPPORTED_MODEL_TYPES:
            return None
        return (
            f"the torch engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models; this one is "
            f"{self.model_type!r}: serve it with inference.backend = 'vllm'"
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return kv_bytes_per_token(self.layers, self.kv_heads, self.head_dim, dtype_bytes)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of keys and values one token holds in the cache."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes
