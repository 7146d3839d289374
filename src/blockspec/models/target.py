"""The target decoder (Qwen3 / Llama / Qwen2 / Mistral), one class for all.

`forward` appends tokens to a KVCache (or runs cache-free for training), and
returns logits plus, when asked, the concatenated hidden states of selected
decoder layers (docs/design.md section 2: hidden[0] = embeddings, hidden[i+1] = output
of layer i) without keeping every layer's states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from blockspec.config import TargetConfig
from blockspec.models.attention import ALL_KEYS, KeyMask, append_mask, dense_limit_mask
from blockspec.models.kv_cache import KVCache, sliding_window_mask
from blockspec.models.layers import Attention, AttentionShape, CacheAccess, Linear, RMSNorm, RotaryEmbedding, SwiGLU

LayerMask = torch.Tensor | KeyMask | None


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        shape = AttentionShape(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                               cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.rms_norm_eps)
        self.self_attn = Attention(shape, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: LayerMask,
                kv: CacheAccess | None = None) -> torch.Tensor:
        """Causal attention (see `Attention.forward` for the cache access) + MLP."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, kv, causal=True)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class TargetOutput:
    logits: torch.Tensor | None        # [B, T, V] (or [B, len(logits_at), V]); None unless output="logits"
    features: torch.Tensor | None      # [B, T, len(capture)*H] concatenated layer outputs
    hidden: torch.Tensor | None = None  # output="hidden": the final normed states (at logits_at), no lm_head


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
        # Sliding-window layers attend under a second, narrower mask (built once per
        # forward, only when the config has a window).
        self._window_layers = frozenset(cfg.window_layers)
        self._compiled_decode: Callable[[torch.Tensor, KVCache], torch.Tensor] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, rows, cfg.num_key_value_heads, cfg.head_dim,
                       capacity, self.dtype, self.device)

    def _layer_masks(self, mask: torch.Tensor | None, q_pos: torch.Tensor, key_len: int) -> list[torch.Tensor | None]:
        """Each layer's attention mask: `mask` for full-attention layers, `mask` narrowed
        to the sliding window (queries at q_pos [B, T]) for the window's layers."""
        n = len(self.layers)
        window = self.config.attention_window
        if window is None or key_len <= window:   # no key can fall out of the window
            return [mask] * n
        narrowed = sliding_window_mask(mask, q_pos, key_len, window)
        return [narrowed if i in self._window_layers else mask for i in range(n)]

    def _append_masks(self, lengths: torch.Tensor, width: int, upto: int, q_pos: torch.Tensor,
                      fresh: bool) -> list[KeyMask]:
        """Each layer's keys for `width` tokens appended causally after rows of `lengths` [R]
        (`attention.append_mask`). q_pos [R, width]: the queries' positions (below upto),
        read only for sliding-window layers, which keep a dense band mask."""
        main = append_mask(lengths, width, upto, fresh)
        window = self.config.attention_window
        if window is None or upto <= window:   # no key can fall out of the window
            return [main] * len(self.layers)
        causal = None                          # None: plain causal over key positions (fresh, one row)
        if not fresh and main is not ALL_KEYS:
            causal = main.dense if main.dense is not None else dense_limit_mask(lengths + 1, width, upto, True)
        narrowed = KeyMask(dense=sliding_window_mask(causal, q_pos, upto, window))
        return [narrowed if i in self._window_layers else main for i in range(len(self.layers))]

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None, *,
                num_new: torch.Tensor | None = None, capture: tuple[int, ...] = (),
                logits_at: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, output: str = "logits",
                positions: torch.Tensor | None = None) -> TargetOutput:
        """Run `input_ids` [B, T].

        With a cache: the tokens are appended after each row's current length,
        attention is causal, and lengths advance by `num_new` [B] (default T;
        smaller for right-padded rows). Without a cache: positions 0..T-1, causal.
        `capture`: decoder layer ids whose outputs are concatenated into `features`.
        `logits_at` [B, K]: compute logits only at these positions of the block.
        `mask`: overrides the attention mask (cache-free training uses it).
        `positions` [B, T]: each token's RoPE position. Cache-free: packed training rows restart
        at 0 per sequence (pass the block-diagonal causal `mask` with them). With a cache (and
        the `mask` that goes with them): a draft tree's nodes, written at the next slots but
        each at its own depth (decoding/tree.py).
        `output`: "logits" (default); "hidden": the final normed states, no lm_head (a trainer
        projects them in chunks); "features": only the captured layers, the layers after the
        deepest captured one are not run (cache-free only: a cache would miss their K/V).
        """
        if output not in ("logits", "hidden", "features"):
            raise ValueError(f"output must be logits, hidden or features, got {output!r}")
        if output == "features" and (cache is not None or not capture):
            raise ValueError('output="features" needs capture and no cache')
        if positions is not None and cache is not None and mask is None:
            raise ValueError("positions with a cache need the mask that goes with them (a draft tree's)")
        b, t = input_ids.shape
        h = self.embed_tokens(input_ids)
        seq_len = None  # per-token sequence length, for length-dependent RoPE only
        key_pos = None  # the queries' key indices, when they differ from their positions (packed rows)
        if cache is None:
            if positions is None:
                positions = torch.arange(t, device=h.device).expand(b, t)
            else:
                key_pos = torch.arange(t, device=h.device).expand(b, t)
            slots, upto = None, t
            if self.rotary.rope.length_dependent:  # one call over the whole sequence
                seq_len = positions.new_full((1, 1), t)
        else:
            longest = cache.check_room(t)
            slots = cache.positions(t)
            positions = slots if positions is None else positions
            upto = longest + t if mask is None else mask.shape[-1]
            if self.rotary.rope.length_dependent:
                # A row started by this call (its prompt) has the prompt's length; later
                # tokens each their own (RotaryEmbedding's docstring).
                n = torch.as_tensor(t if num_new is None else num_new, device=h.device).expand(b)
                seq_len = torch.where((cache.lengths == 0).unsqueeze(1), n.unsqueeze(1), positions + 1)
        cos, sin = self.rotary(positions, h.dtype, seq_len=seq_len)
        masks: list[LayerMask]
        if cache is not None and mask is None:
            masks = list(self._append_masks(cache.lengths, t, upto, positions, fresh=longest == 0))
        else:
            masks = list(self._layer_masks(mask, positions if key_pos is None else key_pos, upto))
        captured: dict[int, torch.Tensor] = {}
        last = max(capture) if output == "features" else len(self.layers) - 1
        kv = CacheAccess(cache, slots, upto) if cache is not None else None
        for i, layer in enumerate(self.layers[:last + 1]):
            h = layer(h, cos, sin, masks[i], kv)
            if i in capture:
                captured[i] = h
        if cache is not None:
            cache.advance(t if num_new is None else num_new)
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        if output == "features":
            return TargetOutput(None, features)
        if logits_at is not None:
            h = h.gather(1, logits_at.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        if output == "hidden":
            return TargetOutput(None, features, self.norm(h))
        return TargetOutput(self.lm_head(self.norm(h)), features)

    # -- one-token decode, optionally compiled (gpt-fast style) ------------------------
    @property
    def decode_compiled(self) -> bool:
        return self._compiled_decode is not None

    def compile_decode(self) -> None:
        """Capture the one-token decode step with torch.compile (inductor, weights frozen
        as constants: inference only). The first step per batch size and cache capacity
        compiles (tens of seconds on a small CPU); later steps run fused kernels."""
        if self._compiled_decode is None:
            self._compiled_decode = torch.compile(self._decode_logits, fullgraph=True, dynamic=False,
                                                  options={"freezing": True, "cpp_wrapper": True})

    def _decode_logits(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Static-shape step: attention spans the whole cache under a length mask, so
        shapes depend only on (rows, capacity) and one graph serves every step."""
        pos = cache.lengths.unsqueeze(1)                                   # [R, 1]
        h = self.embed_tokens(tokens.unsqueeze(1))
        cos, sin = self.rotary(pos, h.dtype, limit=cache.capacity)
        mask = (torch.arange(cache.capacity, device=h.device) <= pos).view(-1, 1, 1, cache.capacity)
        masks = self._layer_masks(mask, pos, cache.capacity)
        kv = CacheAccess(cache, pos, cache.capacity)
        for layer, layer_mask in zip(self.layers, masks):
            h = layer(h, cos, sin, layer_mask, kv)
        return self.lm_head(self.norm(h))

    def decode_step(self, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Append one token per row (tokens [R]) and return logits [R, 1, V]; the
        compiled step after `compile_decode()`, else the ordinary forward."""
        if self._compiled_decode is None:
            return self(tokens.unsqueeze(1), cache).logits
        cache.check_room(1)
        logits = self._compiled_decode(tokens, cache)
        cache.advance(1)
        return logits

    def forward_packed(self, tokens: torch.Tensor, counts: torch.Tensor, cache: KVCache, *,
                       capture: tuple[int, ...] = ()) -> TargetOutput:
        """Ragged (packed) append for verification: rows add different numbers of tokens.

        tokens [N]: every row's new tokens back to back, row r contributing
        counts[r] >= 0 of them (N = counts.sum()), appended causally after the
        row's cache length. Embeddings, projections, MLPs and the lm_head run
        over the N packed tokens only; attention is per row against that row's
        cache. Lengths advance by `counts`. Returns logits [1, N, V] and
        features [1, N, len(capture)*H] in packed order."""
        counts = counts.to(device=tokens.device, dtype=torch.long)
        cache.check_room_rows(counts)
        rows = torch.repeat_interleave(torch.arange(counts.shape[0], device=tokens.device), counts)
        offsets = torch.cumsum(counts, 0) - counts
        cols = torch.arange(tokens.shape[0], device=tokens.device) - offsets[rows]
        width = max(1, int(counts.max()))
        upto = int((cache.lengths + counts).max())
        # Query t of row r sees slots <= lengths[r] + t (padding queries included: no empty rows).
        limit = cache.lengths.unsqueeze(1) + torch.arange(width, device=tokens.device)
        h = self.embed_tokens(tokens).unsqueeze(0)
        slots = cache.lengths[rows] + cols
        seq_len = None
        if self.rotary.rope.length_dependent:  # as in `forward`: a row started here has its count
            seq_len = torch.where(cache.lengths[rows] == 0, counts[rows], slots + 1).unsqueeze(0)
        cos, sin = self.rotary(slots.unsqueeze(0), h.dtype, seq_len=seq_len)
        # Padding queries (beyond a row's count) are clamped into the key range so that
        # their sliding window is never empty (their outputs are dropped).
        masks = self._append_masks(cache.lengths, width, upto, limit.clamp(max=upto - 1), fresh=False)
        captured: dict[int, torch.Tensor] = {}
        kv = CacheAccess(cache, slots, upto, (rows, cols), width)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, masks[i], kv)
            if i in capture:
                captured[i] = h
        cache.advance(counts)
        logits = self.lm_head(self.norm(h))
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return TargetOutput(logits, features)
