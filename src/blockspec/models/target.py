"""The target decoder (Qwen3 / Llama / Qwen2 / Mistral), one class for all.

`forward` appends tokens to a KVCache (or runs cache-free for training), and
returns logits plus, when asked, the concatenated hidden states of selected
decoder layers (design section 2: hidden[0] = embeddings, hidden[i+1] = output
of layer i) without keeping every layer's states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from blockspec.config import TargetConfig
from blockspec.decoding.kv_cache import KVCache
from blockspec.models.layers import Attention, RMSNorm, RotaryEmbedding, SwiGLU, attend


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                   cfg.head_dim, cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_idx: int,
                cache: KVCache | None, slots: torch.Tensor | None,
                mask: torch.Tensor | None, upto: int) -> torch.Tensor:
        x = self.input_layernorm(h)
        attn = self.self_attn
        q = attn.project_q(x, cos, sin)
        k, v = attn.project_kv(x, cos, sin)
        if cache is None:
            out = attend(q, k, v, mask, causal=True)
        else:
            cache.write(layer_idx, k, v, slots)
            ck, cv = cache.view(layer_idx, upto)
            out = attend(q, ck, cv, mask)
        h = h + attn.output(out)
        return h + self.mlp(self.post_attention_layernorm(h))


@dataclass
class TargetOutput:
    logits: torch.Tensor               # [B, T, V] (or [B, len(logits_at), V])
    features: torch.Tensor | None      # [B, T, len(capture)*H] concatenated layer outputs


class TargetModel(nn.Module):
    def __init__(self, cfg: TargetConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope)

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

    def forward(self, input_ids: torch.Tensor, cache: KVCache | None = None, *,
                num_new: torch.Tensor | None = None, capture: tuple[int, ...] = (),
                logits_at: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> TargetOutput:
        """Run `input_ids` [B, T].

        With a cache: the tokens are appended after each row's current length,
        attention is causal, and lengths advance by `num_new` [B] (default T;
        smaller for right-padded rows). Without a cache: positions 0..T-1, causal.
        `capture`: decoder layer ids whose outputs are concatenated into `features`.
        `logits_at` [B, K]: compute logits only at these positions of the block.
        `mask`: overrides the attention mask (cache-free training uses it).
        """
        b, t = input_ids.shape
        h = self.embed_tokens(input_ids)
        if cache is None:
            positions = torch.arange(t, device=h.device).expand(b, t)
            slots, upto = None, t
        else:
            cache.check_room(t)
            positions = cache.positions(t)
            slots = positions
            if mask is None:
                mask, upto = cache.causal_mask(t)
            else:
                upto = mask.shape[-1]
        cos, sin = self.rotary(positions, h.dtype)
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, i, cache, slots, mask, upto)
            if i in capture:
                captured[i] = h
        if cache is not None:
            cache.advance(t if num_new is None else num_new)
        if logits_at is not None:
            h = h.gather(1, logits_at.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
        logits = self.lm_head(self.norm(h))
        features = torch.cat([captured[i] for i in capture], dim=-1) if capture else None
        return TargetOutput(logits, features)
