"""Building blocks shared by the target and the draft: RMSNorm, RoPE, SwiGLU,
one attention module and the one attention function."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from blockspec.config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64):
            return F.rms_norm(x, self.weight.shape, self.weight.to(x.dtype), self.eps)
        # Half precision: normalise in float32 like the reference implementations, cast back after.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if rope.rope_type == "linear":
        inv_freq = inv_freq / rope.factor
    elif rope.rope_type == "llama3":
        # Llama 3.1 frequency-dependent scaling: long wavelengths are divided by
        # `factor`, short ones kept, and the band in between interpolated.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        mid = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(is_mid, mid, scaled)
    return inv_freq.float()


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding. cos/sin tables are built once per dtype and
    grown on demand, so a decode step only indexes them."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope), persistent=False)
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def table(self, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos_sin = self._tables.get(dtype)
        if cos_sin is None or cos_sin[0].shape[0] < length or cos_sin[0].device != self.inv_freq.device:
            size = max(length, 2 * (cos_sin[0].shape[0] if cos_sin else 1024))
            freqs = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32).unsqueeze(-1) * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            cos_sin = (emb.cos().to(dtype), emb.sin().to(dtype))
            self._tables[dtype] = cos_sin
        return cos_sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] -> cos, sin [B, 1, T, head_dim]."""
        cos, sin = self.table(int(positions.max()) + 1, dtype)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class FusedLinears:
    """One GEMM for several Linear layers that read the same input (inference only).

    Checkpoints keep the separate Hugging Face tensors; the concatenated weight is
    built on first use and rebuilt if any part changes (tracked by tensor version)."""

    def __init__(self, *linears: nn.Linear) -> None:
        self.linears = linears
        self.key: tuple | None = None
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        ls = self.linears
        key = tuple((l.weight.data_ptr(), l.weight._version, l.weight.dtype) for l in ls)
        if key != self.key:
            self.weight = torch.cat([l.weight for l in ls]).detach()
            self.bias = torch.cat([l.bias for l in ls]).detach() if ls[0].bias is not None else None
            self.key = key
        return F.linear(x, self.weight, self.bias).split([l.out_features for l in ls], dim=-1)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self._gate_up = FusedLinears(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self._gate_up(x)
        return self.down_proj(F.silu(gate) * up)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: torch.Tensor | None = None, causal: bool = False) -> torch.Tensor:
    """The one attention function: q [B,H,T,D], k/v [B,Hkv,S,D]; mask [B,1,T,S] bool
    (True = may attend) or None. GQA without copying K/V (enable_gqa)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None,
                                          enable_gqa=q.shape[1] != k.shape[1])


class Attention(nn.Module):
    """Projections and norms of one attention layer (HF parameter names).

    The forward pass lives with the caller because target and draft feed it
    differently; this module owns the weights and the q/k preparation."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, qkv_bias: bool,
                 o_bias: bool, qk_norm: bool, eps: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps)
            self.k_norm = RMSNorm(head_dim, eps)
        else:
            self.q_norm = self.k_norm = None
        self._qkv = FusedLinears(self.q_proj, self.k_proj, self.v_proj)

    def split(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """[B, T, heads*D] -> [B, heads, T, D]."""
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.split(self.q_proj(x), self.heads)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin)

    def prepare_k(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """k already projected, [B, T, Hkv*D] -> normed + rotated [B, Hkv, T, D]."""
        k = self.split(k, self.kv_heads)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, cos, sin)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.prepare_k(self.k_proj(x), cos, sin), self.split(self.v_proj(x), self.kv_heads)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Q, K, V of the same input; one fused GEMM when no gradient is needed."""
        if torch.is_grad_enabled():
            return (self.project_q(x, cos, sin), *self.project_kv(x, cos, sin))
        q, k, v = self._qkv(x)
        q = self.split(q, self.heads)
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, cos, sin), self.prepare_k(k, cos, sin), self.split(v, self.kv_heads)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        b, _, t, _ = attn.shape
        return self.o_proj(attn.transpose(1, 2).reshape(b, t, self.heads * self.head_dim))
