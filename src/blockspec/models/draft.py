"""The DFlash draft (design section 3), with optional DSpark heads.

Per round: the target features of newly committed positions become K/V in
every draft layer's cache (`append_context`), then the block
`[anchor, MASK, ...]` runs non-causally over [cached context ; block] in ONE
forward (`block_hidden`). Block K/V are written into the slots right after
the context and never kept (the row length does not advance), so the next
context append simply overwrites them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.config import DraftConfig
from blockspec.models.kv_cache import KVCache
from blockspec.errors import BlockspecError
from blockspec.models.heads import ConfidenceHead, MarkovHead
from blockspec.models.layers import Attention, FusedLinears, Linear, RMSNorm, RotaryEmbedding, SwiGLU, attend


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                   cfg.head_dim, False, False, True, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                context: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: tuple[KVCache, int, torch.Tensor, int] | None = None) -> torch.Tensor:
        """Block tokens h attend to context K/V plus the block's own K/V.

        context: explicit (k, v) [B, Hkv, S, D] placed before the block (training);
        cache: (cache, layer, slots, upto): the block K/V are written at `slots`
        right after each row's context and attention reads cache[:upto]."""
        x = self.input_layernorm(h)
        attn = self.self_attn
        q, k, v = attn.project_qkv(x, cos, sin)
        if cache is not None:
            kv_cache, layer, slots, upto = cache
            kv_cache.write(layer, k, v, slots)
            k, v = kv_cache.view(layer, upto)
        elif context is not None:
            k = torch.cat([context[0], k], dim=2)
            v = torch.cat([context[1], v], dim=2)
        h = h + attn.output(attend(q, k, v, mask))
        return h + self.mlp(self.post_attention_layernorm(h))


