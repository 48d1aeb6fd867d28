"""The forward pass the torch engine runs: a Llama-family decoder over a slot KV cache.

``DecoderRunner`` reads the weights of a Hugging Face causal LM of the Llama family
(``llama``, ``mistral``, ``qwen2``, ``qwen3``: RMSNorm, rotary positions, grouped-query
attention, a gated SiLU MLP; optional q/k norms, qkv biases, sliding windows, tied
embeddings) and runs two functions over a KV cache it owns:

- ``decode(b, span)``: one token for each of rows ``[0, b)``: it reads ``tokens[:b]`` (the
  token to feed) and ``pos[:b]`` (its position), writes that token's keys and values at
  ``pos`` in the row's slot, attends over the slot's first ``span`` columns, and returns
  the next-token logits ``[b, V]`` (the model's dtype). Row ``i`` *is* slot ``i``: no gather, no
  copy of anyone's cache;
- ``prefill(rows)``: writes the keys and values of many tokens (each row: a slot, the
  column it starts at, its tokens) in one pass. It returns nothing: the engine feeds a
  prompt's last token through ``decode``, so every sampled token, the first included,
  comes out of the same step.

Why our own forward and not the model's: the step must be the same fixed sequence of
tensor ops whatever the batch holds (so a CUDA graph can replay it, and so the CPU pays
~20 dispatches per layer instead of the ~60 a transformers layer dispatches), with no
host sync, and the KV cache must be preallocated, indexed by position (not grown with
``torch.cat``). The weights stay the model's own tensors: q/k/v and gate/up are fused by
making the model's parameters views into one buffer each, so ``load_state_dict`` into
the model (a weights swap) updates what the runner multiplies by, in place, at the same
addresses a captured graph reads. ``tests/unit/test_engine.py`` checks the logits
against the model's own forward, for the tiny Llama and a Qwen3.

The cache: per layer, ``[slots, kv_heads, 2, S, head_dim]`` (each KV head's keys, then
its values), allocated once (``S``: ``max_len`` rounded up to ``COLUMN_BLOCK``): each
(slot, head) holds its positions contiguously, so a step writes its tokens' keys and
values with one ``index_put_`` per layer (flat row indices computed once per step) and
attends over ``[b, kv_heads, span, head_dim]`` strided views, with no copy; and a row's
heads sit one stride apart, so those views also flatten to ``[b * kv_heads, span,
head_dim]`` without a copy (the ``bmm`` attention). Grouped-query attention needs no
repeated keys: one token per row, so the query heads sharing a KV head stand where the
query length would.

Batch invariance on the CPU: a row's numbers must not depend on the rows beside it, so
every matrix product runs over a multiple of ``ROW_BLOCK`` rows and attention spans a
multiple of ``COLUMN_BLOCK`` columns (the kernels round a row differently otherwise),
and prefill attention is written out (matmul, float32 softmax, matmul: ``_attend``)
rather than SDPA, whose CPU kernel groups a query's sums by how many queries and keys it
was given. Sizing, admission and refusals are the engine's (``roles.inference.engine``).

    runner = DecoderRunner(model, slots=64, max_len=256)
    runner.prefill([(slot, 0, prompt[:-1])])
    runner.tokens[slot], runner.pos[slot] = prompt[-1], len(prompt) - 1
    logits = runner.decode(b=4, span=32)          # rows 0..3; slot's row is the real one
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from roles.inference.capacity import (
    ROW_BLOCK,
    SUPPORTED_MODEL_TYPES,
    kv_bytes_per_token,
    round_up,
)

# How a decode step attends (``DecoderRunner._decode_attention``): always one kernel, or
# ``auto``: ``bmm`` from ``BMM_FROM_ROWS`` rows on, ``sdpa`` below. On one H200 (bf16, CUDA
# graphs, `just bench-engine --device cuda --compare-attention`) ``sdpa`` was 5-25% faster
# at 1 and 64 rows, ``bmm`` as fast at 256 rows of a 99 M Llama and 10% faster for a
# Qwen3-0.6B shape (its cache reads dominate), 9-14% faster at 1024 rows.
ATTENTION = ("sdpa", "bmm", "auto")
BMM_FROM_ROWS = 256


class UnsupportedModel(ValueError):
    """A model this runner cannot compute (names what it found and what would work)."""


@dataclass
class _Layer:
    """One decoder layer's weights (views of the model's parameters) and cache views."""

    ln1: torch.Tensor
    ln2: torch.Tensor
    wqkv_t: torch.Tensor  # [hidden, (H + 2 KV) * D], a transposed view of the fused buffer
    bqkv: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    wo_t: torch.Tensor
    wgu_t: torch.Tensor  # [hidden, 2 * intermediate]
    wd_t: torch.Tensor
    window: int | None  # sliding-window width, or None for full attention
    kv: torch.Tensor  # [slots, KV, 2, S, D]: each head's keys then values (a cache view)
    rows: torch.Tensor  # the same as [slots * KV * 2 * S, D]: one row per (slot, head, k|v, pos)


def _fuse(linears: Sequence[Any], name: str) -> torch.Tensor | None:
    """Concatenate the ``name`` tensors (weight or bias) of ``linears`` into one buffer
    and make each module's parameter a view into it; the buffer (None when absent)."""
    parts = [getattr(m, name) for m in linears]
    if any(p is None for p in parts):
        return None
    fused = torch.cat([p.detach() for p in parts])
    off = 0
    for p in parts:
        n = p.shape[0]
        p.data = fused[off : off + n]
        off += n
    return fused


