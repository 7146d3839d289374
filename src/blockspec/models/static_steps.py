"""Static-shape forwards for captured rounds (docs/design.md section 12, "Captured rounds").

The ordinary cached forwards size their attention to the longest row (`upto`),
check room and roll back through host reads, so every call has new shapes and
several host synchronisations: fine eagerly, fatal for CUDA graphs. The three
steps here see only tensors whose shapes depend on (rows, width, cache capacity):

- `target_step`: the target over [R, W] new tokens (W = 1: the AR decode step; W = g + 1:
  the verify forward over [anchor, drafts]), attending over the whole cache capacity
  under a length mask, with optional feature capture for the draft context;
- `draft_block`: the draft's block forward over the static draft cache at a fixed width;
- `draft_context`: the draft context K/V of W committed positions.

None of them reads a tensor value on the host or changes a row length: the caller
advances / rolls back `cache.lengths` itself (a device op). They write K/V with one
`index_put_` into the cache's whole buffer (the first R rows of a buffer that may
hold more), which compiles to an in-place scatter; a write into a row view would
be traced as a copy of the entire cache. Positions are clamped into the capacity:
real rows never reach it (the caller sizes the cache), padding rows of a bucket
may hold stale lengths and must neither write out of bounds nor read NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.models.draft import DraftModel
from blockspec.models.kv_cache import KVCache
from blockspec.models.layers import Attention
from blockspec.models.target import TargetModel


def _positions(cache: KVCache, rows: int, width: int) -> torch.Tensor:
    """Slots / RoPE positions [rows, width] of the next `width` tokens of the first `rows` rows."""
    pos = cache.lengths[:rows].unsqueeze(1) + torch.arange(width, device=cache.lengths.device)
    return pos.clamp(max=cache.capacity - 1)


def _write(cache: KVCache, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """k, v [rows, Hkv, W, D] into slots [rows, W] of the first `rows` rows, in place in the whole buffer."""
    rows, heads = k.shape[0], k.shape[1]
    dev = slots.device
    index = (torch.full((1, 1, 1), layer, device=dev), torch.arange(rows, device=dev).view(-1, 1, 1),
             torch.arange(heads, device=dev).view(1, -1, 1), slots.view(rows, 1, -1))
    cache.k.index_put_(index, k)
    cache.v.index_put_(index, v)


def _attention(attn: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
               slots: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One cached attention layer over the cache's full capacity: x [R, W, hidden] ->
    [R, W, hidden]; the block's K/V are written at `slots` first, mask [R, 1, W or 1, C]."""
    q, k, v = attn.project_qkv(x, cos, sin)
    _write(cache, attn.layer_idx, k, v, slots)
    rows = x.shape[0]
    return attn.output(grouped_attention(q, cache.k[attn.layer_idx, :rows], cache.v[attn.layer_idx, :rows], mask))


def grouped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """SDPA of q [R, H, W, D] over k, v [R, Hkv, C, D] under a bool mask [R, 1, W or 1, C].

    The G = H / Hkv query heads sharing a KV head are folded into the query length
    ([R, Hkv, G*W, D]), so no kernel copies K/V per query head: SDPA's GQA support
    (enable_gqa) goes to the math kernel under an arbitrary mask on CUDA, which would
    repeat the whole cache G times. A dense mask (the memory-efficient kernel) keeps
    the shapes static, unlike a block mask built from the lengths, and [R, 1, G*W, C]
    is small next to the cache it masks."""
    r, h, w, d = q.shape
    g = h // k.shape[1]
    if g == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    folded = q.reshape(r, h // g, g * w, d)
    mask = mask.expand(r, 1, w, mask.shape[-1]).repeat(1, 1, g, 1)      # query (j, t) -> row t's mask
    return F.scaled_dot_product_attention(folded, k, v, attn_mask=mask).reshape(r, h, w, d)


def target_step(target: TargetModel, tokens: torch.Tensor, cache: KVCache, capture: tuple[int, ...] = ()
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """tokens [R, W] appended causally after each of the first R rows' lengths (K/V
    written, lengths unchanged) -> logits [R, W, V] and, with `capture`, the
    concatenated outputs of those decoder layers [R, W, len(capture) * H]."""
    rows, width = tokens.shape
    cap = cache.capacity
    pos = _positions(cache, rows, width)
    h = target.embed_tokens(tokens)
    cos, sin = target.rotary(pos, h.dtype, limit=cap)
    key = torch.arange(cap, device=tokens.device).view(1, 1, cap)
    causal = (key <= pos.unsqueeze(-1)).unsqueeze(1)                        # [R, 1, W, C]
    cfg = target.config
    window = cfg.attention_window
    # Sliding-window layers also drop keys that left the window (as `sliding_window_mask`).
    narrowed = causal & (key > pos.unsqueeze(-1) - window).unsqueeze(1) if window is not None else causal
    windowed = set(cfg.window_layers) if window is not None else set()
    captured: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(target.layers):
        mask = narrowed if i in windowed else causal
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), cos, sin, cache, pos, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
        if i in capture:
            captured[i] = h
    features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
    return target.lm_head(target.norm(h)), features


def draft_block(draft: DraftModel, block_ids: torch.Tensor, cache: KVCache, embed: nn.Embedding) -> torch.Tensor:
    """`DraftModel.block_hidden` at static shapes: block_ids [R, S] at positions
    lengths.. of the first R rows attend non-causally to their context and the whole
    block; block K/V are scratch written after the context. -> normed hidden [R, S, H]."""
    rows, width = block_ids.shape
    cap = cache.capacity
    pos = _positions(cache, rows, width)
    h = embed(block_ids).to(draft.dtype)
    cos, sin = draft.rotary(pos, h.dtype, limit=cap)
    key = torch.arange(cap, device=block_ids.device).view(1, 1, 1, cap)
    mask = key < (cache.lengths[:rows] + width).view(rows, 1, 1, 1)         # [R, 1, 1, C]
    for layer in draft.layers:
        h = h + _attention(layer.self_attn, layer.input_layernorm(h), cos, sin, cache, pos, mask)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return draft.norm(h)


def draft_context(draft: DraftModel, features: torch.Tensor, cache: KVCache) -> None:
    """`DraftModel.append_context` at static shapes, without advancing: the draft
    context K/V of features [R, W, F] written at the W slots after each of the first
    R rows' lengths (the caller then advances each row by what it committed; the
    slots past that stay stale and are masked or overwritten later)."""
    rows, width = features.shape[:2]
    pos = _positions(cache, rows, width)
    ctx = draft.hidden_norm(draft.fc(features.to(draft.dtype)))
    cos, sin = draft.rotary(pos, ctx.dtype, limit=cache.capacity)
    for layer in draft.layers:
        k, v = layer.self_attn.project_kv(ctx, cos, sin)
        _write(cache, layer.self_attn.layer_idx, k, v, pos)
