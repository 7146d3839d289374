"""The DFlash draft (docs/design.md section 3), with optional DSpark heads.

Per round: the target features of newly committed positions become K/V in
every draft layer's cache (`append_context`), then the block
`[anchor, MASK, ...]` runs non-causally over [cached context ; block] in ONE
forward (`block_hidden`). Block K/V are written into the slots right after
the context and never kept (the row length does not advance), so the next
context append simply overwrites them.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import torch
import torch.utils.checkpoint
from torch import nn

from blockspec.config import DraftConfig
from blockspec.errors import BlockspecError
from blockspec.models.attention import ALL_KEYS, KeyMask, band_mask, limit_mask
from blockspec.models.heads import ConfidenceHead, MarkovHead
from blockspec.models.kv_cache import KVCache
from blockspec.models.layers import (Attention, AttentionShape, CacheAccess, FusedLinears, Linear, RMSNorm,
                                     RotaryEmbedding, SwiGLU)
from blockspec.models.window_cache import WindowedKVCache

DraftCache = KVCache | WindowedKVCache


class DraftLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        shape = AttentionShape(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                               eps=cfg.rms_norm_eps)   # no biases, q/k norms: both draft layouts
        self.self_attn = Attention(shape, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | KeyMask | None,
                kv: CacheAccess | None = None, context: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> torch.Tensor:
        """Block tokens h attend (non-causally, under `mask`) to context K/V plus the block's own:
        the cache's (`kv`: block K/V written at its slots right after each row's context, read
        up to its `upto`) or an explicit `context` (k, v) [B, Hkv, S, D] (training)."""
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask, kv, context=context)
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
        self.layers = nn.ModuleList(DraftLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)
        self.markov_head = (MarkovHead(cfg.vocab_size, cfg.hidden_size, cfg.markov_rank, cfg.markov_head_type)
                            if cfg.markov_rank > 0 else None)
        conf_rank = cfg.markov_rank if (cfg.confidence_head_with_markov and cfg.markov_rank > 0) else 0
        self.confidence_head = ConfidenceHead(cfg.hidden_size, conf_rank) if cfg.enable_confidence_head else None
        # Every layer's k_proj and v_proj in one GEMM over the context (inference).
        self._temps_key: tuple | None = None   # the confidence temperatures as a tensor (`_calibrated`)
        self._temps: torch.Tensor | None = None
        self._context_kv = FusedLinears(*(p for l in self.layers for p in (l.self_attn.k_proj, l.self_attn.v_proj)))

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def with_block_size(self, block_size: int) -> "DraftModel":
        """This draft running a shorter block than trained (fewer drafts per round): a new
        DraftModel with its own config value that shares every weight with this one."""
        cfg = self.config
        if block_size < (2 if cfg.layout == "zlab" else 1):
            raise BlockspecError(f"block size {block_size} is too small for the {cfg.layout} layout")
        if block_size > cfg.block_size:
            raise BlockspecError(f"block size {block_size} exceeds the {cfg.block_size} this draft was trained with")
        shorter = replace(cfg, block_size=block_size, confidence_temperatures=None)
        temps = cfg.confidence_temperatures
        return self.with_config(shorter if temps is None else
                                replace(shorter, confidence_temperatures=temps[:shorter.num_drafts]))

    def with_config(self, cfg: DraftConfig) -> "DraftModel":
        """A new DraftModel with config `cfg` over the same modules and parameter tensors (no
        copy). Only settings that leave the weights' shapes alone may differ (block size,
        confidence temperatures)."""
        old = self.config
        if replace(cfg, block_size=old.block_size, confidence_temperatures=old.confidence_temperatures) != old:
            raise BlockspecError("with_config may change only block_size and confidence_temperatures")
        new = copy.copy(self)
        # Own attribute dicts, shared children: assigning a submodule later stays private.
        new.__dict__.update(_parameters=dict(self._parameters), _buffers=dict(self._buffers),
                            _modules=dict(self._modules))
        new.config = cfg
        return new

    def new_cache(self, rows: int, capacity: int) -> DraftCache:
        """The draft context's cache; sliding layers keep only their window (window_cache.py)."""
        cfg = self.config
        if cfg.is_windowed:
            ring = tuple(cfg.layer_window(i) is not None for i in range(cfg.num_hidden_layers))
            return WindowedKVCache(ring, rows, cfg.num_key_value_heads, cfg.head_dim, capacity, cfg.window_span,
                                   self.dtype, self.fc.weight.device)
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

    def append_context(self, cache: DraftCache, features: torch.Tensor, num_new: torch.Tensor | int) -> None:
        """Write K/V for the next features.shape[1] positions of every row; rows advance by num_new."""
        width = features.shape[1]
        cache.check_room(width)
        slots = cache.positions(width)
        counts = torch.as_tensor(num_new, device=slots.device).expand(slots.shape[0])
        for i, (k, v) in enumerate(self.context_kv(features, slots)):
            cache.write(i, k, v, slots, counts)
        cache.advance(num_new)

    # -- block ------------------------------------------------------------------
    def block_hidden(self, block_ids: torch.Tensor, cache: DraftCache, embed: nn.Embedding) -> torch.Tensor:
        """block_ids [B, S] at positions cache.lengths.. -> normed hidden states [B, S, H]."""
        b, s = block_ids.shape
        upto = cache.check_room(s) + s
        slots = cache.positions(s)
        masks = self._block_masks(cache, s, upto)
        h = embed(block_ids).to(self.dtype)
        cos, sin = self.rotary(slots, h.dtype)
        kv = CacheAccess(cache, slots, upto)
        for layer, mask in zip(self.layers, masks):
            h = layer(h, cos, sin, mask, kv)
        return self.norm(h)

    def _block_masks(self, cache: DraftCache, width: int, upto: int) -> list[KeyMask]:
        """Each layer's mask for a block of `width` after each row's context. A full, non-causal
        layer's only constraint is each row's key length (context + block): a [B, 1, 1, K] mask
        or a flex block mask (attention.py; one row sees every key). A sliding or causal layer
        gets the dense band of `band_mask`, over its ring's positions when it keeps one; a
        window no key can leave (upto <= W) is no constraint, so a window covering the whole
        context gives the full layer's mask, bit for bit."""
        cfg = self.config
        lengths = cache.lengths
        plain = ALL_KEYS if lengths.shape[0] == 1 else limit_mask(lengths + width, width, upto, causal=False)
        masks: dict[tuple, KeyMask] = {}
        out = []
        for i in range(cfg.num_hidden_layers):
            window, causal = cfg.layer_window(i), cfg.layer_causal(i)
            ring = isinstance(cache, WindowedKVCache) and cache.is_ring(i)
            if window is not None and upto <= window:
                window = None
            key = (window, causal, ring)
            if key not in masks:
                if window is None and not causal:
                    masks[key] = plain
                else:
                    pos = (cache.key_positions(lengths + width - 1, upto) if ring
                           else torch.arange(upto, device=lengths.device).unsqueeze(0))
                    masks[key] = band_mask(pos, lengths, width, window, causal)
            out.append(masks[key])
        return out

    def forward(self, features: torch.Tensor, block_ids: torch.Tensor, block_positions: torch.Tensor,
                       mask: torch.Tensor | list[torch.Tensor], embed: nn.Embedding, checkpoint_layers: bool = False,
                       context_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Training forward (packed): context of every position [B, T] plus many blocks at once.

        block_ids / block_positions [B, N]; mask [B, 1, N, T + N] (True = may attend), or one
        per layer (a draft with sliding layers).
        `checkpoint_layers`: keep only each layer's input and recompute the layer in backward
        (activation checkpointing: less memory for one more layer forward).
        `context_positions` [B, T]: the context's RoPE positions (default 0..T-1; packed rows
        restart at 0 per sequence).
        Returns normed hidden states of the block tokens [B, N, H]."""
        t = features.shape[1]
        ctx_pos = (torch.arange(t, device=features.device).expand(features.shape[0], t)
                   if context_positions is None else context_positions)
        context = self.context_kv(features, ctx_pos, fused=False)
        h = embed(block_ids).to(self.dtype)
        cos, sin = self.rotary(block_positions, h.dtype)
        masks = mask if isinstance(mask, list) else [mask] * len(self.layers)
        for layer, ctx, m in zip(self.layers, context, masks):
            if checkpoint_layers and torch.is_grad_enabled():
                h = torch.utils.checkpoint.checkpoint(layer, h, cos, sin, m, context=ctx, use_reentrant=False)
            else:
                h = layer(h, cos, sin, m, context=ctx)
        return self.norm(h)

    # -- heads ------------------------------------------------------------------
    def confidence_logit(self, h: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Uncalibrated confidence logits [B, S] of slots h [B, S, H] after the tokens prev [B, S]
        (training: the same head terms as `confidence_terms`, prev looked up first)."""
        head = self.confidence_head
        assert head is not None
        return head.logit(h, self.markov_head.markov_w1(prev) if head.reads_prev else None)

    def confidence(self, h: torch.Tensor, prev: torch.Tensor, first_slot: int = 0) -> torch.Tensor:
        """Per-slot acceptance probability c_k [B, S] of draft slots first_slot.. (calibrated
        when temperatures are set). Looks up only the B x S previous tokens' terms."""
        return self._calibrated(self.confidence_logit(h, prev).float(), first_slot)

    def confidence_terms(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The confidence logit split by input (`ConfidenceHead`): the hidden-state part of
        every slot [B, S] and, when the head also reads the Markov embedding of the previous
        token, that part for every token of the vocabulary [V]. Drafting slot by slot then
        adds one lookup per slot, not a projection."""
        head = self.confidence_head
        assert head is not None
        prev_term = head.prev_term(self.markov_head.markov_w1.weight).float() if head.reads_prev else None
        return head.hidden_term(h).float(), prev_term

    def confidence_from(self, h_term: torch.Tensor, prev_term: torch.Tensor | None, prev: torch.Tensor,
                        first_slot: int = 0) -> torch.Tensor:
        """c_k [B, S] from `confidence_terms` (h_term [B, S]) and the previous tokens prev [B, S]."""
        return self._calibrated(h_term if prev_term is None else h_term + prev_term[prev], first_slot)

    def _calibrated(self, logit: torch.Tensor, first_slot: int) -> torch.Tensor:
        """sigmoid(logit / T_k) for slots first_slot.. (T: the STS temperatures, if any)."""
        temps = self.config.confidence_temperatures
        if temps is None:
            return torch.sigmoid(logit)
        key = (temps, logit.device)
        if self._temps_key != key:   # built once per config and device, not once per drafted slot
            self._temps = torch.tensor(temps, device=logit.device)
            self._temps_key = key
        return torch.sigmoid(logit / self._temps[first_slot:first_slot + logit.shape[-1]])