def _config_value(cfg: Any, *names: str, default: Any = None) -> Any:
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    return default


def check_supported(model: Any) -> None:
    """Raise ``UnsupportedModel`` unless this runner computes ``model`` exactly."""
    cfg = model.config
    mtype = getattr(cfg, "model_type", "?")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"the torch engine runs {', '.join(SUPPORTED_MODEL_TYPES)} models; this one is "
            f"{mtype!r} ({type(model).__name__}): serve it with inference.backend = 'vllm'"
        )
    act = _config_value(cfg, "hidden_act", "hidden_activation", default="silu")
    if act != "silu":
        raise UnsupportedModel(f"the torch engine's MLP is SiLU-gated; this model uses {act!r}")
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        raise UnsupportedModel(f"{type(model).__name__} has no model.layers / model.rotary_emb")


class DecoderRunner:
    """A Llama-family decoder's forward over a preallocated slot KV cache (module docstring)."""

    def __init__(self, model: Any, *, slots: int, max_len: int, attention: str = "sdpa") -> None:
        check_supported(model)
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        self.attention = attention
        cfg, inner = model.config, model.model
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.slots, self.max_len = slots, max_len
        self.width = width = round_up(max_len)  # cache columns per slot
        self.n_heads = int(cfg.num_attention_heads)
        self.n_kv = int(_config_value(cfg, "num_key_value_heads", default=self.n_heads))
        self.head_dim = int(
            _config_value(cfg, "head_dim", default=cfg.hidden_size // cfg.num_attention_heads)
        )
        self.group = self.n_heads // self.n_kv
        self.eps = float(_config_value(cfg, "rms_norm_eps", default=1e-6))
        self.vocab = int(model.get_input_embeddings().num_embeddings)
        self.embed = model.get_input_embeddings().weight
        self.norm = inner.norm.weight
        self.lm_head_t = model.get_output_embeddings().weight.t()
        dev, dt = self.device, self.dtype
        # Rotary tables from the model's own rotary module (every rope_type it knows),
        # in the serving dtype as the model casts them; rotate_half's sign is folded into
        # sin, so rotate_half(x) * sin == roll(x, D/2) * sin_signed exactly.
        with torch.no_grad():
            positions = torch.arange(width, device=dev)[None]
            cos, sin = inner.rotary_emb(torch.zeros(1, dtype=dt, device=dev), positions)
        half = self.head_dim // 2
        sign = torch.cat([-torch.ones(half), torch.ones(self.head_dim - half)]).to(dev, dt)
        # [S, 1, D]: indexed by positions [N], they broadcast over heads as they are.
        self.cos, self.sin_signed = cos[0, :, None].to(dt), (sin[0] * sign)[:, None].to(dt)
        # The cache: [layers, slots, KV, 2, S, D], zeros at first: each (slot, head) holds
        # its keys and its values contiguously by position (attention reads [b, KV, span,
        # D] with no copy), and a token's keys and values are one write.
        n_layers = len(inner.layers)
        shape = (n_layers, slots, self.n_kv, 2, width, self.head_dim)
        self.cache = torch.zeros(shape, dtype=dt, device=dev)
        # Row offsets, within a slot, of position 0 of each of a token's 2 KV cache rows,
        # in the order ``_qkv`` returns them (keys of heads 0..KV-1, then their values).
        order = [(j % self.n_kv) * 2 + j // self.n_kv for j in range(2 * self.n_kv)]
        self.kv_offsets = torch.tensor(order, device=dev)[None, :] * width  # [1, 2 KV]
        self.slot_rows = 2 * self.n_kv * width  # cache rows per slot
        # The step's inputs, one entry per slot (the engine writes them between steps).
        self.tokens = torch.zeros(slots, dtype=torch.long, device=dev)
        self.pos = torch.zeros(slots, dtype=torch.long, device=dev)
        # Row of (slot, head, position 0) in a layer's cache: [slots, KV].
        self.cols = torch.arange(width, device=dev)[None, :]  # [1, S]
        self.neg_inf = torch.tensor(float("-inf"), dtype=dt, device=dev)
        self.zero = torch.tensor(0.0, dtype=dt, device=dev)
        # Sliding windows: per layer where the config lists layer types (Qwen2/3), else
        # on every layer when it sets a window (Mistral).
        window = getattr(cfg, "sliding_window", None)
        types = (
            getattr(cfg, "layer_types", None)
            or ["sliding_attention" if window else "full_attention"] * n_layers
        )
        self.layers: list[_Layer] = []
        with torch.no_grad():
            for i, layer in enumerate(inner.layers):
                a, f = layer.self_attn, layer.mlp
                wqkv = _fuse([a.q_proj, a.k_proj, a.v_proj], "weight")
                wgu = _fuse([f.gate_proj, f.up_proj], "weight")
                assert wqkv is not None and wgu is not None
                win = window if types[i] == "sliding_attention" and window else None
                self.layers.append(
                    _Layer(
                        ln1=layer.input_layernorm.weight,
                        ln2=layer.post_attention_layernorm.weight,
                        wqkv_t=wqkv.t(),
                        bqkv=_fuse([a.q_proj, a.k_proj, a.v_proj], "bias"),
                        q_norm=a.q_norm.weight if hasattr(a, "q_norm") else None,
                        k_norm=a.k_norm.weight if hasattr(a, "k_norm") else None,
                        wo_t=a.o_proj.weight.t(),
                        wgu_t=wgu.t(),
                        wd_t=f.down_proj.weight.t(),
                        window=win if win is not None and win < max_len else None,
                        kv=self.cache[i],
                        rows=self.cache[i].view(-1, self.head_dim),
                    )
                )
                if a.o_proj.bias is not None or f.down_proj.bias is not None:
                    raise UnsupportedModel("output-projection biases are not supported")
        self.windowed = any(layer.window is not None for layer in self.layers)
        if all(layer.q_norm is None for layer in self.layers):  # (see ``_qkv``)
            qk_heads, v_heads = self.n_heads + self.n_kv, self.n_kv
            ones, zeros = torch.ones_like(self.cos), torch.zeros_like(self.cos)
            self.cos = torch.cat(
                [self.cos.expand(-1, qk_heads, -1), ones.expand(-1, v_heads, -1)], 1
            )
            self.sin_signed = torch.cat(
                [self.sin_signed.expand(-1, qk_heads, -1), zeros.expand(-1, v_heads, -1)], 1
            )
        self._views: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._rows: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.slot_ids = torch.arange(slots, device=dev)
        self._cols: dict[int, torch.Tensor] = {}

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(
            len(self.layers), self.n_kv, self.head_dim, self.cache.element_size()
        )

    # -- pieces ---------------------------------------------------------------------------

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, self.eps)

    def _qkv(
        self, layer: _Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated queries [N, H, D] and keys then values [N, 2 KV, D] (one cache write)
        of hidden states x [N, hidden]."""
        n, h, kv, d = x.shape[0], self.n_heads, self.n_kv, self.head_dim
        qkv = (
            torch.mm(x, layer.wqkv_t)
            if layer.bqkv is None
            else torch.addmm(layer.bqkv, x, layer.wqkv_t)
        )
        heads = qkv.view(n, h + 2 * kv, d)
        # x * cos + rotate_half(x) * sin for every head at once; without q/k norms the
        # tables hold cos = 1, sin = 0 for the v heads, which then pass through exactly.
        if layer.q_norm is None or layer.k_norm is None:
            heads = torch.addcmul(heads * cos, heads.roll(d // 2, dims=-1), sin)
            q, keys_values = heads.split([h, 2 * kv], dim=1)
            return q, keys_values
        qn, kn, v = heads.split([h, kv, kv], dim=1)
        qk = torch.cat([self._rms(qn, layer.q_norm), self._rms(kn, layer.k_norm)], dim=1)
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)
        q, k = qk.split([h, kv], dim=1)
        return q, torch.cat([k, v], dim=1)

    def _mlp_into(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        """h + MLP(norm(h))."""
        gate, up = torch.mm(self._rms(h, layer.ln2), layer.wgu_t).chunk(2, dim=-1)
        return torch.addmm(h, F.silu(gate) * up, layer.wd_t)

    def _mask(self, pos: torch.Tensor, span: int, window: int | None) -> torch.Tensor:
        """Additive attention mask [N, span] of queries at ``pos`` [N, 1]: 0 where a query
        may look, -inf else."""
        cols = self._cols.get(span)
        if cols is None:
            cols = self._cols[span] = self.cols[:, :span]
        hidden = cols > pos
        if window is not None:
            hidden = hidden | (cols <= pos - window)
        return torch.where(hidden, self.neg_inf, self.zero)

    def _head(self, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of rows [0, b): tokens [b], positions [b], slot ids [b]."""
        views = self._rows.get(b)
        if views is None:
            views = self._rows[b] = (self.tokens[:b], self.pos[:b], self.slot_ids[:b])
        return views

    def _cache_views(self, b: int, span: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each layer's keys and values of slots [0, b), columns [0, span), as [b, KV, span, D]."""
        views = self._views.get((b, span))
        if views is None:
            views = [
                tuple(layer.kv[:b, :, part, :span] for part in (0, 1))  # type: ignore[misc]
                for layer in self.layers
            ]
            self._views[(b, span)] = views  # type: ignore[assignment]
        return views  # type: ignore[return-value]

    # -- decode -----------------------------------------------------------------------------

    def decode(self, b: int, span: int) -> torch.Tensor:
        """Feed ``tokens[:b]`` at ``pos[:b]`` (rows = slots 0..b-1), attending over the first
        ``span`` columns of each slot; the next-token logits [b, V] in the model's dtype
        (sampling computes in float32: ``roles.inference.sampling``)."""
        tok, pos, slot = self._head(b)
        h, kv, g, d = self.n_heads, self.n_kv, self.group, self.head_dim
        x = self.embed[tok]
        cos, sin = self.cos[pos], self.sin_signed[pos]  # [b, 1, D]
        pos_col = pos[:, None]
        masks: dict[int | None, torch.Tensor] = {
            None: self._mask(pos_col, span, None).view(b, 1, 1, span)
        }
        if self.windowed:
            for layer in self.layers:
                if layer.window not in masks:
                    masks[layer.window] = self._mask(pos_col, span, layer.window).view(
                        b, 1, 1, span
                    )
        rows = self._cache_rows(slot, pos)
        for layer, (kc, vc) in zip(self.layers, self._cache_views(b, span), strict=True):
            q, keys_values = self._qkv(layer, self._rms(x, layer.ln1), cos, sin)
            layer.rows.index_put_((rows,), keys_values)
            # Grouped-query attention without repeating keys: one token per row, so the
            # `group` query heads sharing a KV head take the place of the query length.
            att = self._decode_attention(q.view(b, kv, g, d), kc, vc, masks[layer.window])
            x = torch.addmm(x, att.reshape(b, h * d), layer.wo_t)
            x = self._mlp_into(layer, x)
        return torch.mm(self._rms(x, self.norm), self.lm_head_t)

    def _cache_rows(self, slot: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's cache (``_Layer.rows``) that the keys and values of tokens at
        (``slot``, ``pos``) [N] go to, in ``_qkv``'s order: [N, 2 KV] (one ``index_put_``
        of the [N, 2 KV, D] keys and values, no reshape)."""
        return (slot * self.slot_rows + pos)[:, None] + self.kv_offsets

    def _decode_attention(
        self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention of one query per row and head: q [b, KV, G, D] over kc, vc [b, KV,
        span, D] (cache views) with an additive mask [b, 1, 1, span]; out [b, KV, G, D].

        ``sdpa``: torch's fused kernel (on the CPU its flash kernel). ``bmm``: two batched
        products over the b * KV heads, softmax in float32 between them: the cache views
        flatten to [b * KV, span, D] without a copy, and a decode step (a handful of
        queries per head) is the shape batched products are made for. ``auto``: by the
        batch (``ATTENTION``); a row's last bits may then move with the batch's size, as
        they do on CUDA anyway (cuBLAS picks kernels by shape).
        """
        b, kv, g, d = q.shape
        if self.attention == "sdpa" or (self.attention == "auto" and b < BMM_FROM_ROWS):
            return F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask)
        span = kc.shape[2]
        scores = torch.bmm(q.reshape(b * kv, g, d), kc.flatten(0, 1).transpose(1, 2))
        probs = scores.view(b, kv, g, span).float().mul_(d**-0.5).add_(mask).softmax(dim=-1)
        out = torch.bmm(probs.to(vc.dtype).view(b * kv, g, span), vc.flatten(0, 1))
        return out.view(b, kv, g, d)

    # -- prefill ----------------------------------------------------------------------------

    def prefill(self, rows: Sequence[tuple[int, int, Sequence[int]]]) -> None:
        """Write the keys and values of each row's ``tokens`` into its slot from column
        ``start`` on (rows: ``(slot, start, tokens)``); columns before ``start`` must hold
        the row's prefix already. One padded pass over all rows."""
        rows = [r for r in rows if len(r[2])]
        if not rows:
            return
        dev = self.device
        h, kv, d = self.n_heads, self.n_kv, self.head_dim
        # Columns padded to a multiple of ``ROW_BLOCK``, so every product runs over a
        # multiple of it (rows x columns): a row's cache must not depend on what it was
        # prefilled with (see ``ROW_BLOCK``).
        width = round_up(max(len(t) for _, _, t in rows), ROW_BLOCK)
        n_rows = len(rows)
        ids_np = np.zeros((n_rows, width), dtype=np.int64)
        slot_np, start_np, len_np = (np.zeros(n_rows, dtype=np.int64) for _ in range(3))
        for i, (s, start, toks) in enumerate(rows):
            ids_np[i, : len(toks)] = toks
            slot_np[i], start_np[i], len_np[i] = s, start, len(toks)
        col = np.arange(width)[None, :]
        # Padding repeats a row's last position (its keys are never written).
        pos_np = start_np[:, None] + np.minimum(col, np.maximum(len_np, 1)[:, None] - 1)
        ids, pos, slot = (torch.from_numpy(a).to(dev) for a in (ids_np, pos_np, slot_np))
        flat_real = torch.from_numpy(np.flatnonzero(col < len_np[:, None])).to(dev)
        # The cache rows of every real token's keys and values (padding writes nothing).
        real_rows = self._cache_rows(
            slot[:, None].expand(-1, width).flatten()[flat_real], pos.flatten()[flat_real]
        )
        span = round_up(max(start + len(t) for _, start, t in rows))
        flat_pos = pos.flatten()
        cos, sin = self.cos[flat_pos], self.sin_signed[flat_pos]
        x = self.embed[ids.flatten()]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            q, keys_values = self._qkv(layer, self._rms(x, layer.ln1), cos, sin)
            layer.rows.index_put_((real_rows,), keys_values[flat_real])
            if i == last:
                break  # the last layer's output feeds only logits, which prefill skips
            keys, vals = layer.kv[slot, :, 0, :span], layer.kv[slot, :, 1, :span]
            mask = self._mask(flat_pos[:, None], span, layer.window).view(n_rows, 1, width, span)
            att = _attend(q.view(n_rows, width, kv, self.group, d), keys, vals, mask)
            x = torch.addmm(x, att.reshape(n_rows * width, h * d), layer.wo_t)
            x = self._mlp_into(layer, x)

    # -- cache surgery ----------------------------------------------------------------------

    def copy_prefix(self, pairs: Sequence[tuple[int, int, int]]) -> None:
        """Copy columns ``[0, n)`` of slot ``src`` into slot ``dst`` for each ``(src, dst, n)``
        (a shared prompt prefix), every layer at once: one gather and one scatter per
        cache for all the pairs of one length (a group's copies are one such set)."""
        by_len: dict[int, list[tuple[int, int]]] = {}
        for src, dst, n in pairs:
            if n > 0 and src != dst:
                by_len.setdefault(n, []).append((src, dst))
        for n, moves in by_len.items():
            src_idx = torch.tensor([m[0] for m in moves], device=self.device)
            dst_idx = torch.tensor([m[1] for m in moves], device=self.device)
            self.cache[:, dst_idx, :, :, :n] = self.cache[:, src_idx, :, :, :n]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of many queries per row, written out (matmul, softmax, matmul).

    q [R, T, KV, G, D] (the G query heads of each KV head), k and v [R, KV, S, D], mask
    [R, 1, T, S]; out [R, T, KV, G, D]. Not SDPA: its CPU kernel's result for a query
    depends on how many queries and keys it was given, and a prompt's cache must not
    depend on what it was prefilled with; here padding keys add exact zeros.
    """
    r, t, kv, g, d = q.shape
    qg = q.permute(0, 2, 3, 1, 4).reshape(r, kv, g * t, d)  # [R, KV, G*T, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(d**-0.5)
    # The softmax in float32 (as transformers' eager attention), whatever the cache dtype.
    scores = (
        scores.view(r, kv, g, t, -1).add_(mask[:, :, None]).softmax(dim=-1, dtype=torch.float32)
    )
    out = torch.matmul(scores.to(v.dtype).view(r, kv, g * t, -1), v)  # [R, KV, G*T, D]
    return out.view(r, kv, g, t, d).permute(0, 3, 1, 2, 4)
