"""KV-cache surgery for continuous batching: merge two running batches, drop rows, trim.

A running batch (``Running``) is what the decode loop carries between steps: the
transformers ``DynamicCache``, the attention mask [B, S] over its columns (1 = a real
token, 0 = left padding) and each row's next position id [B, 1]. Between steps the
cache holds exactly ``S`` columns, the mask's width.

In transformers 5.23 a ``DynamicCache`` is a list of per-layer caches
(``cache.layers[i]``); a full-attention ``DynamicLayer`` keeps ``keys`` and ``values``
as tensors of shape [B, heads, S, head_dim] and grows them by concatenation, and the
attention mask and the query offset are sized from ``get_seq_length()``, i.e. from
``keys.shape[-2]``. So the surgery is tensor surgery on those two attributes:

- ``merge``: the shorter batch is left-padded along the sequence dim (zeros in the
  cache, 0 in the mask, so no query ever attends to them), then the two are
  concatenated along the batch dim. A row's keys carry its own rotary positions
  (position ids count real tokens only), so where its columns sit does not matter;
- ``select``: keep some rows (``DynamicCache.batch_select_indices``);
- ``trim``: drop leading columns that are padding for every row, so a long-running
  loop's cache is as wide as its longest live row, not as everything it ever held.

Only plain ``DynamicLayer`` caches are merged (``mergeable``); a sliding-window or
linear-attention layer keeps state this surgery would corrupt, so the decode loop
then admits new rows only when the running batch is empty.

    run = Running(cache, mask, next_pos)
    run.merge(Running(new_cache, new_mask, new_pos))   # new rows go last
    run.select(torch.tensor([0, 2]))                     # rows 0 and 2 stay
    run.trim()                                           # drop all-padding columns
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer


def mergeable(cache: Any) -> bool:
    """Whether ``cache`` is a cache this module may merge and trim (plain DynamicLayers)."""
    layers = getattr(cache, "layers", None) or []
    return bool(layers) and all(
        type(layer) is DynamicLayer and layer.is_initialized for layer in layers
    )


def left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """``t`` with zeros prepended along ``dim`` up to ``width``."""
    missing = width - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def merge_caches(a: Any, b: Any) -> None:
    """Append ``b``'s rows to ``a`` (in place), left-padding the shorter one with zeros."""
    for la, lb in zip(a.layers, b.layers, strict=True):
        width = max(la.keys.shape[-2], lb.keys.shape[-2])
        la.keys = torch.cat([left_pad(la.keys, width, -2), left_pad(lb.keys, width, -2)])
        la.values = torch.cat([left_pad(la.values, width, -2), left_pad(lb.values, width, -2)])


def trim_cache(cache: Any, n: int) -> None:
    """Drop the first ``n`` sequence columns of every layer (in place)."""
    if n <= 0:
        return
    for layer in cache.layers:
        layer.keys = layer.keys[..., n:, :]
        layer.values = layer.values[..., n:, :]


@dataclass
class Running:
    """A running batch: its cache, attention mask [B, S] and next position ids [B, 1]."""

    cache: Any
    mask: torch.Tensor
    next_pos: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.mask.shape[0])

    def select(self, rows: torch.Tensor) -> None:
        """Keep only ``rows`` (indices into the batch, in the order given)."""
        self.cache.batch_select_indices(rows)
        self.mask, self.next_pos = self.mask[rows], self.next_pos[rows]

    def merge(self, other: Running) -> None:
        """Append ``other``'s rows after this batch's (both must be ``mergeable``)."""
        merge_caches(self.cache, other.cache)
        width = max(self.mask.shape[1], other.mask.shape[1])
        self.mask = torch.cat([left_pad(self.mask, width, 1), left_pad(other.mask, width, 1)])
        self.next_pos = torch.cat([self.next_pos, other.next_pos])

    def trim(self) -> int:
        """Drop leading columns that are padding in every row; how many were dropped."""
        used = self.mask.any(dim=0).nonzero()
        n = int(used[0]) if len(used) else 0
        if n:
            trim_cache(self.cache, n)
            self.mask = self.mask[:, n:]
        return n

    def grow(self) -> None:
        """Open the mask's column for the token about to be fed (before each step)."""
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