class DraftModel(nn.Module):
    """Draft weights. The target's embedding and lm_head are borrowed at call
    time (`embed`, `lm_head` arguments), never stored here."""

    def __init__(self, cfg: DraftConfig) -> None:
        super().__init__()
        self.config = cfg
        n_feat = len(cfg.target_layer_ids)
        self.fc = Linear(n_feat * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
        self.markov_head = (MarkovHead(cfg.vocab_size, cfg.hidden_size, cfg.markov_rank, cfg.markov_head_type)
                            if cfg.markov_rank > 0 else None)
        conf_rank = cfg.markov_rank if (cfg.confidence_head_with_markov and cfg.markov_rank > 0) else 0
        self.confidence_head = ConfidenceHead(cfg.hidden_size, conf_rank) if cfg.enable_confidence_head else None
        # Every layer's k_proj and v_proj in one GEMM over the context (inference).
        self._context_kv = FusedLinears(*(p for l in self.layers for p in (l.self_attn.k_proj, l.self_attn.v_proj)))

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def set_block_size(self, block_size: int) -> None:
        """Run with a shorter block than trained (fewer drafts per round)."""
        cfg = self.config
        if block_size < (2 if cfg.layout == "zlab" else 1):
            raise BlockspecError(f"block size {block_size} is too small for the {cfg.layout} layout")
        if block_size > cfg.block_size:
            raise BlockspecError(f"block size {block_size} exceeds the {cfg.block_size} this draft was trained with")
        cfg.block_size = block_size
        if cfg.confidence_temperatures is not None:
            cfg.confidence_temperatures = cfg.confidence_temperatures[:cfg.num_drafts]

    def new_cache(self, rows: int, capacity: int) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, rows, cfg.num_key_value_heads, cfg.head_dim, capacity,
                       self.dtype, self.fc.weight.device)

    # -- context ----------------------------------------------------------------
    def context_kv(self, features: torch.Tensor, positions: torch.Tensor, fused: bool = True
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """features [B, n, len(ids)*H] at `positions` [B, n] -> per-layer (K, V) [B, Hkv, n, D].

        The context bypasses input_layernorm: K = RoPE(k_norm(k_proj(ctx))), V = v_proj(ctx)."""
        ctx = self.hidden_norm(self.fc(features.to(self.dtype)))
        cos, sin = self.rotary(positions, ctx.dtype)
        out = []
        if fused:
            chunks = self._context_kv(ctx)
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                out.append((attn.prepare_k(chunks[2 * i], cos, sin), attn.split(chunks[2 * i + 1], attn.kv_heads)))
        else:
            for layer in self.layers:
                out.append(layer.self_attn.project_kv(ctx, cos, sin))
        return out

    def append_context(self, cache: KVCache, features: torch.Tensor, num_new: torch.Tensor | int) -> None:
        """Write K/V for the next features.shape[1] positions of every row; rows advance by num_new."""
        width = features.shape[1]
        cache.check_room(width)
        slots = cache.positions(width)
        for i, (k, v) in enumerate(self.context_kv(features, slots)):
            cache.write(i, k, v, slots)
        cache.advance(num_new)

    # -- block ------------------------------------------------------------------
    def block_hidden(self, block_ids: torch.Tensor, cache: KVCache, embed: nn.Embedding) -> torch.Tensor:
        """block_ids [B, S] at positions cache.lengths.. -> normed hidden states [B, S, H]."""
        b, s = block_ids.shape
        cache.check_room(s)
        slots = cache.positions(s)
        upto = int(cache.lengths.max()) + s
        mask = None
        if b > 1:
            key_pos = torch.arange(upto, device=block_ids.device)
            mask = (key_pos.view(1, 1, upto) < (cache.lengths + s).view(b, 1, 1)).unsqueeze(1)
        h = embed(block_ids).to(self.dtype)
        cos, sin = self.rotary(slots, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, mask, cache=(cache, i, slots, upto))
        return self.norm(h)

    def forward(self, features: torch.Tensor, block_ids: torch.Tensor, block_positions: torch.Tensor,
                       mask: torch.Tensor, embed: nn.Embedding) -> torch.Tensor:
        """Training forward (packed): context of every position [B, T] plus many blocks at once.

        block_ids / block_positions [B, N]; mask [B, 1, N, T + N] (True = may attend).
        Returns normed hidden states of the block tokens [B, N, H]."""
        t = features.shape[1]
        ctx_pos = torch.arange(t, device=features.device).expand(features.shape[0], t)
        context = self.context_kv(features, ctx_pos, fused=False)
        h = embed(block_ids).to(self.dtype)
        cos, sin = self.rotary(block_positions, h.dtype)
        for layer, ctx in zip(self.layers, context):
            h = layer(h, cos, sin, mask, context=ctx)
        return self.norm(h)

    # -- heads ------------------------------------------------------------------
    def confidence(self, h: torch.Tensor, prev: torch.Tensor, first_slot: int = 0) -> torch.Tensor:
        """Per-slot acceptance probability c_k [B, S] of draft slots first_slot.. (calibrated
        when temperatures are set)."""
        return self.confidence_from(*self.confidence_terms(h), prev, first_slot)

    def confidence_terms(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The confidence logit split by input (its projection is linear): the hidden-state
        part of every slot [B, S] (bias included) and, when the head also reads the Markov
        embedding of the previous token, that part for every token of the vocabulary [V].
        Drafting slot by slot then adds one lookup per slot, not a projection."""
        assert self.confidence_head is not None
        proj, hidden = self.confidence_head.proj, self.config.hidden_size
        h_term = F.linear(h, proj.weight[:, :hidden], proj.bias).squeeze(-1).float()
        prev_term = None
        if proj.in_features > hidden:
            assert self.markov_head is not None
            prev_term = F.linear(self.markov_head.markov_w1.weight, proj.weight[:, hidden:]).squeeze(-1).float()
        return h_term, prev_term

    def confidence_from(self, h_term: torch.Tensor, prev_term: torch.Tensor | None, prev: torch.Tensor,
                        first_slot: int = 0) -> torch.Tensor:
        """c_k [B, S] from `confidence_terms` (h_term [B, S]) and the previous tokens prev [B, S]."""
        raw = h_term if prev_term is None else h_term + prev_term[prev]
        temps = self.config.confidence_temperatures
        if temps is not None:
            raw = raw / torch.tensor(temps[first_slot:first_slot + raw.shape[-1]], device=raw.device)
        return torch.sigmoid(raw)

